"""README's result tables are generated from the committed run files (experiments/results.py, issue 22)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "results.py"


def _results():
    spec = importlib.util.spec_from_file_location("experiments_results", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tables_match_the_committed_files():
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_perplexity_gap_is_computed_from_raw_values():
    r = _results()
    gap = r.ppl_gap(ROOT / "experiments" / "eval" / "ppl_wide" / "summary.csv")
    assert r.pct(gap, 2) == "+1.29%"  # 7.3289 / 7.2354, not 7.33 / 7.24 (+1.24%)
    assert r.pct(r.change(7.33, 7.24), 2) == "+1.24%"


def test_ruler_row_running_missing_and_final(tmp_path, monkeypatch):
    r = _results()
    monkeypatch.setattr(r, "EXP", tmp_path)
    assert r.row_ruler()[2] == "not run yet"  # no experiments/ruler: no failure
    run = tmp_path / "ruler" / "smollm2_4k"
    run.mkdir(parents=True)
    units = [{"task": "a", "length": 4096, "index": 0, "method": m, "budget": b, "score": 1.0}
             for m, b in (("full", "-"), ("icecache", "64"))]
    (run / "predictions.jsonl").write_text("".join(json.dumps(u) + "\n" for u in units) + '{"task": "a", "len')
    running = r.row_ruler()[2]
    assert "running (2 finished units" in running
    (run / "run.json").write_text(json.dumps({"model": "smollm2-135m-instruct"}))
    (run / "results.md").write_text("Predictions: 2 units in `predictions.jsonl`; this invocation 5 s.\n")
    (run / "results.csv").write_text(
        "length,method,budget,task,score,ci_low,ci_high,samples\n"
        "4096,full,-,average,50.0,40.0,60.0,25\n4096,icecache,64,average,45.0,35.0,55.0,25\n"
        "4096,icecache,256,average,48.0,38.0,58.0,25\n4096,quest,64,average,30.0,20.0,40.0,25\n"
        "4096,quest,256,average,35.0,25.0,45.0,25\n")
    final = r.row_ruler()[2]
    assert final.endswith("SmolLM2 4k: full 50.0, icecache@64 45.0, @256 48.0, quest@256 35.0 (25 samples)")
    # --check: a live unit count is not a claim, final results are
    row = "| RULER accuracy (average score x100) | x | {} |"
    assert r._pending(row.format(running)) == r._pending(row.format(running.replace("(2 finished", "(9 finished")))
    assert r._pending(row.format("not run yet")) == r._pending(row.format(running))
    assert r._pending(row.format(final)) != r._pending(row.format(running))


def test_ruler_row_appends_a_runs_companion_folders(tmp_path, monkeypatch):
    r = _results()
    monkeypatch.setattr(r, "EXP", tmp_path)
    run = tmp_path / "ruler" / "gemma_4k"
    run.mkdir(parents=True)
    (run / "predictions.jsonl").write_text(json.dumps({"task": "a", "length": 4096, "index": 0, "method": "full",
                                                       "budget": "-", "score": 1.0}) + "\n")
    (run / "run.json").write_text(json.dumps({"model": "gemma-3-270m"}))
    (run / "results.md").write_text("Predictions: 1 units in `predictions.jsonl`.\n")
    (run / "results.csv").write_text("length,method,budget,task,score,ci_low,ci_high,samples\n"
                                     "4096,full,-,average,50.0,40.0,60.0,10\n")
    settings = tmp_path / "ruler" / "gemma_4k_settings"  # no full rows: not a run of its own
    settings.mkdir()
    (settings / "predictions.jsonl").write_text(json.dumps({"task": "a", "length": 4096, "index": 0,
                                                            "method": "icecache", "budget": "64", "score": 1.0}) + "\n")
    (settings / "results.md").write_text("Partial run (in progress, resumable): 1 records.\n")
    (settings / "results.csv").write_text("length,method,budget,task,score,ci_low,ci_high,samples\n"
                                          "4096,icecache,64,average,44.0,30.0,50.0,3\n"
                                          "4096,exact,64,average,47.0,30.0,50.0,3\n"
                                          "4096,quest,256,average,41.5,30.0,50.0,2\n")
    row = r.row_ruler()[2]
    assert row.count("[`gemma_4k_settings/`]") == 1 and row.count("Gemma-3-270M 4k") == 1
    assert row.endswith("; with the model's settings ([`gemma_4k_settings/`](experiments/ruler/gemma_4k_settings/), "
                        "running) 4k: icecache@64 44.0, quest@256 41.5 (2 samples)")
