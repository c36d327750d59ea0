"""Selection traces and hit-rate models of the simulator."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from icecache.core.errors import ConfigError, InputError
from icecache.sim.hitrate import (
    ParametricHitModel,
    PriorHitModel,
    TraceSummary,
    load_hit_model,
    read_trace,
    summarize_trace,
    synthetic_trace,
    trace_step_loads,
    write_trace,
)
from icecache.sim.predictors import ExtrapolationError


@settings(max_examples=20)
@given(h=st.floats(0.0, 1.0), fill_i=st.integers(2, 16), budget=st.sampled_from([64, 128, 256]))
def test_summary_recovers_the_statistics_a_synthetic_trace_was_made_with(h, fill_i, budget):
    P = 16
    fill = fill_i / P
    tr = synthetic_trace(steps=5, layers=[2, 3], kv_heads=2, budget=budget, page_size=P, context=8000, page_hit_rate=h, fill=fill)
    s = summarize_trace(tr)
    k = budget // fill_i
    assert s.page_hit_rate == pytest.approx(round(h * k) / k)
    assert s.fill == pytest.approx(fill)
    assert s.budget_use == pytest.approx(k * fill_i / budget)
    assert (s.steps, s.layers, s.kv_heads) == (5, 2, 2)
    per_step = 2 * 2 * (k - round(h * k)) * 2 * P * 64 * 4
    assert s.mean_bytes_per_step == pytest.approx(per_step)


def test_trace_file_round_trip_and_meta(tmp_path):
    tr = synthetic_trace(steps=3, layers=[0, 1], kv_heads=1, budget=64, page_size=8, context=1000, page_hit_rate=0.5)
    p = write_trace(tmp_path / "t.jsonl", tr)
    back = read_trace(p)
    assert back.meta["budget"] == 64 and back.records == tr.records
    # without a meta line the caller supplies it
    (tmp_path / "raw.jsonl").write_text("\n".join(json.dumps(r) for r in tr.records))
    with pytest.raises(ConfigError, match="budget"):
        summarize_trace(read_trace(tmp_path / "raw.jsonl"))
    assert summarize_trace(read_trace(tmp_path / "raw.jsonl", meta={"budget": 64, "page_size": 8, "context": 1000})).budget == 64
    # gzipped traces (how experiments/sim/traces are committed) read the same
    import gzip

    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as fh:
        fh.write(p.read_text())
    assert read_trace(tmp_path / "t.jsonl.gz").records == tr.records


@pytest.mark.parametrize(
    "bad, msg",
    [
        ({"step": 0, "layer": 0, "kv_head": 0, "pages": [1], "tokens": 8, "new_pages": 1}, "bytes"),
        ({"step": 0, "layer": 0, "kv_head": 0, "pages": [1], "tokens": 8, "new_pages": 2, "bytes": 0}, "new_pages"),
        ({"step": -1, "layer": 0, "kv_head": 0, "pages": [1], "tokens": 8, "new_pages": 1, "bytes": 0}, "step"),
        ({"step": 0, "layer": 0, "kv_head": 0, "pages": 3, "tokens": 8, "new_pages": 0, "bytes": 0}, "pages"),
    ],
)
def test_bad_trace_records_are_rejected(tmp_path, bad, msg):
    (tmp_path / "t.jsonl").write_text(json.dumps(bad) + "\n")
    with pytest.raises(InputError, match=msg):
        read_trace(tmp_path / "t.jsonl")


def test_step_loads_sum_over_heads():
    tr = synthetic_trace(steps=2, layers=[4], kv_heads=3, budget=64, page_size=16, context=2000, page_hit_rate=0.25)
    loads = trace_step_loads(tr)
    assert loads[0][4].new_pages == 3 * 4 and loads[1][4].new_pages == 3 * 3
    assert loads[1][4].bytes == 3 * 3 * 2 * 16 * 64 * 4
    assert loads[1][4].tokens_per_head == 64


def _summary(variant, b, p, n, h, fill=0.9, use=0.95):
    return TraceSummary(variant, b, p, n, 8, 4, 2, h, fill, use, 0.0, 0.0)


def test_parametric_model_recovers_a_logistic_relation_and_checks_its_range():
    c = (0.5, 0.6, -0.4, -0.3)

    def truth(b, p, n):
        z = c[0] + c[1] * math.log(b) + c[2] * math.log(p) + c[3] * math.log(n)
        return 1 / (1 + math.exp(-z))

    sums = [_summary("icecache", b, p, n, truth(b, p, n)) for b in (64, 128, 256) for p in (8, 16, 32) for n in (2000, 8000)]
    m = ParametricHitModel.fit(sums, ridge=1e-9, extrapolation="refuse")
    hs = m.predict("icecache", 128, 16, 4000)
    assert hs.page_hit_rate == pytest.approx(truth(128, 16, 4000), rel=1e-3)
    assert hs.fill == pytest.approx(0.9, rel=1e-3) and hs.budget_use == pytest.approx(0.95, rel=1e-3)
    notes: list[str] = []
    assert m.predict("icecache-r", 128, 16, 4000, notes).page_hit_rate == hs.page_hit_rate  # reuse uses icecache traces
    assert any("icecache-r" in x for x in notes)
    with pytest.raises(ExtrapolationError, match="context"):
        m.predict("icecache", 128, 16, 100_000)
    with pytest.raises(ConfigError, match="quest"):
        m.predict("quest", 128, 16, 4000)


def test_one_trace_gives_constants_and_the_model_serialises(tmp_path):
    m = ParametricHitModel.fit([_summary("quest", 256, 16, 4000, 0.7)], extrapolation="allow")
    assert m.predict("quest", 64, 32, 100_000).page_hit_rate == pytest.approx(0.7, abs=0.05)
    p = m.save(tmp_path / "hit.json")
    back = load_hit_model([p], "allow")
    assert back.predict("quest", 256, 16, 4000) == m.predict("quest", 256, 16, 4000)


def test_hit_model_from_trace_files(tmp_path):
    paths = []
    for i, (b, h) in enumerate(((64, 0.2), (256, 0.6))):
        tr = synthetic_trace(steps=4, layers=[2], kv_heads=2, budget=b, page_size=16, context=4000, page_hit_rate=h, seed=i)
        paths.append(write_trace(tmp_path / f"t{i}.jsonl", tr))
    m = load_hit_model(paths, "allow")
    assert m.predict("icecache", 64, 16, 4000).page_hit_rate < m.predict("icecache", 256, 16, 4000).page_hit_rate
    assert isinstance(load_hit_model([]), PriorHitModel)
