"""The calibration harness (on the tiny random Llama; the real model is timed by `icecache calibrate`)."""

from __future__ import annotations

import pytest
import torch

from icecache.core.errors import ConfigError
from icecache.measure.calibrate import CalibrationSettings, main, run_calibration
from icecache.measure.capture import capture_qk
from icecache.measure.components import measure_decode_step, measure_runtime_layer
from icecache.measure.fitting import fit_profile_predictors, pool_efficiency
from icecache.measure.pagers import KeyPool, measure_decode_index, measure_pager
from icecache.measure.timing import interleaved
from icecache.sim.config import SimConfig
from icecache.sim.hardware import get_hardware, make_costs
from icecache.sim.model import simulate
from icecache.sim.profile import CalibrationProfile
from icecache.sim.shapes import register_shape, shape_from_config


def test_interleaved_rounds_time_every_function():
    calls = []
    out = interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, reps=3, warmup=1)
    assert calls == ["a", "b"] * 4 and all(len(v) == 3 for v in out.values())


def test_decode_step_leaves_the_cache_at_its_length(tiny_llama):
    rows = measure_decode_step(tiny_llama, (8, 32), reps=2)
    assert [r["context"] for r in rows] == [8, 32] and all(len(r["seconds"]) == 2 for r in rows)


def test_pager_and_loader_measurements_fit(tiny_llama):
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    pool = KeyPool(*capture_qk(tiny_llama, ids))
    rows = measure_pager("sequential", pool, (64, 128), (8, 16), (16, 32), reps=2, insert_reps=2, time_limit_s=5, log=lambda s: None)
    assert len(rows["build"]) == 4 and len(rows["select"]) == 8 and [r["n"] for r in rows["insert"]] == [64, 128]
    preds = fit_profile_predictors({"pagers": {"sequential": rows}})
    assert {"select/sequential", "build/sequential", "insert/sequential"} <= set(preds)


def test_decode_index_times_every_pager_inside_the_runtimes_decode(tiny_llama):
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    rows = measure_decode_index(tiny_llama, ids, "sequential", (64, 128, 400), steps=3, budget=16, page_size=8,
                                dense_layers=(0,), rounds=2, log=lambda s: None)
    assert [r["n"] for r in rows] == [64, 128]  # 400 + sink + window exceeds the prompt: skipped
    for r in rows:
        assert r["pagers_per_step"] == 3 * 2 and r["prompt_tokens"] == r["n"] + 4 + 64
        assert all(len(r[k]) == 2 * 3 for k in ("seconds", "insert_seconds", "step_seconds"))  # 2 rounds of 3 steps
        assert all(0 < s_ < w and 0 < i_ < w for s_, i_, w in zip(r["seconds"], r["insert_seconds"], r["step_seconds"]))
    for bad in ({"steps": 0}, {"steps": 1, "rounds": 0}):
        with pytest.raises(Exception, match="steps"):
            measure_decode_index(tiny_llama, ids, "sequential", (64,), budget=16, page_size=8, **bad)


def test_decode_index_alone_needs_no_key_capture(tiny_llama):
    logs: list[str] = []
    prof = run_calibration(CalibrationSettings.quick(), model=tiny_llama, model_name="tiny-llama", components=("decode_index",),
                           log=logs.append)
    assert not any("capturing keys" in line for line in logs)
    assert set(prof.samples) == {"decode_index"} and set(prof.samples["decode_index"]) == {"mdci", "sequential"}
    assert {"select_decode/mdci", "insert_decode/sequential"} <= set(prof.predictors)


def test_decode_index_timing_scales_select_and_replaces_insert():
    """select_job_s = round-robin select(n, B, P) x select_decode(n) / select(n, B0, P0); insert from insert_decode."""
    import dataclasses

    from icecache.sim.cost_models import MeasuredCosts
    from icecache.sim.shapes import get_shape
    from icecache.sim.testing import synthetic_profile

    base = synthetic_profile(pagers=("mdci",))
    shape = get_shape("smollm2-135m-instruct")
    plain = MeasuredCosts(base)
    rows = [{"n": n, "budget": 64, "page_size": 8, "seconds": [f * plain.select_job_s(shape, "mdci", n, 64, 8)],
             "insert_seconds": [3e-4]} for n, f in ((1024, 1.5), (8192, 2.0), (49152, 2.0))]
    preds = fit_profile_predictors({"decode_index": {"mdci": rows}})
    assert {"select_decode/mdci", "insert_decode/mdci"} == set(preds)
    prof = dataclasses.replace(base, predictors={**base.predictors, **preds}, samples={"decode_index": {"mdci": rows}})
    dec = MeasuredCosts(prof)
    for n, f, tol in ((1024, 1.5, 1e-6), (8192, 2.0, 1e-6), (49152, 2.0, 1e-6), (20000, 2.0, 0.02)):  # between knots: log-log interpolation
        for budget, page in ((64, 8), (256, 16)):
            assert dec.select_job_s(shape, "mdci", n, budget, page) == pytest.approx(f * plain.select_job_s(shape, "mdci", n, budget, page), rel=tol)
    assert dec.insert_job_s(shape, "mdci", 4096) == pytest.approx(3e-4) != plain.insert_job_s(shape, "mdci", 4096)
    for n, f in ((200_000, 2.0), (512, 1.5)):  # outside the timed sizes: the factor at the nearest edge, noted
        notes: list[str] = []
        assert dec.select_job_s(shape, "mdci", n, 64, 8, notes) == pytest.approx(f * plain.select_job_s(shape, "mdci", n, 64, 8), rel=1e-6)
        assert any("held at its measured edge" in x for x in notes)
    edge = 3e-4 / plain.insert_job_s(shape, "mdci", 49152)
    assert dec.insert_job_s(shape, "mdci", 200_000) == pytest.approx(edge * plain.insert_job_s(shape, "mdci", 200_000), rel=1e-6)
    with pytest.raises(ConfigError, match="step_decode/mdci"):  # the whole step was not timed in these rows
        dec.decode_step_in_runtime_s("mdci", 4096)
    steps = [dict(r, step_seconds=[s]) for r, s in zip(rows, (4e-3, 5e-3, 8e-3))]
    with_steps = MeasuredCosts(dataclasses.replace(base, predictors={**base.predictors, **fit_profile_predictors({"decode_index": {"mdci": steps}})}))
    assert with_steps.decode_step_in_runtime_s("mdci", 8192) == pytest.approx(5e-3, rel=1e-6)
    assert 5e-3 < with_steps.decode_step_in_runtime_s("mdci", 20000) < 8e-3


def test_runtime_layer_measurement_times_the_runtime_and_fits_per_call_costs():
    layer = measure_runtime_layer((1, 2), group=2, head_dim=16, dtype=torch.float32, n=256, budget=32, page_size=8,
                                  new_tokens=(0, 4, 16), reps=2)
    loads = {(r["heads"], r["new_tokens"]): r for r in layer["loader"]}
    assert set(loads) == {(h, k) for h in (1, 2) for k in (0, 4, 16)}
    assert loads[(2, 16)]["bytes"] == 2 * 16 * 2 * 16 * 4
    assert all(len(v) == 2 for v in loads[(2, 16)]["seconds_by_stage"].values())
    # nothing new: the copy stage is empty, but the scatter stage still writes the validity mask (as the runtime)
    none = loads[(1, 0)]["seconds_by_stage"]
    assert min(none["scatter"]) > max(none["copy"])
    steps = layer["layer"][0]["steps"]
    assert len(steps) == 2 and all(st["wall"] >= st["select"] + st["insert"] + st["attend"] for st in steps)
    preds = fit_profile_predictors({"runtime_layer": layer})
    assert {"gather", "copy", "scatter", "loader_other", "append", "overhead"} <= set(preds)
    assert preds["gather"].features == ("bytes", "rows") and preds["gather"].lo == (4 * 2 * 16 * 4, 4.0)
    assert preds["loader_other"].lo == (1.0, 32.0) and preds["loader_other"].hi == (2.0, 64.0)


def test_pool_efficiency_from_makespans():
    rows = [{"threads": 0, "jobs": 1, "seconds": [1.0]}, {"threads": 1, "jobs": 3, "seconds": [3.0]},
            {"threads": 2, "jobs": 3, "seconds": [3.0]}, {"threads": 3, "jobs": 3, "seconds": [1.0]}]
    assert pool_efficiency(rows, "median") == {"1": 1.0, "2": pytest.approx(2 / 3), "3": 1.0}


def test_quick_calibration_end_to_end(tiny_llama, tmp_path):
    prof = run_calibration(CalibrationSettings.quick(), model=tiny_llama, model_name="tiny-llama",
                           out=tmp_path / "p.json", log=lambda s: None)
    back = CalibrationProfile.load(tmp_path / "p.json")
    assert set(back.predictors) >= {"decode_step", "attention", "lm_head", "prefill", "gather", "copy", "scatter",
                                    "loader_other", "append", "overhead", "sparse_attention", "store_sync"}
    assert 0.0 <= back.meta["background_share"] <= 1.0 and 0.0 <= back.meta["background_share_prefill"] <= 1.0
    pipe = back.samples["prefill_pipeline"]
    assert {(r["tokens"], r["method"]) for r in pipe} == {(n, m) for n in (96, 160) for m in ("full", "mdci", "sequential")}
    assert all(len(r["ttft_s"]) == 1 and 0 < r["ttft_s"][0] < r["tt2t_s"][0] for r in pipe)
    assert all(r["index_build_s"][0] > 0 for r in pipe if r["method"] != "full") and pipe[0]["sparse_layers"] == 2
    assert "prefill_generate" in back.predictors
    assert {"select_decode/mdci", "insert_decode/mdci", "select_decode/sequential"} <= set(back.predictors)
    assert [r["n"] for r in back.samples["decode_index"]["mdci"]] == [64, 128]
    assert back.meta["shape"]["layers"] == 4 and back.samples["decode_step"]
    register_shape(shape_from_config(tiny_llama.config, "tiny-llama"))
    costs = make_costs(get_hardware("this-machine", prof), prof, "allow")
    res = simulate(SimConfig("tiny-llama", "this-machine", "quest", 200, budget=32, page_size=8, threads=2, dense_layers=(0,)), costs)
    assert res.tpot_s > 0 and res.tt2t_s > res.ttft_s > 0


def test_merging_profiles_keeps_what_was_not_remeasured():
    import dataclasses

    from icecache.measure.calibrate import merge_profiles
    from icecache.sim.testing import synthetic_profile

    rows = lambda t: [{"context": 128, "seconds": [t]}, {"context": 8192, "seconds": [2 * t]}]
    base = dataclasses.replace(synthetic_profile(), samples={"decode_step": rows(0.04), "copy": [{"bytes": 1e6, "seconds": [1e-4]}]})
    new = dataclasses.replace(synthetic_profile(), created="later", samples={"decode_step": rows(0.4), "copy": [{"bytes": 1e6, "seconds": [2e-4]}]})
    m = merge_profiles(base, new, ["loader"])
    assert m.samples["decode_step"] == base.samples["decode_step"] and m.samples["copy"] == new.samples["copy"]
    assert m.predictors["copy"].params[0] + m.predictors["copy"].params[1] * 1e6 == pytest.approx(2e-4)
    assert [r["components"] for r in m.meta["runs"]] == [["decode_index", "model", "pagers", "pipeline", "pool"], ["loader"]]
    with pytest.raises(ConfigError, match="components"):
        merge_profiles(base, new, ["gpu"])
    other = dataclasses.replace(new, machine={**new.machine, "cpu_model": "other"})
    with pytest.raises(ConfigError, match="machines"):
        merge_profiles(base, other, ["loader"])


def test_prefill_pipeline_fit_takes_each_pagers_cost_over_full_per_job():
    def row(n: int, method: str, ttft: float) -> dict:
        return {"tokens": n, "method": method, "ttft_s": [ttft, ttft * 1.5], "tt2t_s": [ttft + 0.1] * 2, "index_build_s": [0.0] * 2,
                "sparse_layers": 28, "kv_heads": 3, "sink": 4, "window": 64}

    full = {1024: 1.0, 2048: 2.5, 4096: 7.0}
    extra = {1024: 0.84, 2048: 1.68, 4096: 3.36}  # 10/20/40 ms per job (84 jobs)
    rows = [row(n, "full", t) for n, t in full.items()] + [row(n, "mdci", full[n] + extra[n]) for n in full]
    rows.append(row(1024, "sequential", 0.9))  # faster than full (noise): left out, no predictor from nothing
    preds = fit_profile_predictors({"prefill_pipeline": rows}, "min")
    assert "prefill_inline/sequential" not in preds
    p = preds["prefill_inline/mdci"]
    for n, e in extra.items():
        assert p.formula([n - 68]) == pytest.approx(e / 84, rel=1e-9)
    assert p.lo == (1024 - 68,) and p.hi == (4096 - 68,)
    for n, t in full.items():
        assert preds["prefill_generate"].formula([n]) == pytest.approx(t, rel=1e-6)


def test_calibrate_check_compares_the_recorded_stack_with_the_running_one(tmp_path, capsys):
    """Pager code hashes and library versions are recorded when measuring and compared by `icecache calibrate
    --check`, not by the simulator."""
    import dataclasses
    import json

    from icecache.indexes import available_pagers
    from icecache.measure.stack import pager_code_hashes, profile_mismatches, software_versions
    from icecache.sim.testing import synthetic_profile

    names = [n for n in ("mdci", "sequential") if n in available_pagers()]
    fresh = dataclasses.replace(synthetic_profile(), versions=software_versions(), pager_hashes=pager_code_hashes(names))
    assert profile_mismatches(fresh) == []
    path = fresh.save(tmp_path / "p.json")
    assert main(["--check", str(path)]) == 0 and "with this stack" in capsys.readouterr().out
    d = json.loads(path.read_text())
    d["versions"]["torch"] = "0.0.1"
    d["pager_hashes"]["sequential"] = "0" * 16
    d["pager_hashes"]["retired"] = "1" * 16
    path.write_text(json.dumps(d))
    assert main(["--check", str(path)]) == 1
    out = capsys.readouterr().out
    assert "another stack" in out and "torch 0.0.1 then" in out and "pager sequential code changed" in out
    assert "pager retired no longer registered" in out and "mdci" not in out.split("another stack")[1]


def test_calibrate_command_errors_are_one_line(tmp_path, capsys):
    assert main([]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["icecache calibrate: error: calibrate needs --out PROFILE.json (the file to write), or --check"]
    (tmp_path / "bad.json").write_text("{nope")
    assert main(["--check", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not JSON" in err[0]
    assert main(["--out", str(tmp_path / "x.json"), "--components", "gpu", "--quick"]) == 2
    assert "unknown calibration components" in capsys.readouterr().err


def test_calibrate_refuses_an_unwritable_out_before_measuring(tmp_path, capsys, monkeypatch):
    """A profile that could not be written is refused in one line before any measurement runs."""
    import icecache.measure.calibrate as calibrate

    monkeypatch.setattr(calibrate, "run_calibration", lambda *a, **k: pytest.fail("measured before checking --out"))
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path, "is a directory"), (tmp_path / "file" / "p.json", "cannot be written")):
        assert main(["--out", str(out), "--quick"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "p.json").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["file"]
