"""Argument checks shared by the pager backends: one line each, raising `InputError` that quotes the name, the
accepted range and the bad value."""

from __future__ import annotations

import math

import numpy as np

from icecache.core.errors import InputError


def check_int(name: str, value: object, lo: int, *, allow_none: bool = False) -> None:
    """Raise `InputError` unless ``value`` is an int (not a bool) ``>= lo`` (or None, when ``allow_none``)."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lo:
        raise InputError(f"{name} must be an int >= {lo}{' or None' if allow_none else ''}, got {value!r}")


def check_float(name: str, value: object, lo: float, *, allow_none: bool = False, lo_open: bool = False) -> None:
    """Raise `InputError` unless ``value`` is a finite number ``>= lo`` (``> lo`` when ``lo_open``; or None,
    when ``allow_none``)."""
    if value is None and allow_none:
        return
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        ok = float(value) > lo if lo_open else float(value) >= lo
    if not ok:
        relation = ">" if lo_open else ">="
        raise InputError(f"{name} must be a finite number {relation} {lo}{' or None' if allow_none else ''}, got {value!r}")


__all__ = ["check_float", "check_int"]
