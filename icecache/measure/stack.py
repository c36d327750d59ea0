"""The software stack a calibration profile was measured with, and the check against the running one.

A profile records `software_versions` and the `pager_code_hashes` of the pagers it timed when it is measured
(`icecache.measure.calibrate.run_calibration`). `profile_mismatches` compares them with the running stack:
``icecache calibrate --check`` reports it. The simulator never checks (it reads profiles as files and does not
import the pagers).
"""

from __future__ import annotations

import hashlib
import inspect
import platform
from collections.abc import Iterable
from pathlib import Path

from icecache.sim.profile import CalibrationProfile

__all__ = ["VERSIONED", "CHECKED_VERSIONS", "software_versions", "pager_code_hashes", "profile_mismatches"]

#: libraries whose versions a profile records
VERSIONED: tuple[str, ...] = ("torch", "transformers", "numpy", "scipy", "simpy", "numba")
#: the ones whose change makes a profile stale (they run the timed code)
CHECKED_VERSIONS: tuple[str, ...] = ("torch", "transformers", "numpy")


def software_versions() -> dict[str, str]:
    """Versions of the libraries a timing depends on (stored with every profile)."""
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "absent"
    return out


def pager_code_hashes(names: Iterable[str]) -> dict[str, str]:
    """SHA-256 (first 16 hex digits) of the source file of each registered pager (changed code = new profile)."""
    from icecache.indexes.registry import get_pager_class

    out = {}
    for n in names:
        try:
            src = Path(inspect.getfile(get_pager_class(n))).read_bytes()
            out[n] = hashlib.sha256(src).hexdigest()[:16]
        except Exception:  # a pager without a source file (built dynamically) cannot be hashed
            out[n] = "unknown"
    return out


def profile_mismatches(profile: CalibrationProfile) -> list[str]:
    """Differences between the stack ``profile`` was measured with and the running one: the versions of
    `CHECKED_VERSIONS`, and the source of every pager it timed (changed, or no longer registered)."""
    from icecache.indexes.registry import available_pagers

    now = software_versions()
    out = [f"{k} {profile.versions.get(k)} then, {now.get(k)} now" for k in CHECKED_VERSIONS if profile.versions.get(k) != now.get(k)]
    known = set(available_pagers())
    hashes = pager_code_hashes([n for n in profile.pager_hashes if n in known])
    out += [f"pager {n} code changed" for n, h in hashes.items() if h != profile.pager_hashes.get(n)]
    out += [f"pager {n} no longer registered" for n in profile.pager_hashes if n not in known]
    return out
