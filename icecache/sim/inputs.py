"""What the simulator's commands read, resolved one way for all of them: the calibration profile, the hit
model, dense layers, the command line they record, and the guard against overwriting a result."""

from __future__ import annotations

import os
import shlex
from collections.abc import Sequence
from pathlib import Path

from icecache.core.errors import ConfigError
from icecache.sim.hitrate import HitModel, load_hit_model
from icecache.sim.profile import CalibrationProfile, default_profile_path

__all__ = ["PROFILE_ENV", "resolve_profile_path", "load_profile", "load_hit", "parse_dense_layers", "format_dense_layers",
           "command_line", "check_writable"]

#: environment variable naming the calibration profile when ``--profile`` is not given
PROFILE_ENV = "ICECACHE_SIM_PROFILE"


def resolve_profile_path(arg: str | os.PathLike[str] | None = None) -> Path:
    """``arg``, else ``$ICECACHE_SIM_PROFILE``, else the profile shipped with the package (`default_profile_path`)."""
    if arg:
        return Path(arg)
    env = os.environ.get(PROFILE_ENV)
    return Path(env) if env else default_profile_path()


def load_profile(arg: str | os.PathLike[str] | None = None) -> CalibrationProfile:
    """The calibration profile `resolve_profile_path` names."""
    return CalibrationProfile.load(resolve_profile_path(arg))


def load_hit(paths: Sequence[str | os.PathLike[str]] | None, extrapolation: str) -> HitModel | None:
    """A hit model from ``--hit`` files (`icecache.sim.hitrate.load_hit_model`); None (the prior) without files."""
    return load_hit_model(list(paths), extrapolation) if paths else None


def parse_dense_layers(text: str) -> tuple[int, ...]:
    """``--dense-layers``: comma-separated layer indices as ``icecache generate --dense-layers`` takes them
    (``"0,1"``), or ``none`` / empty for no dense layer."""
    t = str(text).strip().lower()
    if t in ("none", ""):
        return ()
    try:
        return tuple(int(x) for x in t.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--dense-layers takes comma-separated layer indices (e.g. 0,1) or 'none', got {text!r}") from None


def format_dense_layers(layers: Sequence[int]) -> str:
    """How a command prints ``dense_layers`` (the inverse of `parse_dense_layers`)."""
    return ",".join(str(i) for i in layers) if layers else "none"


def command_line(argv: Sequence[str]) -> str:
    """The command a result records: ``python -m icecache.sim`` and the arguments, shell-quoted."""
    return "python -m icecache.sim " + " ".join(shlex.quote(a) for a in argv)


def check_writable(paths: Sequence[Path], force: bool) -> None:
    """Refuse (`ConfigError`) to overwrite any of ``paths`` unless ``force``: committed results are not
    replaced by accident."""
    if force:
        return
    existing = [str(p) for p in paths if Path(p).exists()]
    if existing:
        raise ConfigError(f"{', '.join(existing)} already exist{'s' if len(existing) == 1 else ''}; pass --force to overwrite")
