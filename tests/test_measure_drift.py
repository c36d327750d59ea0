"""Rescaling runs for the machine's drift: a run measured while the machine was k times slower (and its probe
k times slower too) comes out at the session's median speed; raw timings are kept."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache.measure.drift import SpeedProbe, drift_factors, rescaled_run
from icecache.sim.validate import MeasuredRun, drift_note

BASE = {"tpot_s": 0.05, "tt2t_s": 1.25, "ttft_s": 1.2, "stage_seconds": {"select": 0.01, "insert": 0.004}}
PROBE = SpeedProbe(ttft_s=0.8, tpot_s=0.04)


@settings(max_examples=60, deadline=None)
@given(slow=st.lists(st.tuples(st.floats(0.5, 2.0), st.floats(0.5, 2.0)), min_size=1, max_size=9))
def test_runs_slowed_with_their_probe_come_out_at_the_median_speed(slow):
    """Run i measured with prefill k_i and decode m_i times slower (its probe too) -> every rescaled run equals
    the base run at the median slowdowns (the session's median probe)."""
    runs, probes = [], []
    for k, m in slow:
        runs.append({"tpot_s": BASE["tpot_s"] * m, "ttft_s": BASE["ttft_s"] * k,
                     "tt2t_s": BASE["ttft_s"] * k + (BASE["tt2t_s"] - BASE["ttft_s"]) * m,
                     "stage_seconds": {s: v * m for s, v in BASE["stage_seconds"].items()}, "variant": "quest"})
        probes.append(SpeedProbe(PROBE.ttft_s * k, PROBE.tpot_s * m))
    k_mid = statistics.median(k for k, _ in slow)
    m_mid = statistics.median(m for _, m in slow)
    for run, factors in zip(runs, drift_factors(probes)):
        out = rescaled_run(run, *factors)
        assert out["tpot_s"] == pytest.approx(BASE["tpot_s"] * m_mid)
        assert out["ttft_s"] == pytest.approx(BASE["ttft_s"] * k_mid)
        assert out["tt2t_s"] == pytest.approx(BASE["ttft_s"] * k_mid + (BASE["tt2t_s"] - BASE["ttft_s"]) * m_mid)
        assert out["stage_seconds"] == pytest.approx({s: v * m_mid for s, v in BASE["stage_seconds"].items()})
        assert out["raw_timings"]["tpot_s"] == run["tpot_s"] and out["variant"] == "quest"
        assert run["tpot_s"] == out["raw_timings"]["tpot_s"]  # the input row is not modified


def test_no_probes_no_factors_and_the_validation_note():
    assert drift_factors([]) == []
    row = dict(variant="quest", model="m", context=1024, budget=64, page_size=8, threads=1, new_tokens=8,
               hardware="this-machine", **BASE)
    assert drift_note([MeasuredRun.from_dict(row)]) is None
    note = drift_note([MeasuredRun.from_dict({**row, "repeats_drift_factors": [[1.0, 0.9], [1.0, 1.1]]})])
    assert note is not None and "0.90-1.10" in note and "2 repeats" in note
