"""Smoke tests of experiments/kv_memory.py, experiments/walkthrough.py and the preset mode of
experiments/bench_kernels.py at tiny sizes.

The scripts are loaded from their files (nothing imports `experiments` as a package). Oracles:
the gemma configs' own bytes per token (full mode), hand-computed slot counts, the DESIGN.md
worked example, and a real `swajax.Engine` run (its peak slots vs the budget simulation).
"""

import importlib.util
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import gemma  # noqa: E402
import swajax  # noqa: E402

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(
        f"_experiments_{name}", EXPERIMENTS / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


kv_memory = _load("kv_memory")
walkthrough = _load("walkthrough")
bench_kernels = _load("bench_kernels")


# ----------------------------------------------------------------------------- kv_memory


@pytest.mark.parametrize("preset", ["gemma3_1b", "gemma4_e2b", "gemma4_12b"])
def test_full_mode_is_every_writer_layer_times_tokens(preset):
    # 3000 tokens: not a multiple of the page size, so the last partial block counts whole.
    # Chunk 2048 > every window: scratch only helps when part of a chunk goes stale in its step.
    rows = kv_memory.memory_rows([preset], [3000], chunk=2048)
    config = gemma.configs.preset(preset)
    per_token = config.kv_bytes_per_token("bfloat16")
    counts = config.kv_layer_counts
    expected = 3008 * sum(counts[t] * per_token[t] for t in counts)  # ceil(3000/32) * 32 tokens
    (row,) = rows
    assert row["full"] == {"steady": expected, "peak": expected}
    assert row["scratch"]["steady"] == row["release"]["steady"] < expected
    assert row["scratch"]["peak"] < row["release"]["peak"] <= expected


def test_headline_gemma4_e2b_8k_by_hand():
    # E2B: 15 KV writers, 12 sliding (1 KV head x 256, bf16: 1024 B/token) and 3 full
    # (1 x 512: 2048 B/token); window 512, page 32, one 8K chunk.
    rows = kv_memory.memory_rows(["gemma4_e2b"], [8192])
    h = kv_memory.headline(rows)
    full_layers = 8192 * 3 * 2048
    # without scratch the one chunk sits in every sliding layer at the peak
    assert h["peak_bytes_without_scratch"] == full_layers + 8192 * 12 * 1024 == 150_994_944
    # with scratch: blocks [0, 240) are stale by the end (floor((8192 + 1 - 512) / 32) = 240):
    # ceil(240 * 2 / 24) = 20 scratch slots; the last 16 blocks (the window) stay normal;
    # one slot = 12 layers x 32 tokens x 1024 B
    slot = 12 * 32 * 1024
    assert h["peak_bytes_with_scratch"] == full_layers + (16 + 20) * slot == 64_487_424
    assert h["saving_pct"] == pytest.approx(100 * (1 - 64_487_424 / 150_994_944))


def test_engine_peak_slots_match_kv_bytes_per_sequence():
    records = kv_memory.cross_checks(fast=True)
    assert [r["mode"] for r in records] == ["release", "scratch"]
    for r in records:
        assert r["engine_peak_slots"] == r["predicted_peak_slots"], r
        assert r["engine_peak_bytes"] == r["kv_bytes_per_sequence"]["peak"], r
        assert r["bytes_agree"] and r["slots_agree"] and r["same_tokens_scratch_on_off"]
    release, scratch = records
    assert scratch["engine_peak_bytes"] < release["engine_peak_bytes"]


def test_kv_memory_main_writes_json_and_png(tmp_path, capsys):
    result = kv_memory.main(["--out", str(tmp_path), "--no-engine"])
    out = capsys.readouterr().out
    assert "headline: Gemma 4 E2B at 8K" in out
    data = json.loads((tmp_path / "kv_memory.json").read_text())
    assert data["rows"] == result["rows"]
    assert len(data["rows"]) == len(kv_memory.PRESETS) * len(kv_memory.INPUT_LENGTHS)
    assert data["parameters"]["page_size"] == 32 and data["versions"]["jax"]
    assert (tmp_path / "kv_memory.png").stat().st_size > 10_000


# ----------------------------------------------------------------------------- walkthrough


@pytest.fixture(scope="module")
def traces():
    steps = walkthrough.step_sizes(400, 128, 3)
    layout_on = walkthrough.build_layout(scratch=True)
    layout_off = walkthrough.build_layout(scratch=False)
    return (
        steps,
        layout_on,
        walkthrough.trace_steps(layout_on, steps),
        layout_off,
        walkthrough.trace_steps(layout_off, steps),
    )


def test_walkthrough_trace_page_tables(traces):
    steps, layout, trace, _, _ = traces
    assert [s.label for s in trace][-1] == "free" and trace[-1].held_after == [0, 0]
    sliding = [l for l in range(layout.num_layers) if layout.layer_specs[l].is_sliding]
    scale = layout.pools[0].scale
    saw_scratch = False
    for s in trace[:-1]:
        k, v = s.tables[:, 0], s.tables[:, 1]  # [layers, NB]
        np.testing.assert_array_equal(k == swajax.BAD, v == swajax.BAD)
        np.testing.assert_array_equal(v[k != swajax.BAD], k[k != swajax.BAD] + 1)
        for o in range(k.shape[1]):  # no two sliding layers share a page at one block
            col = k[sliding, o]
            col = col[col != swajax.BAD]
            assert len(set(col.tolist())) == len(col)
        begin, end = s.scratch_range[0]
        if end > begin:
            saw_scratch = True
            pages = k[sliding, begin:end]
            assert set((pages // scale).ravel().tolist()) <= set(s.scratch_slots[0])
    assert saw_scratch


def test_walkthrough_slot_counts(traces):
    steps, layout_on, trace_on, layout_off, trace_off = traces

    def peak(trace):
        return [max(s.normal_slots[g] + s.scratch_slot_count[g] for s in trace) for g in (0, 1)]

    # window 64 = 4 blocks of history kept + a chunk of 8 blocks; with scratch 4 of the 8 are
    # stale by the end of the step: 4 normal + 1 scratch slot (ceil(4 * 2 / 10)).
    # full group: ceil(403 / 16) = 26 blocks.
    assert peak(trace_on) == [4 + 4 + 1, 26]
    assert peak(trace_off) == [4 + 8, 26]
    # the budget simulation (Python sets) agrees with the transforms (jnp)
    for layout, trace in ((layout_on, trace_on), (layout_off, trace_off)):
        assert list(swajax.request_slots(layout, 400, chunk=128, max_new_tokens=3)) == peak(trace)


def test_walkthrough_plots(traces, tmp_path):
    _, layout, trace_on, _, trace_off = traces
    fig = walkthrough.plot_page_tables(layout, trace_on)
    fig.savefig(tmp_path / "tables.png")
    fig = walkthrough.plot_occupancy(layout, trace_on, trace_off)
    fig.savefig(tmp_path / "occupancy.png")
    assert (tmp_path / "tables.png").stat().st_size > 10_000
    assert (tmp_path / "occupancy.png").stat().st_size > 10_000
    assert "pool group 0: life cycle (window, sink_blocks) = (64, 0)" in (
        walkthrough.describe_layout(layout)
    )


def test_walkthrough_worked_example_is_design_table():
    # DESIGN.md section 2, worked example (K/V pages of layers 0..2 at blocks 4..8)
    design = [
        ["42/43", "44/45", "46/47", "54/55", "56/57"],
        ["44/45", "46/47", "42/43", "56/57", "58/59"],
        ["46/47", "42/43", "44/45", "58/59", "54/55"],
    ]
    pages = walkthrough.worked_example()
    assert [[f"{k}/{v}" for k, v in row] for row in pages.tolist()] == design
    assert "| 1 | 44/45 | 46/47 | 42/43 | 56/57 | 58/59 |" in walkthrough.format_worked_example(
        pages
    )


# ----------------------------------------------------------------------------- bench_kernels


def test_bench_kernels_presets_quick(tmp_path, monkeypatch, capsys):
    """`--presets --quick`: every section runs (reference implementation, tiny sizes) and
    each record names its geometry and the presets that use it, as the H200 run's will."""
    out = tmp_path / "presets.json"
    monkeypatch.setattr(sys, "argv", ["bench_kernels", "--presets", "--quick", "--out", str(out)])
    bench_kernels.main()
    res = json.loads(out.read_text())
    records = res["records"]
    assert [r for r in records if "error" in r] == []
    assert {r["kernel"] for r in records} == {"decode", "prefill", "kv_write"}
    geometries = {g.id: g.presets for g in gemma.configs.attention_geometries()}
    for r in records:
        ids = r.get("geometries", [r["geometry"]])  # kv_write: every geometry of its row
        assert sorted(r["preset"]) == sorted({p for i in ids for p in geometries[i]}), r
    decode = [r for r in records if r["kernel"] == "decode"]
    assert {r["case"] for r in decode} == {
        "full",
        "sliding_at_full_context",
        "sliding_window",
        "fp8_vs_bf16",
    }
    assert any("ratio_to_bf16" in r for r in decode if r["shape"]["dtype"] == "float8_e4m3fn")
    assert all(
        "ratio_to_d256" in r
        for r in records
        if r["kernel"] == "prefill" and r["shape"]["head_dim"] == 512
    )
    assert res["versions"]["jax"] and res["copy_tbs"] > 0 and res["sources_sha256"]
    assert "q8kv1d512-full" in capsys.readouterr().out
