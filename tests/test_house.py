"""House rules that a linter does not check: module size, private names, a light `import icecache`."""

from __future__ import annotations

import ast
import re
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
    """`import icecache` imports nothing heavy: no torch, no transformers, no pager backend, no simulator, no
    numba kernels, no evaluation code. The runtime's first use registers the attention function."""
    code = ("import sys, icecache; heavy = [m for m in ('torch', 'transformers', 'icecache.runtime', "
            "'icecache.indexes.dci', 'icecache.sim', 'icecache.eval', 'icecache.measure', 'numba', 'faiss', 'hnswlib', "
            "'simpy', 'matplotlib') if m in sys.modules]; print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
    code = ("import icecache; from transformers import AttentionInterface; before = 'icecache' in AttentionInterface._global_mapping; "
            "print(before, icecache.IceCache.__name__, icecache.make_pager.__name__, 'icecache' in AttentionInterface._global_mapping)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["False", "IceCache", "make_pager", "True"], out.stdout


def test_the_simulator_loads_neither_torch_nor_transformers():
    """`icecache.sim` is a pure model over `icecache.core`: importing it and running its commands (a sweep on the
    process pool, the validation, a crossover) loads no torch, transformers or numba."""
    code = ("import sys, contextlib, io\n"
            "import icecache.sim\n"
            "from icecache.sim.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['sweep', '--hardware', 'h100', '--context', '8k..256k:4', '--workers', '2', '--no-plots']) == 0\n"
            "    assert main(['validate']) == 0 and main(['crossover']) == 0\n"
            "print([m for m in ('torch', 'transformers', 'numba', 'icecache.runtime') if m in sys.modules])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its source (module level, inside functions, under
    TYPE_CHECKING): ``from pkg import submodule`` counts as importing the submodule."""
    modules = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def test_the_import_graph_has_no_cycle():
    """Arrows point down only: no module reaches itself through imports (the cache and its layers once held
    each other; a layer now gets a `LayerContext`)."""
    graph = _import_graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state:
            cycle = visit(module)
            assert cycle is None, " -> ".join(cycle)
    assert "icecache.runtime.cache" not in graph["icecache.runtime.layer"]


def test_no_file_cites_notes_outside_the_repository():
    """The repository stands alone: no file links to ``../shared`` or cites the team's design notes by file name
    (their content lives in ``docs/``)."""
    root = PACKAGE.parent
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True).stdout.split()
    pattern = re.compile(r"\.\./shared|\b(ICECACHE|DCI_SPEC|HF_INTEGRATION|PEERS|SIM_ANCHORS|STYLE)\.md\b|\bRULER\.md\b")
    offenders = []
    for name in tracked:
        path = root / name
        if path.suffix not in (".py", ".md", ".toml", ".cfg", ".txt", "") or not path.is_file() or name.startswith("tests/test_house"):
            continue
        for lineno, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{name}:{lineno}")
    assert not offenders, "cite docs/ instead: " + ", ".join(offenders[:20])
