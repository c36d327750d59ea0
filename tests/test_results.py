"""README's results (two tables and experiments/results.png) are generated from the committed run files
(experiments/results.py, issues 22 and 55)."""

from __future__ import annotations

import builtins
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


def test_readme_tables_and_figure_match_the_committed_files():
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_reports_a_stale_line_and_a_stale_figure():
    r = _results()
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = r.render()
    assert r.check(text, blocks) == []
    line = next(x for x in blocks["table"].splitlines() if "passkey" in x)
    stale = text.replace(line, line.replace("5 samples per length", "6 samples per length", 1), 1)
    assert stale != text and r.check(stale, blocks) == ["table: 1 line(s) differ"]
    data = r.figure_data()
    assert r.figure_is_current(data)
    data["tpot"]["full attention"][0][1] += 1.0  # one plotted value moved: the committed PNG no longer matches
    assert not r.figure_is_current(data)


def test_generated_lines_are_short_and_give_sample_counts():
    r = _results()
    blocks = r.render()
    for body in blocks.values():
        for line in body.splitlines():
            assert len(line) <= r.MAX_LINE, line
    rows = blocks["table"].splitlines()[2:]
    for line in rows:
        if line.startswith(("| [accuracy]", "| [RULER]", "| [adaptive budget]")):
            assert "sample" in line, line


def test_reads_run_files_never_markdown(monkeypatch):
    """Item 2 of issue 55: the numbers come from CSV/JSON files, not from Markdown pages."""
    r = _results()
    read: list[str] = []
    real_read_text, real_open = Path.read_text, builtins.open

    def read_text(self, *args, **kwargs):
        read.append(str(self))
        return real_read_text(self, *args, **kwargs)

    def opener(file, *args, **kwargs):
        read.append(str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", read_text)
    monkeypatch.setattr(r, "open", opener, raising=False)
    r.render()
    r.figure_data()
    assert read and not [p for p in read if p.endswith(".md")]


def test_perplexity_gap_is_computed_from_raw_values():
    r = _results()
    gap = r.ppl_gap(ROOT / "experiments" / "eval" / "ppl_wide" / "summary.csv")
    assert r.pct(gap, 2) == "+1.29%"  # 7.3289 / 7.2354, not 7.33 / 7.24 (+1.24%)
    assert r.pct(r.change(7.33, 7.24), 2) == "+1.24%"


HEADER = "length,method,budget,task,score,ci_low,ci_high,samples\n"


def _records(rows, tasks=("a",), samples=1, length=4096):
    return "".join(json.dumps({"task": t, "length": length, "index": i, "method": m, "budget": b, "score": 1.0}) + "\n"
                   for t in tasks for i in range(samples) for m, b in rows)


def test_ruler_row_missing_running_and_final(tmp_path, monkeypatch):
    r = _results()
    targets = r.targets_module()
    monkeypatch.setattr(r, "EXP", tmp_path)
    monkeypatch.setattr(r, "ruler_cells", lambda: [targets._cell("SmolLM2-135M", "4k", 25, "smollm2_4k")])
    assert r.rows_ruler() == [(r.RULER, "not run yet")]  # no experiments/ruler: no failure
    run = tmp_path / "ruler" / "smollm2_4k"
    run.mkdir(parents=True)
    rows = (("full", "-"), ("icecache", "256"), ("quest", "256"))
    (run / "predictions.jsonl").write_text(_records(rows[:2]) + '{"task": "a", "len')  # a line cut mid-write
    (run / "run.json").write_text(json.dumps({"model": "smollm2-135m-instruct"}))
    running = r.rows_ruler()[0][1]
    assert "4k running (2 finished units" in running
    (run / "results.csv").write_text(HEADER + "4096,full,-,a,50.0,,,1\n4096,icecache,256,a,48.0,,,1\n"
                                     "4096,full,-,average,50.0,40.0,60.0,1\n4096,icecache,256,average,48.0,38.0,58.0,1\n")
    assert "4k (a row is missing)" in r.rows_ruler()[0][1]  # final, but without a row the cell reads (quest@256)
    (run / "predictions.jsonl").write_text(_records(rows))
    assert "running (3 finished units" in r.rows_ruler()[0][1]  # results.csv does not account for every unit
    (run / "results.csv").write_text(HEADER + "4096,full,-,a,50.0,,,1\n4096,icecache,256,a,48.0,,,1\n"
                                     "4096,quest,256,a,35.0,,,1\n4096,full,-,average,50.0,40.0,60.0,1\n"
                                     "4096,icecache,256,average,48.0,38.0,58.0,1\n4096,quest,256,average,35.0,25.0,45.0,1\n")
    final = r.rows_ruler()[0][1]
    assert "4k 50.0 / 48.0 / 35.0 (1 task, 1 sample per task;" in final
    # --check: a live unit count is not a claim, final results are
    row = f"| {r.RULER}, SmolLM2-135M | {{}} |"
    assert r._pending(row.format(running)) == r._pending(row.format(running.replace("(2 finished", "(9 finished")))
    assert r._pending(row.format("not run yet")) == r._pending(row.format(running))
    assert r._pending(row.format(final)) != r._pending(row.format(running))


def test_figure_panels_never_mix_task_sets(tmp_path, monkeypatch):
    r = _results()
    targets = r.targets_module()
    monkeypatch.setattr(r, "EXP", tmp_path)
    monkeypatch.setattr(r, "ruler_cells", lambda: [targets._cell("Gemma-3-270M", "4k", 20, "gemma_4k", adopted="gemma_4k_settings")])
    main, settings = tmp_path / "ruler" / "gemma_4k", tmp_path / "ruler" / "gemma_4k_settings"
    for d, methods in ((main, (("full", "-"), ("icecache", "64"), ("icecache", "256"))), (settings, (("icecache", "256"),))):
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"model": "gemma-3-270m"}))
        (d / "predictions.jsonl").write_text(_records(methods, tasks=("niah_a", "qa"), samples=2))
        (d / "results.csv").write_text(HEADER + "".join(f"4096,{m},{b},{t},10.0,,,2\n" for m, b in methods for t in ("niah_a", "qa"))
                                       + "".join(f"4096,{m},{b},average,10.0,0.0,20.0,2\n" for m, b in methods))
    panel = r.figure_data()["ruler"][0]
    assert panel["subtitle"] == "2 tasks, 2 samples per task" and panel["full"] == 10.0
    assert panel["series"]["IceCache"] == [[64, 10.0], [256, 10.0]]
    assert panel["series"]["IceCache, adopted settings"] == [[256, 10.0]]
    # the adopted rows over other tasks (only the NIAH one): not drawn in the same panel
    (settings / "predictions.jsonl").write_text(_records((("icecache", "256"),), tasks=("niah_a",), samples=2))
    (settings / "results.csv").write_text(HEADER + "4096,icecache,256,niah_a,10.0,,,2\n4096,icecache,256,average,10.0,0.0,20.0,2\n")
    panel = r.figure_data()["ruler"][0]
    assert "IceCache, adopted settings" not in panel["series"]
    assert r.ruler_tasks(r.ruler_rows(settings)) == "1 NIAH task"
