"""Sweeps, crossovers and the command line of the simulator."""

from __future__ import annotations

import csv
import math
import sys

import pytest

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.sim.cli import main
from icecache.sim.config import SimConfig
from icecache.sim.crossover import crossovers, find_crossover
from icecache.sim.hardware import canonical_hardware, hardware_names
from icecache.sim.simulator import Simulator
from icecache.sim.sweep import SweepSpec, parse_contexts, run_configs
from icecache.sim.testing import synthetic_profile


def test_parse_contexts():
    assert parse_contexts("8k..64k") == [8000, 16000, 32000, 64000]
    pts = parse_contexts("8k..256k:6")
    assert pts[0] == 8000 and pts[-1] == 256000 and len(pts) == 6
    assert parse_contexts("4096,36k") == [4096, 36000]
    with pytest.raises(ConfigError):
        parse_contexts("64k..8k")


def _spec(**kw):
    args = dict(hardware="a100,h100", models="llama-3.1-8b", contexts="8k..64k", budgets="64,256", page_sizes="8,16",
                threads="8,64", variants="full,icecache,icecache-r,quest")
    args.update(kw)
    return SweepSpec.from_strings(**args)


def test_grid_expansion_collapses_full_kv():
    spec = _spec()
    cfgs = spec.configs()
    per_ctx = 1 + 3 * 2 * 2 * 2
    assert len(cfgs) == 2 * 4 * per_ctx
    assert sum(c.variant == "full" for c in cfgs) == 2 * 4
    with pytest.raises(UnknownNameError):
        _spec(variants="full,warp")
    with pytest.raises(UnknownNameError):
        _spec(hardware="a100,tpu")


def test_process_pool_gives_the_same_rows_as_serial():
    cfgs = _spec(hardware="h100", contexts="8k..256k:4").configs()
    assert len(cfgs) >= 64  # large enough to use the pool
    prof = synthetic_profile()
    a = run_configs(cfgs, prof, backend="serial", with_prefill=False)
    b = run_configs(cfgs, prof, backend="process", workers=2, with_prefill=False)
    assert [r["tpot_s"] for r in a] == [r["tpot_s"] for r in b]


def test_ray_backend_is_optional(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    cfgs = _spec(hardware="h100", contexts="8k..256k:4").configs()
    with pytest.raises(ConfigError, match="pip install ray"):
        run_configs(cfgs, synthetic_profile(), backend="ray", with_prefill=False)


def test_crossover_interpolation():
    rows = [dict(hardware="h", model="m", variant="full", budget=0, page_size=0, threads=0, context=c, tpot_s=0.01 * c)
            for c in (1, 2, 4)]
    rows += [dict(hardware="h", model="m", variant="icecache", budget=1, page_size=1, threads=1, context=c, tpot_s=0.025)
             for c in (1, 2, 4)]
    (x,) = crossovers(rows)
    assert x["crossover_tokens"] == pytest.approx(2.5)


def test_bisection_crossover_agrees_with_the_grid():
    sim = Simulator(synthetic_profile())
    cfg = SimConfig("qwen3-4b", "h100", "icecache", 100_000, threads=64, impl="paper")
    x = find_crossover(sim, cfg)
    assert math.isfinite(x) and 10_000 < x < 4_000_000
    below = sim.run(cfg.replace(context=int(x * 0.9)), with_prefill=False).tpot_s
    above = sim.run(cfg.replace(context=int(x * 1.1)), with_prefill=False).tpot_s
    assert below > sim.run(cfg.replace(context=int(x * 0.9), variant="full"), with_prefill=False).tpot_s
    assert above < sim.run(cfg.replace(context=int(x * 1.1), variant="full"), with_prefill=False).tpot_s


def test_host_scale_matching_reproduces_the_asked_tpot():
    import dataclasses

    from icecache.sim.crossover import scale_matching

    prof = synthetic_profile()
    sim = Simulator(prof)
    cfg = SimConfig("qwen3-4b", "h100", "icecache", 36_000, threads=64, impl="paper")
    base = sim.run(cfg, with_prefill=False).tpot_s
    scale0 = sim.costs("h100-sxm").host_time_scale
    s = scale_matching(sim, cfg, base * 1.5)
    assert s > scale0
    alt = sim.with_costs("h100", dataclasses.replace(sim.costs("h100-sxm"), host_time_scale=s))
    assert alt.run(cfg, with_prefill=False).tpot_s == pytest.approx(base * 1.5, rel=1e-6)
    assert sim.costs("h100-sxm").host_time_scale == scale0  # the what-if leaves the simulator as it was
    assert math.isnan(scale_matching(sim, cfg, base * 1e6))  # unreachable: no scale


def test_sweep_command_writes_csv_markdown_and_plots(tmp_path, capsys):
    prof = synthetic_profile().save(tmp_path / "profile.json")
    out = tmp_path / "sweep"
    rc = main(["sweep", "--hardware", "a100,h100", "--model", "qwen3-4b", "--context", "16k..256k", "--budgets", "128,256",
               "--page-sizes", "16", "--threads", "64", "--variants", "full,icecache,icecache-r", "--profile", str(prof),
               "--out-dir", str(out), "--backend", "serial"])
    assert rc == 0
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2 * 5 * (1 + 2 * 2)
    md = (out / "summary.md").read_text()
    assert "wall time" in md and "python -m icecache.sim sweep" in md and "Crossover" in md
    for name in ("tpot_vs_context.png", "stage_breakdown.png", "hit_rate_vs_budget.png"):
        assert (out / name).stat().st_size > 1000


def test_project_command_writes_files_only_with_out(tmp_path, capsys, monkeypatch):
    """`project` prints its table; it writes .csv/.md/.png only where --out says (it once overwrote a committed
    result by default)."""
    prof = synthetic_profile().save(tmp_path / "profile.json")
    monkeypatch.chdir(tmp_path)
    args = ["project", "--model", "qwen3-4b", "--hardware", "h100", "--context", "16k..64k", "--profile", str(prof)]
    assert main(args) == 0
    assert "TPOT" in capsys.readouterr().out
    assert sorted(x.name for x in tmp_path.rglob("*") if x.is_file()) == ["profile.json"]
    assert main(args + ["--out", str(tmp_path / "proj")]) == 0
    assert all((tmp_path / f"proj.{ext}").stat().st_size > 100 for ext in ("csv", "md", "png"))


def test_cli_errors_are_clear(tmp_path, capsys):
    prof = synthetic_profile().save(tmp_path / "profile.json")
    assert main(["crossover", "--hardware", "tpu", "--profile", str(prof)]) == 2
    assert "unknown hardware" in capsys.readouterr().err
    assert main(["sweep", "--profile", str(tmp_path / "none.json"), "--out-dir", str(tmp_path)]) == 2
    assert "calibrate" in capsys.readouterr().err


def test_hardware_and_models_listings(capsys):
    assert main(["hardware"]) == 0
    out = capsys.readouterr().out
    assert "h100-sxm" in out and "nvbandwidth" in out and "calibrated" in out
    assert main(["models"]) == 0
    assert "qwen3-4b" in capsys.readouterr().out


def test_crossings_find_a_window_where_the_variant_wins():
    from icecache.sim.crossover import SelectGrowth, crossings

    prof = synthetic_profile()
    sim = Simulator(prof)
    cfg = SimConfig("qwen3-4b", "h100", "icecache", 100_000, threads=64, impl="paper")
    base = sim.costs("h100-sxm")
    steep = sim.with_costs("h100-sxm", SelectGrowth(base, 1_000_000, 2.0))  # index queries outgrow attention past 1M
    cr = crossings(steep, cfg)
    assert [d for _, d in cr] == ["faster", "slower"] and cr[0][0] < cr[1][0]
    flat = sim.with_costs("h100-sxm", SelectGrowth(base, 36_000, 0.0))
    assert find_crossover(flat, cfg) <= find_crossover(sim, cfg)  # a context-free query cost crosses no later


@pytest.mark.parametrize("hardware", hardware_names())
def test_sweep_runs_on_every_shipped_hardware_with_the_shipped_profile(hardware, tmp_path):
    """The command end to end with the profile shipped in the package (which has the in-decode timings the
    synthetic profile lacks), serial and on the process pool (110 configurations: above the pool's threshold),
    the grid cut to two contexts and two thread counts; both backends write the same rows."""
    out = {}
    for backend in ("serial", "process"):
        args = ["sweep", "--hardware", hardware, "--backend", backend, "--workers", "2", "--context", "8k,64k",
                "--threads", "8,64", "--no-plots", "--out", str(tmp_path / backend)]
        assert main(args) == 0
        with open(tmp_path / backend / "results.csv") as f:
            out[backend] = list(csv.DictReader(f))
    rows = out["process"]
    assert len(rows) == 2 * (1 + 3 * 3 * 3 * 2) and {r["hardware"] for r in rows} == {canonical_hardware(hardware)}
    assert all(math.isfinite(float(r["tpot_s"])) and float(r["tpot_s"]) > 0 for r in rows)
    assert [r["tpot_s"] for r in rows] == [r["tpot_s"] for r in out["serial"]]


def test_sweep_with_no_arguments_runs(tmp_path):
    """``python -m icecache.sim sweep`` exactly as the design card gives it: every default, a fresh process."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "icecache.sim", "sweep"], capture_output=True, text=True, cwd=tmp_path,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "simulating 984 configurations" in done.stdout and "Traceback" not in done.stderr


def test_lean_profile_costs_what_the_full_profile_costs():
    """Workers get the profile without raw samples; the in-decode select scaling read from them must survive."""
    from icecache.sim.cost_models import MeasuredCosts
    from icecache.sim.inputs import load_profile
    from icecache.sim.shapes import get_shape

    profile = load_profile(None)
    assert "decode_index" in profile.samples  # the shipped profile has the timing this guards
    shape = get_shape("llama-3.1-8b")
    for pager in profile.samples["decode_index"]:
        full = MeasuredCosts(profile, extrapolation="allow").select_job_s(shape, pager, 30000, 256, 16)
        lean = MeasuredCosts(profile.lean(), extrapolation="allow").select_job_s(shape, pager, 30000, 256, 16)
        assert lean == full
