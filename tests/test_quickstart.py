"""experiments/quickstart.py --quick runs as a script (as CI runs it) and shows what it says:
a streamed chat answer from the tiny model (oracle: the rhyme in its training corpus), a
JSONL batch with scratch reuse on and off that writes the same results with fewer steps on,
the occupancy figure, and the memory plan of full-size Gemma 4 E2B (docs/design.md's numbers)."""

import json
import pathlib
import runpy
import sys

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"


def test_quickstart_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["quickstart.py", "--quick", "--out", str(tmp_path)])
    ns = runpy.run_path(str(EXPERIMENTS / "quickstart.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "Jack and Jill went up the hill\nTo fetch a pail of water." in out
    assert ns["chunk"].finish_reason == "stop"
    on, off = ns["runs"][True], ns["runs"][False]
    assert on.written == off.written == ns["NUM_REQUESTS"] == 6
    assert ns["same"]
    lines = (tmp_path / "out_scratch_on.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [f"r{i}" for i in range(6)]
    # scratch reuse holds fewer sliding-window slots per prefill: the batch takes fewer steps
    assert on.stats.steps < off.stats.steps
    assert len(on.stats.step_slots) == on.stats.steps
    assert (tmp_path / "quickstart_occupancy.png").stat().st_size > 10_000
    assert ns["plan"]["scratch"]["sequence"]["peak"] == 64_487_424
    assert ns["plan"]["release"]["sequence"]["peak"] == 150_994_944
    assert "scratch reuse saves 57.3 %" in out
