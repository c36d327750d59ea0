"""The simulator's commands as a user meets them (issue 21, section 7), and the layering that keeps the
simulator a reader of profiles: it imports only `icecache.core` and itself."""

from __future__ import annotations

import ast
import json
import math
import warnings
from pathlib import Path

import pytest

import icecache
from icecache.sim.cli import main
from icecache.sim.testing import synthetic_profile

PKG = Path(icecache.__file__).parent


def _modules(sub: str) -> dict[str, ast.Module]:
    return {".".join(p.relative_to(PKG.parent).with_suffix("").parts): ast.parse(p.read_text()) for p in (PKG / sub).rglob("*.py")}


def _imports(tree: ast.Module) -> list[tuple[str, list[str]]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.append((node.module, [a.name for a in node.names]))
    return out


def test_the_simulator_imports_only_core_and_itself():
    for name, tree in _modules("sim").items():
        bad = [m for m, _ in _imports(tree) if m.startswith("icecache") and not m.startswith(("icecache.core", "icecache.sim"))]
        assert not bad, (name, bad)


def test_the_simulator_does_not_even_name_the_upper_packages():
    """Issue 21's acceptance: ``grep -rn "icecache.runtime\\|icecache.indexes\\|icecache.eval\\|icecache.measure"
    icecache/sim`` prints nothing (docstrings included)."""
    import re

    pattern = re.compile(r"icecache.runtime|icecache.indexes|icecache.eval|icecache.measure")
    hits = [f"{p}:{i + 1}" for p in (PKG / "sim").rglob("*.py") for i, line in enumerate(p.read_text().splitlines()) if pattern.search(line)]
    assert not hits, hits


def test_measure_does_not_import_eval_and_no_module_imports_private_names():
    for name, tree in {**_modules("sim"), **_modules("measure")}.items():
        for mod, names in _imports(tree):
            assert not mod.startswith(("icecache.eval", "icecache.cli")) or not name.startswith("icecache.measure"), (name, mod)
            private = [n for n in names if n.startswith("_") and mod.startswith("icecache") and mod != name]
            assert not private, (name, mod, private)


def test_no_import_cycles_and_no_file_over_600_lines():
    graph = {name: {m for m, _ in _imports(tree) if m.startswith("icecache.sim.") and m != name}
             for name, tree in _modules("sim").items()}
    seen: dict[str, int] = {}

    def visit(n: str, path: tuple[str, ...]) -> None:
        if seen.get(n) == 2:
            return
        assert seen.get(n) != 1, "import cycle: " + " -> ".join(path + (n,))
        seen[n] = 1
        for m in graph.get(n, ()):
            visit(m, path + (n,))
        seen[n] = 2

    for n in graph:
        visit(n, ())
    for sub in ("sim", "measure"):
        for p in (PKG / sub).rglob("*.py"):
            assert len(p.read_text().splitlines()) < 600, p


def _profile(tmp_path: Path, **changes) -> Path:
    d = synthetic_profile().to_dict()
    d.update(changes)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    return path


def test_commands_do_not_warn_about_another_stack(tmp_path, capsys):
    """Every command used to warn 'measured on another stack' (hnsw/ivf code hashes): the simulator no longer
    checks the stack (``icecache calibrate --check`` does), so nothing is said however the profile was made."""
    prof = _profile(tmp_path, versions={"torch": "0.0.1"}, pager_hashes={"hnsw": "0" * 16, "ivf": "1" * 16, "gone": "2" * 16})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["crossover", "--profile", str(prof)]) == 0
        assert main(["paper", "--profile", str(prof)]) == 0
    out = capsys.readouterr()
    assert "another stack" not in out.out + out.err and "warning" not in out.out + out.err


def test_sweep_writes_nothing_without_out(tmp_path, capsys, monkeypatch):
    """`sim sweep` once wrote experiments/sim/sweep/ into whatever folder it ran in: now only --out writes."""
    prof = _profile(tmp_path)
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "--hardware", "h100", "--model", "qwen3-4b", "--context", "8k,16k", "--budgets", "256", "--page-sizes", "16",
            "--threads", "64", "--variants", "full,icecache", "--profile", str(prof), "--backend", "serial", "--no-prefill"]
    assert main(args) == 0
    assert "## TPOT (ms) vs context" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["profile.json"]
    assert main(args + ["--out", "res", "--no-plots"]) == 0
    assert sorted(p.name for p in (tmp_path / "res").iterdir()) == ["results.csv", "summary.md"]


def test_sweep_console_and_summary_word_crossovers_alike(tmp_path, capsys):
    """The console said 'inf' where the summary said 'beyond grid'."""
    prof = _profile(tmp_path)
    assert main(["sweep", "--hardware", "h100", "--model", "qwen3-4b", "--context", "1k,2k", "--budgets", "256", "--page-sizes", "16",
                 "--threads", "64", "--variants", "full,icecache", "--profile", str(prof), "--backend", "serial", "--no-prefill",
                 "--out", str(tmp_path / "res"), "--no-plots"]) == 0
    console = capsys.readouterr().out
    summary = (tmp_path / "res" / "summary.md").read_text()
    assert "crossover h100-sxm/qwen3-4b/icecache: beyond grid" in console
    assert "| h100-sxm | qwen3-4b | icecache | beyond grid |" in summary
    assert "inf" not in console.replace("info", "") and "inf" not in summary.replace("info", "")


def test_validate_defaults_to_the_shipped_runs_and_profile(tmp_path, capsys, monkeypatch):
    """`sim validate` needed --runs although runs ship with the package; it also reads nothing under experiments/
    (run from an empty folder)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ICECACHE_SIM_PROFILE", raising=False)
    assert main(["validate", "--out", "v.md"]) == 0
    out = capsys.readouterr().out
    assert "Hold-out rule `context`: 50 calibration runs, 50 scored runs." in out
    data = json.loads((tmp_path / "v.json").read_text())
    assert data["n_test"] == 50 and math.isfinite(data["raw"]["tpot"]["mape"])


def test_validate_refuses_to_overwrite_a_report_without_force(tmp_path, capsys):
    """The README's validate command overwrote a committed result."""
    from icecache.sim.config import SimConfig
    from icecache.sim.simulator import Simulator
    from icecache.sim.validate import synthetic_runs

    prof = _profile(tmp_path)
    cfgs = [SimConfig("smollm2", "this-machine", v, n, budget=64, threads=1) for v in ("full", "icecache") for n in (1024, 4096)]
    runs = tmp_path / "runs.jsonl"
    runs.write_text("\n".join(json.dumps(r.to_dict()) for r in synthetic_runs(cfgs, Simulator(synthetic_profile()))))
    out = tmp_path / "val.md"
    args = ["validate", "--runs", str(runs), "--profile", str(prof), "--out", str(out)]
    out.write_text("committed")
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already exists" in err[0] and "--force" in err[0]
    assert out.read_text() == "committed" and not out.with_suffix(".json").exists()
    assert main(args + ["--force"]) == 0 and "Kendall tau" in out.read_text()


@pytest.mark.parametrize("args, words", [
    (["sweep", "--context", "8k..64k:x"], "count after ':'"),
    (["sweep", "--context", "lots"], "token count"),
    (["sweep", "--budgets", "x"], "token count"),
    (["sweep", "--dense-layers", "a,b"], "layer indices"),
    (["sweep", "--dense-layers", "99", "--context", "8k"], "dense_layers"),
    (["sweep", "--reuse-every", "0", "--context", "8k"], "reuse_every"),
    (["sweep", "--workers", "-1", "--context", "8k", "--budgets", "64", "--page-sizes", "16", "--threads", "8",
      "--hardware", "h100", "--variants", "icecache"], "workers"),
    (["crossover", "--threads", "0"], "threads"),
    (["crossover", "--hardware", "tpu"], "unknown hardware"),
    (["project", "--variants", "full,magic"], "unknown variant"),
    (["paper", "--hit", "{tmp}/missing.json"], "no hit model"),
    (["paper", "--hit", "{tmp}/bad.json"], "not a fitted hit model"),
    (["paper", "--hit", "{tmp}/bad.jsonl"], "not JSON"),
    (["paper", "--profile", "{tmp}/bad.json"], "not JSON"),
    (["paper", "--profile", "{tmp}/missing.json"], "calibrate"),
    (["validate", "--runs", "{tmp}/bad.jsonl"], "not JSON"),
    (["validate", "--runs", "{tmp}/missing.jsonl"], "no measured runs"),
    (["hardware", "--json", "{tmp}/no/such/folder/h.json"], "No such file"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, args, words):
    (tmp_path / "bad.json").write_text("{nope")
    (tmp_path / "bad.jsonl").write_text("{nope\n")
    prof = _profile(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--profile" not in argv and argv[0] != "hardware":
        argv += ["--profile", str(prof)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("icecache sim: error: ") and words in err[0], err
