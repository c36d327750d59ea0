"""House rules that a linter does not check: module size, private names, a light `import icecache`."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "icecache"
MAX_LINES = 600


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_module_over_600_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in _modules()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_imports_another_modules_private_names():
    """`from icecache.x import _name` across modules reaches into x's internals (a private *module* such as
    `_dci_kernels` is fine when imported by its own package, and the names it exports are public)."""
    offenders = []
    for path in _modules():
        here = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("icecache"):
                if node.module == here:
                    continue
                own_package = node.module == here.rpartition(".")[0]
                for alias in node.names:
                    submodule = (PACKAGE.parent / node.module.replace(".", "/") / f"{alias.name}.py").exists()
                    if own_package and submodule:
                        continue  # a private module of the importer's own package
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        offenders.append(f"{here}: from {node.module} import {alias.name}")
    assert not offenders, "\n".join(offenders)


def test_import_icecache_stays_light():
    """`import icecache` registers the attention function and nothing else heavy: no pager backend, no
    simulator, no numba kernels, no evaluation code."""
    code = ("import sys, icecache; heavy = [m for m in ('icecache.indexes.dci', 'icecache.sim', 'icecache.eval', "
            "'icecache.measure', 'numba', 'faiss', 'hnswlib', 'simpy', 'matplotlib') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
    out = subprocess.run([sys.executable, "-c", "import icecache; print(icecache.IceCache.__name__, icecache.make_pager.__name__)"],
                         capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["IceCache", "make_pager"]
