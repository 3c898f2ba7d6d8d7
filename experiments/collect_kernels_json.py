"""Assembles `experiments/results/kernels_h200.json` from the H200 runs of `bench_kernels.py`.

One run of `bench_kernels.py` writes the whole file; when the figures of the current kernels come
from several runs (the device time of a session is short), this script takes each kernel family
from the run that measured the current version and records which run each record came from.

    PYTHONPATH=. python3 experiments/collect_kernels_json.py
"""

from __future__ import annotations

import json
import pathlib

from experiments.bench_kernels import add_ratio_to_d256

RESULTS = pathlib.Path(__file__).parent / "results"

# (file, kernel names taken from it): the newest run measuring each family with current defaults.
# v6: one full `bench_kernels.py` run (decode, window, fp8, the built-in peer, prefill with
# cuDNN, kv_write) after the 32-token rings and the wave-count split rule. gather_step and
# model_decode come from `bench_model.py` (kernel times from profiler traces), v3. The sweeps
# behind the defaults stay in their own files (`*_sweep*.json`).
SOURCES = [
    (
        "kernels_h200_v6.json",
        (
            "decode",
            "decode_window",
            "builtin_paged_decode",
            "prefill",
            "prefill_dense_cudnn",
            "kv_write",
            "kv_write_xla_scatter",
        ),
    ),
    ("model_h200_v3.json", ("gather_step", "model_decode")),
]


def main():
    out = {"records": [], "sources": {}}
    for name, kernels in SOURCES:
        run = json.loads((RESULTS / name).read_text())
        if "device" not in out:
            out.update(device=run["device"], jax_version=run["jax_version"])
            out["copy_tbs"] = run["copy_tbs"]
            out["copy_tbs_by_library"] = run["copy_tbs_by_library"]
        out["sources"][name] = {
            "argv": run.get("argv"),
            "kernels": list(kernels),
            "copy_tbs": run.get("copy_tbs"),
        }
        for record in run["records"]:
            if record["kernel"] in kernels:
                out["records"].append({**record, "source": name})
    add_ratio_to_d256(out["records"])  # both prefill records come from one run (SOURCES)
    (RESULTS / "kernels_h200.json").write_text(json.dumps(out, indent=1))
    for r in out["records"]:
        if r.get("kernel", "").endswith("_try"):
            continue
        rate = r.get("tbs", r.get("tflops"))
        unit = "TB/s" if "tbs" in r else "TFLOP/s"
        print(
            f"{r['kernel']:<22} {json.dumps(r.get('shape', {}))[:84]:<84} "
            f"{r.get('time_ms') or float('nan'):8.3f} ms {rate or float('nan'):8.2f} {unit}"
        )


if __name__ == "__main__":
    main()
