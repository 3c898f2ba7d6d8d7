"""Smoke tests of experiments/kv_memory.py, experiments/walkthrough.py, the preset mode of
experiments/bench_kernels.py and experiments/swa_scratch_throughput.py at tiny sizes.

The scripts are loaded from their files (nothing imports `experiments` as a package). Oracles:
the gemma configs' own bytes per token (full mode), hand-computed slot counts, the docs/design.md
worked example, and a real `swajax.Engine` run (its peak slots vs the budget simulation).
"""

import importlib.util
import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402

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
swa_scratch = _load("swa_scratch_throughput")


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
    assert len(data["git_commit"]) == 40
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
        np.testing.assert_array_equal(k == swajax.pool.BAD, v == swajax.pool.BAD)
        np.testing.assert_array_equal(v[k != swajax.pool.BAD], k[k != swajax.pool.BAD] + 1)
        for o in range(k.shape[1]):  # no two sliding layers share a page at one block
            col = k[sliding, o]
            col = col[col != swajax.pool.BAD]
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
        assert list(swajax.pool.request_slots(layout, 400, chunk=128, max_new_tokens=3)) == peak(
            trace
        )


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
    # docs/design.md "The KV memory model", worked example (K/V pages of layers 0..2 at blocks 4..8)
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


# ----------------------------------------------------------------------------- swa_scratch


def test_swa_scratch_throughput_quick(tmp_path, capsys):
    """The experiment at tiny sizes on CPU: a chunk (128) eight times the window (16), five
    sliding layers in one pool. Oracles: the OFF cells' tokens (greedy), the cap, and the
    ledger simulation of the same workload (it plans what the engine runs)."""
    out = tmp_path / "swa.json"
    argv = ["--quick", "--setups", "pinned_8k,online", "--control", "--out", str(out)]
    swa_scratch.main(argv)
    data = json.loads(out.read_text())
    recs = {(r["setup"], r["scratch"]): r for r in data["records"]}
    # the control: pinned_8k ON again after the other cells, the same tokens, outside the table
    control = recs.pop(("control", True))
    assert control["control_of"] == "pinned_8k" and control["same_tokens_as_first_run"] is True
    assert control["request_digests"] == recs["pinned_8k", True]["request_digests"]
    assert "same_tokens_as_off" not in control and "control" not in data["comparison"]["gemma4_e2b"]
    assert set(recs) == {(s, sc) for s in ("pinned_8k", "online") for sc in (False, True)}
    assert [r.get("error") for r in recs.values() if "error" in r] == []
    assert all(r["workload"]["prefill_cut_align"] == 128 for r in recs.values())
    on, off = recs["pinned_8k", True], recs["pinned_8k", False]
    assert all(r["same_tokens_as_off"] for r in recs.values() if r["scratch"])
    assert len({r["request_digests"] and tuple(r["request_digests"]) for r in recs.values()}) == 1
    assert on["first_token_agreement"] == 1.0 and on["mean_common_prefix"] == len(
        off["request_heads"][0]
    )
    # the same cap: scratch ON frees sliding bytes for full-layer history, so more rows run
    cap = data["caps"]["gemma4_e2b"]
    assert all(r["kv_cap_bytes"] == cap >= r["pool_bytes"] for r in recs.values())
    assert on["max_concurrent"] > off["max_concurrent"]
    assert on["num_slots"][1] > off["num_slots"][1]  # group 1: the full layers
    for r in recs.values():
        assert r["traces_in_run"] == 0  # the warm-up (online: its untimed run) compiled all
        assert r["output_tokens"] == 8 * 8 and r["output_tokens_per_s"] > 0
        assert r["decode_steps"] > 0 and 1 <= r["mean_decode_rows"] <= r["max_concurrent"]
        assert 0 < r["prefill_share"] < 1 and r["decode_s"] > 0
        if r["setup"] == "online":  # split by the engine as demand moved; not simulated
            assert r["resplits"] >= 1 and r["warmup_s"] > 0
            assert set(r["split_from"]) == {
                "rebalance_ema",
                "rebalance_threshold",
                "rebalance_cooldown",
            }
            continue
        assert r["resplits"] == 0 and r["warmup_s"] is None
        p = r["predicted"]
        assert (p["steps"], p["max_concurrent"], p["preemptions"]) == (
            r["steps"],
            r["max_concurrent"],
            r["preemptions"],
        )
        assert p["peak_slots"] == r["peak_slots"] and p["num_slots"] == r["num_slots"]
    row = data["comparison"]["gemma4_e2b"]
    assert row["pinned_8k"]["published_pct"] == 59.6
    assert row["online"]["best_off"] in ("pinned_8k", "online")
    assert row["best"]["change_pct"] is not None
    table = capsys.readouterr().out
    assert "gemma4_e2b     pinned_8k" in table and "+59.6" in table
    assert "gemma4_e2b     online" in table and "best ON (" in table
    assert "control gemma4_e2b pinned_8k ON run again last" in table
    assert (tmp_path / "swa.png").stat().st_size > 10_000
    # a second invocation replaces its cells and keeps the others
    swa_scratch.main(["--quick", "--setups", "adaptive", "--profile", "2", "--out", str(out)])
    again = json.loads(out.read_text())
    assert len(again["runs"]) == 2 and len(again["records"]) == 7
    adaptive = next(r for r in again["records"] if r["setup"] == "adaptive" and r["scratch"])
    assert adaptive["profile"]["requests"] == 2 and adaptive["profile"]["steps"] > 8
    assert adaptive["profile"]["wall_s"] > 0
    assert adaptive["max_concurrent"] > off["max_concurrent"]
    assert adaptive["same_tokens_as_off"]
    assert {(r["setup"], r["scratch"]) for r in again["records"]} == {
        *recs,
        ("control", True),
        ("adaptive", True),
        ("adaptive", False),
    }


def test_swa_scratch_experts_in_place_bound_is_part_of_the_workload():
    """`--experts-in-place-max-rows` (0: the MoE experts copied out of their stack, JAX's
    kernel alone) is checked and recorded in the workload only when set, so that cells of
    either form are never compared with each other."""
    _, params, _, _ = swa_scratch.parse(["--quick"])
    assert params.experts_in_place_max_rows is None
    assert "experts_in_place_max_rows" not in params.workload
    _, params, _, _ = swa_scratch.parse(["--quick", "--experts-in-place-max-rows", "0"])
    assert params.workload["experts_in_place_max_rows"] == 0
    with pytest.raises(SystemExit):
        swa_scratch.parse(["--quick", "--experts-in-place-max-rows", "-1"])


def test_swa_scratch_records_merge_and_token_check():
    def rec(setup, scratch, digests, **kw):
        return dict(
            preset="p",
            setup=setup,
            scratch=scratch,
            workload={"n": 1},
            request_digests=digests,
            output_tokens_per_s=kw.pop("tps", 10.0),
            **kw,
        )

    old = [
        rec("pinned_8k", False, ["a", "b"], request_heads=[[1, 2, 3], [4, 5, 6]]),
        rec("pinned_8k", True, ["a", "x"]),
    ]
    new = [
        rec("pinned_8k", True, ["a", "b"], tps=15.0),
        rec("adaptive", True, ["a", "c"], request_heads=[[1, 2, 3], [4, 9, 6]]),
    ]
    merged = swa_scratch.merge(old, new)
    assert [(r["setup"], r["scratch"]) for r in merged] == [
        ("pinned_8k", False),
        ("pinned_8k", True),
        ("adaptive", True),
    ]
    swa_scratch.mark_same_tokens(merged)
    assert merged[1]["same_tokens_as_off"] and not merged[2]["same_tokens_as_off"]
    assert merged[2]["requests_differing_from_off"] == [1]
    # request 1 parts from OFF at its second token: prefixes 3 and 1
    assert merged[2]["first_token_agreement"] == 1.0 and merged[2]["mean_common_prefix"] == 2.0
    assert "first_token_agreement" not in merged[1]  # no heads recorded
    comp = swa_scratch.comparison(merged)["p"]
    assert comp["pinned_8k"]["change_pct"] == pytest.approx(50.0)
    # adaptive ON (10 tok/s) has no OFF cell of its own: against the best OFF (pinned_8k)
    assert comp["adaptive"]["change_pct"] is None
    assert comp["adaptive"]["best_off"] == "pinned_8k"
    assert comp["adaptive"]["change_vs_best_off_pct"] == pytest.approx(0.0)
    assert comp["adaptive"]["vs_best_fixed_on_pct"] == pytest.approx(100.0 * (10 / 15 - 1))
    assert comp["best"] == dict(on="pinned_8k", off="pinned_8k", change_pct=pytest.approx(50.0))


def test_swa_scratch_divergence_check_recomputes_logits_alone():
    """check_divergences on outputs made to differ: ON's token at a chosen position replaced.
    Oracle: the dense forward `model(tokens)` of prompt + the common prefix (its last logits);
    OFF's token is its argmax (greedy), the replaced token is not a near tie of it."""
    from flax import nnx

    params = swa_scratch.QUICK
    config = swa_scratch.model_config("gemma4_e2b", params)
    model = gemma.Transformer(config, rngs=nnx.Rngs(0))
    prompts = [[3, 7, 11, 5] * 5, [9, 2] * 12]
    engine = swa_scratch.divergence_engine(model, params, 64)
    off, _ = engine.run(prompts, 6)
    on = [list(o) for o in off]
    dense = np.asarray(model(np.asarray([prompts[1] + off[1][:3]])))[0, -1]
    on[1][3] = int(np.argsort(dense)[len(dense) // 2])  # a median token: far from the top
    check = swa_scratch.check_divergences(engine, prompts, on, off, limit=4)
    assert (check["differing"], check["checked"], check["near_ties"]) == (1, 1, 0)
    (d,) = check["details"]
    assert (d["request"], d["position"], d["off_token"], d["on_token"]) == (
        1,
        3,
        off[1][3],
        on[1][3],
    )
    assert d["alone_token"] == off[1][3] == int(dense.argmax())
    np.testing.assert_allclose(
        [d["top_logit"], d["on_logit"]], [dense.max(), dense[on[1][3]]], rtol=1e-4, atol=1e-5
    )
    assert d["rel_gap"] == pytest.approx(
        (dense.max() - dense[on[1][3]]) / max(1.0, abs(dense.max())), rel=1e-3
    )
    assert d["rel_gap"] > swa_scratch.NEAR_TIE
    assert swa_scratch.check_divergences(engine, prompts, off, off, limit=4)["differing"] == 0


def test_bench_cold_start_lowering_with_the_step_cache():
    """bench_cold_start --lowering on one preset: the step exported, serialized, read back and
    lowered for CUDA embeds every Mosaic GPU kernel the plain lowering has."""
    bench = _load("bench_cold_start")
    rec = bench.lowering_record("gemma3_1b")
    assert [v["decode"] for v in rec["variants"]] == [False, True]
    # the decode step keeps the layer scan (a loop) and reads the matrices with the kernel
    decode = rec["variants"][1]
    assert decode["while_loops"] > 0
    for v in rec["variants"]:
        assert v["mosaic_kernels_plain"] > 0
        assert v["mosaic_kernels_cached"] == v["mosaic_kernels_plain"]
        assert v["serialized_bytes"] > 0


# ----------------------------------------------------------------------------- bench_host

bench_host = _load("bench_host")


def test_bench_host_times_every_stage_at_the_rows_asked(tmp_path):
    out = tmp_path / "host.json"
    res = bench_host.main(
        [
            "--presets",
            "gemma3_270m",
            "--rows",
            "1,3",
            "--input",
            "300",
            "--steps",
            "12",
            "--out",
            str(out),
        ]
    )
    assert json.loads(out.read_text())["records"] == res["records"]
    assert [(r["scratch"], r["rows"]) for r in res["records"]] == [
        (False, 1),
        (False, 3),
        (True, 1),
        (True, 3),
    ]
    for r in res["records"]:
        assert r["decode_steps"] >= 8
        assert all(r["us_median"][s] > 0 for s in bench_host.STAGES)
        assert r["us_median"]["total"] <= r["us_p90"]["total"]


_CACHE_DIR = "jax_compilation_cache_dir"
_MIN_COMPILE_S = "jax_persistent_cache_min_compile_time_secs"


def test_precompiled_cells_are_what_the_cells_compile(tmp_path, monkeypatch):
    """`precompile_cells` lowers each distinct layout once, holds one cell engine (pool) at a
    time, and fills the persistent compilation cache with exactly the executables each cell's
    own `precompile` then asks for: the cells compile nothing new."""
    import gc
    import weakref

    from jax._src import compilation_cache

    params = swa_scratch.QUICK
    config = swa_scratch.model_config("gemma4_e2b", params)
    prompts = swa_scratch.make_prompts(config.vocab_size, params)
    cap = swa_scratch.kv_cap_bytes(config, params)
    dtype = jnp.dtype(params.weight_dtype)
    model = gemma.Transformer(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=dtype)
    cells = [("pinned_8k", False), ("pinned_8k", True), ("adaptive", True)]

    engines = []
    make = swa_scratch.cell_engine

    def tracked(*args, **kw):
        gc.collect()
        assert all(e() is None for e in engines), "a previous cell's engine is still alive"
        engine, derived = make(*args, **kw)
        engines.append(weakref.ref(engine))
        return engine, derived

    cache = tmp_path / "jax-cache"
    monkeypatch.setattr(swa_scratch, "cell_engine", tracked)
    saved = {k: getattr(jax.config, k) for k in (_CACHE_DIR, _MIN_COMPILE_S)}
    jax.config.update(_CACHE_DIR, str(cache))
    jax.config.update(_MIN_COMPILE_S, 0.0)
    compilation_cache.reset_cache()
    jax.clear_caches()  # earlier tests' executables of the same steps are in memory
    try:
        report = swa_scratch.precompile_cells(model, config, params, cells, cap, prompts, 2)
        gc.collect()
        assert len(engines) == 3 and all(e() is None for e in engines)
        # pinned_8k ON and OFF split the cap differently; adaptive's split is ON's here
        layouts = {swa_scratch.cell_layout(config, params, s, sc, cap, prompts) for s, sc in cells}
        assert report["layouts"] == len(layouts) == 2
        engine, _ = make(model, config, params, *cells[-1], cap, prompts)
        assert report["variants"] == 2 * len(engine.step_buckets())
        entries = sorted(p.name for p in cache.iterdir())
        assert len(entries) >= report["variants"]
        jax.clear_caches()  # as in a new process: only the persistent cache holds them
        engine.precompile()  # a cell's own compile: every executable from the cache
        assert sorted(p.name for p in cache.iterdir()) == entries
    finally:
        for k, v in saved.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


# ----------------------------------------------------------------------------- bench_moe
bench_moe = _load("bench_moe")


def test_bench_moe_quick(tmp_path):
    """The MoE decode benchmark at a tiny geometry: the tile kernel (interpret mode) reading the
    last layer's experts in the stack agrees with ragged_dot on that layer's own array."""
    out = tmp_path / "moe.json"
    res = bench_moe.main(["--quick", "--out", str(out)])
    (rec,) = json.loads(out.read_text())["records"]
    assert res["records"][0] == rec and "error" not in rec
    assert rec["form"] == "tile_in_place" and rec["geometry"]["layers"] == 3
    assert 0 < rec["active_experts"] <= 8 and rec["max_abs_err"] < 2e-2
    assert rec["moved_bytes"] == rec["active_bytes"] == rec["active_experts"] * 3 * 128 * 64 * 2


# ----------------------------------------------------------------------------- bench_speculative
bench_speculative = _load("bench_speculative")


def test_bench_speculative_quick(tmp_path):
    """The speculative-decoding benchmark on a small preset: every cell gives the baseline's
    greedy tokens, and the oracle drafter at rate 1.0 keeps every draft, k + 1 tokens a step."""
    out = tmp_path / "spec.json"
    argv = ["--quick", "--target", "gemma3_1b", "--drafters", "none,ngram,oracle:1.0"]
    res = bench_speculative.main(
        [*argv, "--batches", "2", "--prompts", "repetitive", "--out", str(out)]
    )
    assert json.loads(out.read_text())["records"] == res["records"]
    none, ngram, oracle = res["records"]
    assert all(r["ok"] and r["same_tokens_as_none"] for r in res["records"])
    assert none["draft_tokens"] == 0 and ngram["draft_tokens"] > 0
    assert oracle["acceptance_rate"] == 1.0 and oracle["tokens_per_decode_step"] > 3
    assert res["git_commit"] and res["parameters"]["k"] == 4


def test_swa_scratch_combine_keeps_one_commit_and_one_workload(tmp_path):
    """`--combine`: the per-call files of one commit and workload make one table; a file of
    another commit or workload, or a cell in two files, is refused."""

    def cell(preset, setup, scratch, tps, commit="c1", workload=None):
        return dict(
            preset=preset,
            setup=setup,
            scratch=scratch,
            git_commit=commit,
            workload=workload or {"requests": 24},
            request_digests=["a", "b"],
            output_tokens_per_s=tps,
        )

    def write(name, records):
        path = tmp_path / name
        path.write_text(json.dumps(dict(device="H200", records=records, runs=[{"n": name}])))
        return path

    a = write("a.json", [cell("p", "pinned_8k", False, 10.0), cell("p", "pinned_8k", True, 13.0)])
    b = write("b.json", [cell("q", "online", False, 4.0), cell("q", "online", True, 5.0)])
    out = tmp_path / "all.json"
    res = swa_scratch.main(["--combine", str(a), str(b), "--out", str(out)])
    assert json.loads(out.read_text())["git_commit"] == "c1" and len(res["records"]) == 4
    assert res["comparison"]["p"]["pinned_8k"]["change_pct"] == pytest.approx(30.0)
    assert res["comparison"]["q"]["online"]["change_pct"] == pytest.approx(25.0)
    assert [r["n"] for r in res["runs"]] == ["a.json", "b.json"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    other = write("c.json", [cell("r", "online", True, 1.0, commit="c2")])
    with pytest.raises(ValueError, match="2 commits"):
        swa_scratch.main(["--combine", str(a), str(other), "--out", str(out)])
    wl = write("d.json", [cell("r", "online", True, 1.0, workload={"requests": 32})])
    with pytest.raises(ValueError, match="2 workloads"):
        swa_scratch.main(["--combine", str(a), str(wl), "--out", str(out)])
    with pytest.raises(ValueError, match="two files"):
        swa_scratch.main(["--combine", str(a), str(a), "--out", str(out)])


def test_online_layouts_predicted_on_the_host_are_the_ones_the_engine_visits(monkeypatch):
    """repro_online_layouts.py compiles ahead the layouts an online cell will visit; its host
    prediction (the engine's scheduler and policy in the engine's order, tokens read one step
    late) names the very layouts the engine re-splits into, in order."""
    from test_adaptive_split import NEW, engine, lengths, quota_for_three
    from test_generate import make_model, prompts_of

    online_layouts = _load("repro_online_layouts")
    eng = engine(
        make_model("gemma4"), "online", quota_for_three(), rebalance_cooldown=6, rebalance_ema=0.5
    )
    prompts = prompts_of(lengths(12, 12), seed=12)[:4] + prompts_of(lengths(100, 11), seed=11)[:4]
    predicted = online_layouts.predicted_layouts(eng, prompts, NEW)
    visited = [eng.layout]
    resize = eng.runner.resize

    def spy(layout):
        visited.append(layout)
        resize(layout)

    monkeypatch.setattr(eng.runner, "resize", spy)
    eng.run(prompts, NEW)
    assert len(visited) >= 3, visited  # the workload re-splits
    assert predicted == list(dict.fromkeys(visited))
    with pytest.raises(ValueError, match="served nothing"):
        online_layouts.predicted_layouts(eng, prompts, NEW)
