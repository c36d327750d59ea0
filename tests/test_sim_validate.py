"""Validation of the simulator against measured runs (synthetic runs with known distortions)."""

from __future__ import annotations

import json
import math

import pytest

from icecache.core.errors import ConfigError, InputError
from icecache.sim.cli import main
from icecache.sim.config import SimConfig
from icecache.sim.simulator import Simulator
from icecache.sim.testing import synthetic_profile
from icecache.sim.validate import (
    MeasuredRun,
    error_stats,
    kendall_tau,
    read_runs,
    split_runs,
    synthetic_runs,
    validate,
)


@pytest.fixture(scope="module")
def sim():
    return Simulator(synthetic_profile())


def _configs():
    return [
        SimConfig("smollm2", "this-machine", v, n, budget=b, page_size=p, threads=t)
        for v in ("full", "icecache", "icecache-r", "quest")
        for n in (1024, 2048, 4096, 7000)
        for b, p, t in ((64, 16, 1), (256, 8, 2))
        if not (v == "full" and b == 64)
    ]


def test_error_stats_and_tau():
    s = error_stats([1.1, 0.9, 1.2], [1.0, 1.0, 1.0])
    assert s["mape"] == pytest.approx(0.4 / 3) and s["bias"] == pytest.approx(0.2 / 3)
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)


def test_exact_runs_validate_perfectly(sim):
    runs = synthetic_runs(_configs(), sim)
    rep = validate(runs, sim, "context")
    assert rep.raw["tpot"]["mape"] < 1e-9 and rep.raw["tt2t"]["mape"] < 1e-9
    assert rep.tau_raw == pytest.approx(1.0)
    assert all(rep.passes("raw").values())
    assert rep.raw["bytes per step"]["n"] > 0 and rep.raw["bytes per step"]["mape"] < 1e-9


def test_known_stage_distortions_are_detected_raw_and_removed_by_calibration(sim):
    factors = {"select": 1.4, "attend": 0.7, "other": 1.15, "gather": 2.0}
    rest = {"icecache": 1.25, "quest": 0.9}
    runs = synthetic_runs(_configs(), sim, stage_factors=factors, prefill_factor=1.3, rest_factors=rest)
    rep = validate(runs, sim, "context")
    assert rep.n_calibration > 0 and rep.n_test > 0
    assert rep.raw["tpot"]["mape"] > 0.05 and rep.raw["tt2t"]["bias"] < -0.1  # the distortion shows ...
    assert rep.corrected["tpot"]["mape"] < 1e-6 and rep.corrected["tt2t"]["mape"] < 1e-6  # ... and is fitted away
    for stage, f in factors.items():
        assert rep.corrections.stage_factors[stage] == pytest.approx(f, rel=1e-6)
    assert rep.corrections.prefill_factor == pytest.approx(1.3, rel=1e-6)
    for v in {c.variant for c in _configs()}:
        assert rep.corrections.rest_factors[v] == pytest.approx(rest.get(v, 1.0), rel=1e-6)


def test_noisy_runs_meet_the_targets_after_calibration_and_a_broken_model_does_not(sim):
    runs = synthetic_runs(_configs(), sim, stage_factors={"select": 1.2}, noise=0.03, seed=1)
    rep = validate(runs, sim, "random", seed=3)
    assert rep.corrected["tpot"]["mape"] < 0.15 and abs(rep.corrected["tpot"]["bias"]) < 0.05
    assert rep.tau_corrected >= 0.8
    # a simulator that ignores context entirely cannot rank the configurations
    flat = [MeasuredRun(**{**r.__dict__, "tpot_s": 1.0 + 0.01 * i}) for i, r in enumerate(reversed(runs))]
    bad = validate(flat, sim, "random", seed=3)
    assert not all(bad.passes("corrected").values())


def test_holdout_rules(sim):
    runs = synthetic_runs(_configs()[:8], sim)
    cal, test = split_runs(runs, "context")
    assert max(runs[i].context for i in cal) < min(runs[i].context for i in test)
    cal, test = split_runs(runs, "threads")
    assert {runs[i].threads for i in cal} == {1} and {runs[i].threads for i in test} == {2}
    assert split_runs(runs, "none") == ([], list(range(len(runs))))
    with pytest.raises(ConfigError):
        split_runs(runs, "astrology")


def test_measured_run_format(tmp_path, sim):
    runs = synthetic_runs(_configs()[:3], sim)
    p = tmp_path / "runs.jsonl"
    p.write_text("\n".join(json.dumps(r.to_dict()) for r in runs) + "\n\n")
    back = read_runs(p)
    assert [r.tpot_s for r in back] == [r.tpot_s for r in runs]
    assert back[0].config().model == "smollm2-135m-instruct"
    bad = runs[0].to_dict()
    del bad["tt2t_s"]
    p.write_text(json.dumps(bad))
    with pytest.raises(InputError, match="tt2t_s"):
        read_runs(p)
    with pytest.raises(ConfigError):
        read_runs(tmp_path / "missing.jsonl")


def test_measured_page_reuse_rate_is_used_as_an_input(sim):
    cfg = SimConfig("smollm2", "this-machine", "icecache", 4096, budget=256, page_size=16, threads=2)
    (run,) = synthetic_runs([cfg], sim)
    from icecache.sim.validate import predict_runs

    lo = predict_runs([MeasuredRun(**{**run.__dict__, "extra": {"page_reuse_rate": 0.0}})], sim)[0]
    hi = predict_runs([MeasuredRun(**{**run.__dict__, "extra": {"page_reuse_rate": 0.9}})], sim)[0]
    assert hi.stages["gather"] < lo.stages["gather"]


def test_a_run_is_simulated_with_the_insert_mode_it_ran_with(sim):
    cfg = SimConfig("smollm2", "this-machine", "icecache", 4096, budget=256, page_size=16, threads=2)
    (run,) = synthetic_runs([cfg], sim)
    with_mode = lambda mode: MeasuredRun(**{**run.__dict__, "extra": {"stats": {"inserts": mode}}}).config()
    assert with_mode("background").inserts == "background" and with_mode("inline").inserts == "inline"
    assert with_mode("not started").inserts == "auto" == run.config().inserts  # nothing ran: the machine's rule
    from icecache.sim.validate import predict_runs

    bg, inline = (predict_runs([MeasuredRun(**{**run.__dict__, "extra": {"stats": {"inserts": m}}})], sim)[0]
                  for m in ("background", "inline"))
    # the runtime's insert timer reads the whole inline insert; a background insert only its window write there
    assert inline.stages["insert"] > 10 * bg.stages["insert"] > 0


def test_validate_command(tmp_path, capsys, sim):
    prof = synthetic_profile().save(tmp_path / "profile.json")
    runs = synthetic_runs(_configs(), sim, stage_factors={"attend": 1.1}, noise=0.02)
    p = tmp_path / "runs.jsonl"
    p.write_text("\n".join(json.dumps(r.to_dict()) for r in runs))
    assert main(["validate", "--runs", str(p), "--profile", str(prof), "--out", str(tmp_path / "val.md")]) == 0
    md = (tmp_path / "val.md").read_text()
    assert "Kendall tau" in md and "MAPE" in md
    data = json.loads((tmp_path / "val.json").read_text())
    assert data["n_test"] > 0 and "passes_corrected" in data


# ------------------------------------------------------------------------- ranking over resolvable pairs
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from icecache.sim.validate import repeat_noise, resolved_tau  # noqa: E402


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0.01, 1.0), st.floats(0.01, 1.0)), min_size=3, max_size=12, unique_by=(lambda t: t[0], lambda t: t[1])))
def test_resolved_tau_without_noise_is_kendalls_tau(pairs):
    pred, meas = [p for p, _ in pairs], [m for _, m in pairs]
    tau, n = resolved_tau(pred, meas, 0.0)
    assert n == len(pairs) * (len(pairs) - 1) // 2
    assert tau == pytest.approx(kendall_tau(pred, meas))


def test_resolved_tau_ignores_pairs_inside_the_noise():
    meas = [1.00, 1.01, 2.00, 2.02]
    pred = [1.01, 1.00, 2.02, 2.00]  # the close pairs are swapped, the far ones ordered
    assert kendall_tau(pred, meas) == pytest.approx(1 / 3)
    tau, n = resolved_tau(pred, meas, noise=0.02)
    assert (tau, n) == (1.0, 4)
    assert resolved_tau(pred, meas, math.nan) == (pytest.approx(math.nan, nan_ok=True), 0)


def test_repeat_noise_is_the_median_relative_range():
    def run(reps):
        return MeasuredRun("full", "m", 100, 64, 8, 1, 8, reps[0], 1.0, 1.0, {}, "this-machine", {"repeats_tpot_s": reps})

    runs = [run([1.0, 1.1]), run([2.0, 2.0]), run([1.0, 1.2, 1.1]), run([3.0])]
    assert repeat_noise(runs) == pytest.approx(0.1 / 1.05)  # median of 0.1/1.05, 0, 0.2/1.1
    assert math.isnan(repeat_noise([run([3.0])]))
