"""Issue 23's target table is computed from the committed RULER runs (experiments/ruler/targets.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "ruler" / "targets.py"


def _targets():
    spec = importlib.util.spec_from_file_location("experiments_ruler_targets", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def test_targets_md_matches_the_committed_runs():
    out = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


scores = st.lists(st.sampled_from([0.0, 0.25, 0.5, 1.0]), min_size=2, max_size=8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(scores, scores), min_size=1, max_size=3))
def test_paired_statistic_point_is_the_direct_mean_and_inside_its_interval(tasks):
    t = _targets()
    a, b = {}, {}
    for task_index, (va, vb) in enumerate(tasks):
        for i, (x, y) in enumerate(zip(va, vb)):
            a[(f"t{task_index}", i)] = x
            b[(f"t{task_index}", i)] = y
    samples = set(a)

    def average(scores):  # RULER's: the mean over tasks of each task's mean
        by_task = {}
        for (task, _), v in scores.items():
            by_task.setdefault(task, []).append(v)
        return sum(sum(v) / len(v) for v in by_task.values()) / len(by_task)

    diff, low, high = t.paired_statistic(a, b, samples, ratio=False, draws=400)
    assert abs(diff - (average(a) - average(b))) < 1e-12
    assert low <= high
    assert min(a[s] - b[s] for s in samples) - 1e-12 <= low and high <= max(a[s] - b[s] for s in samples) + 1e-12
    same, low_same, high_same = t.paired_statistic(a, a, samples, ratio=False, draws=400)
    assert same == low_same == high_same == 0.0  # a row against itself: no difference in any resample
    if average(b) > 0:
        ratio, low_r, high_r = t.paired_statistic(a, b, samples, ratio=True, draws=400)
        assert abs(ratio - average(a) / average(b)) < 1e-12
        assert low_r <= high_r


def test_verdicts():
    t = _targets()
    assert t.verdict(0.02, 0.001, 0.05, 0.0, 110, 110, 20, 2, 0.001) == "**met**, settled"
    assert t.verdict(0.02, 0.0, 0.05, 0.0, 110, 110, 20, 2, 0.001) == "**met**, within noise"  # touches 0
    assert t.verdict(0.02, -0.01, 0.05, 0.0, 110, 110, 20, 2, 0.001) == "**met**, within noise"
    assert t.verdict(-0.003, -0.009, 0.0, 0.0, 110, 110, 1, 9, 0.001) == "**missed**, within noise"
    assert t.verdict(0.90, 0.80, 0.94, 0.95, 110, 110, 2, 20, 0.001) == "**missed**, settled"
    assert t.verdict(0.90, 0.80, 0.94, 0.95, 110, 110, 20, 2, 0.001) == "**missed**, within noise"  # wrong way
    assert t.verdict(0.90, 0.80, 0.99, 0.95, 70, 110, 2, 20, 0.001) == "running (missed so far)"


def test_sign_test_is_the_binomial_tail_summed_directly():
    t = _targets()
    assert t.sign_test(4, 1) == 0.375
    assert t.sign_test(0, 5) == 0.0625
    assert t.sign_test(0, 0) == 1.0
    for n in range(0, 16):
        for wins in range(n + 1):
            # brute force: the probability, under p = 1/2, of every split at most as likely as the one observed
            pmf = [math.comb(n, k) / 2**n for k in range(n + 1)]
            brute = sum(q for q in pmf if q <= pmf[wins] * (1 + 1e-12))
            assert abs(t.sign_test(wins, n - wins) - min(1.0, brute)) < 1e-12, (wins, n)


def test_holm_adjusts_step_down():
    t = _targets()
    assert t.holm([0.01, 0.04, 0.03]) == [0.03, 0.06, 0.06]
    assert t.holm([0.5, 0.001]) == [0.5, 0.002]
    assert t.holm([]) == []


def test_holm_turns_an_interval_that_excludes_the_threshold_to_within_noise():
    t = _targets()
    # the case: Gemma-3 8k IceCache@256 vs Quest@256, +2.8 [+0.2, +5.9] on 4 wins, 1 loss
    p = t.sign_test(4, 1)
    assert t.verdict(0.028, 0.002, 0.059, 0.0, 110, 110, 4, 1, t.holm([p] * 25)[0]) == "**met**, within noise"
    # a sign test that passes alone (p = 0.0078) but not after Holm over 25 targets (0.0078 x 25 > 0.05)
    p = t.sign_test(8, 0)
    assert p < 0.05 < t.holm([p] + [0.5] * 24)[0]
    assert t.verdict(0.15, 0.07, 0.24, 0.0, 40, 40, 8, 0, p) == "**met**, settled"
    assert t.verdict(0.15, 0.07, 0.24, 0.0, 40, 40, 8, 0, t.holm([p] + [0.5] * 24)[0]) == "**met**, within noise"


def test_render_reads_each_row_from_its_folder(tmp_path):
    t = _targets()

    def write(folder, records):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def rec(method, budget, index, score):
        return {"task": "niah_single_1", "length": 4096, "index": index, "method": method, "budget": budget,
                "score": score}

    main = [rec(m, b, i, 1.0) for i in range(2) for m, b in [("full", "-"), ("pqcache", "256"), ("snapkv", "256")]]
    main += [rec("icecache", "256", i, 0.0) for i in range(2)]  # not read: the cell takes IceCache from `adopted`
    adopted = [rec(m, b, i, 1.0) for i in range(2) for m, b in [("icecache", "256"), ("icecache", "64")]]
    adopted += [rec("quest", "256", 0, 0.0)]  # Quest finished one sample: the cell reads that one only
    write("main", main)
    write("adopted", adopted)
    cell = t._cell("M", "4k", 2, "main", adopted="adopted")
    text = t.render(tmp_path, [cell], t.TARGETS)
    assert ("| M | 4k | 1 of 2 | IceCache@256 >= 95% of full | 100.0% [100.0%, 100.0%] | 1 / 0 | 1.000 (1.000) | "
            "running (met so far) |") in text
    assert ("| M | 4k | 1 of 2 | IceCache@256 >= Quest@256 | +100.0 [+100.0, +100.0] | 1 / 0 | 1.000 (1.000) | "
            "running (met so far) |") in text
    assert "over\nthe 5 targets tested in this table (family-wise level 0.05)" in text
    empty = t.render(tmp_path, [t._cell("M", "8k", 2, "absent")], t.TARGETS)
    assert "| M | 8k | 0 of 2 | IceCache@256 >= Quest@256 | - | - | - | not run yet |" in empty


def test_a_ratio_over_a_zero_full_average_is_undefined(tmp_path):
    t = _targets()
    (tmp_path / "run").mkdir()
    rows = [("full", "-"), ("icecache", "256"), ("icecache", "64"), ("quest", "256"), ("pqcache", "256"),
            ("snapkv", "256")]
    (tmp_path / "run" / "predictions.jsonl").write_text("".join(
        json.dumps({"task": "niah_single_1", "length": 32768, "index": 0, "method": m, "budget": b, "score": 0.0})
        + "\n" for m, b in rows))
    text = t.render(tmp_path, [t._cell("M", "32k", 1, "run")], t.TARGETS)
    assert ("| M | 32k | 1 of 1 | IceCache@256 >= 95% of full | - (full attention's average is 0) | - | - | undefined |"
            in text)
    assert ("| M | 32k | 1 of 1 | IceCache@256 >= Quest@256 | +0.0 [+0.0, +0.0] | 0 / 0 | 1.000 (1.000) | "
            "**met**, within noise |") in text  # all ties: nothing for the sign test, nothing settled
    assert "the 4 targets tested in this table" in text  # the undefined ratio is not tested
