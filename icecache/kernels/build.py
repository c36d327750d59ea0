"""Build the native kernel library (`make setup` runs it): ``python -m icecache.kernels.build``.

The sources (``src/``) are plain C++17 with a C ABI, compiled by the machine's own compiler (``$CXX``, else
``c++`` / ``g++`` / ``clang++``) into ``_build/libicecache_kernels.so`` beside a ``build.json`` that records the
sources' hash, the compiler and the instruction sets built. The arithmetic (``isa_kernels.cpp``) is compiled
once per instruction set (`ISAS`): the x86-64 baseline, AVX2 (+FMA, F16C; the baseline of our machines) and
AVX-512; the library picks the widest the CPU runs when it loads (`icecache.kernels.library`). An instruction set
the compiler cannot target is left out, and said so.

No compiler (or a failed build) is not an error here: the command says so in one line and exits 0, and the
runtime then uses its numba kernels, with one warning and ``stats()["kernels"]`` saying why. ``--strict``
makes a failed build exit 1 (CI, tests).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE / "src"
OUT_DIR = HERE / "_build"
LIBRARY = OUT_DIR / "libicecache_kernels.so"
MANIFEST = OUT_DIR / "build.json"

#: instruction set -> the compiler flags of its build of isa_kernels.cpp (the generic one is required)
ISAS: dict[str, tuple[str, ...]] = {
    "generic": ("-DICE_ISA_GENERIC",),
    "avx2": ("-DICE_ISA_AVX2", "-mavx2", "-mfma", "-mf16c"),
    "avx512": ("-DICE_ISA_AVX512", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx2", "-mfma", "-mf16c"),
}
COMMON_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-fno-fast-math", "-Wall", "-Wextra")
#: the sources compiled once, for the x86-64 baseline: the dispatcher (C ABI, threads, top-k), the DCI search and
#: decode insert, and the layer's bulk load
BASELINE_SOURCES = ("dispatch.cpp", "dci_rank.cpp", "dci_insert.cpp", "layer_load.cpp")
#: the dispatcher's parallel calls run on OpenMP when the compiler has it (linked to ``libgomp.so.1``, the runtime
#: torch's CPU build ships and loads first), else serially
OPENMP_FLAGS = ("-fopenmp",)


def source_hash() -> str:
    """SHA-256 over every source file and the flags: the build is stale when it differs."""
    digest = hashlib.sha256()
    for path in sorted(SRC.iterdir()):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(json.dumps([COMMON_FLAGS, OPENMP_FLAGS, ISAS]).encode())
    return digest.hexdigest()


def find_compiler() -> str | None:
    """``$CXX`` when set, else the first of ``c++``, ``g++``, ``clang++`` on ``PATH``."""
    if os.environ.get("CXX"):
        return shutil.which(os.environ["CXX"])
    for name in ("c++", "g++", "clang++"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _compile(compiler: str, source: Path, flags: tuple[str, ...], obj: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([compiler, *COMMON_FLAGS, *flags, "-c", str(source), "-o", str(obj)], capture_output=True,
                          text=True, check=False)


def build(out_dir: Path = OUT_DIR) -> dict[str, object]:
    """Compile and link the library into ``out_dir`` (atomically: a failed build leaves any previous one in place).

    Returns the manifest written. Raises RuntimeError with the compiler's first error line when the generic or
    dispatch object, or the link, fails.
    """
    compiler = find_compiler()
    if compiler is None:
        raise RuntimeError("no C++ compiler found ($CXX, c++, g++ or clang++)")
    started = time.perf_counter()
    built, skipped = [], {}
    with tempfile.TemporaryDirectory(prefix="icecache-kernels-") as tmp:
        objs = []
        for isa, flags in ISAS.items():
            obj = Path(tmp) / f"isa_{isa}.o"
            result = _compile(compiler, SRC / "isa_kernels.cpp", flags, obj)
            if result.returncode != 0:
                if isa == "generic":
                    raise RuntimeError(f"{compiler} failed on isa_kernels.cpp: {_first_error(result.stderr)}")
                skipped[isa] = _first_error(result.stderr)
                continue
            built.append(isa)
            objs.append(str(obj))
        linked = Path(tmp) / LIBRARY.name
        openmp = True  # the dispatcher's parallel calls on OpenMP (torch's runtime); else serially
        for flags in (OPENMP_FLAGS, ()):
            failed, base_objs = "", []
            for source in BASELINE_SOURCES:
                obj = Path(tmp) / f"{Path(source).stem}.o"
                result = _compile(compiler, SRC / source, flags, obj)
                if result.returncode != 0:
                    failed = source
                    break
                base_objs.append(str(obj))
            if not failed:
                result = subprocess.run([compiler, "-shared", "-pthread", *flags, "-o", str(linked), *objs, *base_objs],
                                        capture_output=True, text=True, check=False)
                failed = "the link" if result.returncode != 0 else ""
            if not failed:
                break
            if not flags:
                raise RuntimeError(f"{compiler} failed on {failed}: {_first_error(result.stderr)}")
            skipped["openmp"] = _first_error(result.stderr)
            openmp = False
        out_dir.mkdir(parents=True, exist_ok=True)
        manifest = {"source_hash": source_hash(), "compiler": compiler, "compiler_version": _version(compiler),
                    "isas": built, "openmp": openmp, "skipped": skipped, "seconds": round(time.perf_counter() - started, 2)}
        shutil.move(str(linked), out_dir / LIBRARY.name)
        (out_dir / MANIFEST.name).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def is_current() -> bool:
    """Whether the built library exists and was built from today's sources."""
    if not LIBRARY.exists() or not MANIFEST.exists():
        return False
    try:
        return json.loads(MANIFEST.read_text()).get("source_hash") == source_hash()
    except (OSError, ValueError):
        return False


def _first_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error" in line] or stderr.splitlines() or ["(no output)"]
    return lines[0].strip()


def _version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m icecache.kernels.build", description=__doc__.splitlines()[0])
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 when the library, one of its instruction sets or OpenMP cannot be built")
    parser.add_argument("--if-stale", action="store_true", help="do nothing when the library is current")
    args = parser.parse_args(argv)
    if args.if_stale and is_current():
        print(f"icecache kernels: {LIBRARY.relative_to(HERE.parent.parent)} is current")
        return 0
    try:
        manifest = build()
    except RuntimeError as err:
        print(f"icecache kernels: not built ({err}); the runtime will use its numba kernels", file=sys.stderr)
        return 1 if args.strict else 0
    if args.strict and manifest["skipped"]:
        print(f"icecache kernels: --strict, but left out: {manifest['skipped']}", file=sys.stderr)
        return 1
    skipped = "".join(f"; {isa} left out: {why}" for isa, why in manifest["skipped"].items())  # type: ignore[union-attr]
    print(f"icecache kernels: built {', '.join(manifest['isas'])}{' with OpenMP' if manifest['openmp'] else ''} "  # type: ignore[arg-type]
          f"in {manifest['seconds']} s "
          f"({manifest['compiler_version']}){skipped}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
