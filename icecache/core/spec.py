"""The one grammar for a named thing with settings, and for lists of them on a command line.

    spec   := name | name "[" params "]"         mdci, mdci[search=exhaustive], icecache[page_size=4;field_of_view=200]
    params := key "=" value (";" | "," key "=" value)*
    list   := spec ("," spec)*                    full,icecache[page_size=4,field_of_view=200],quest

Pagers (``IceCacheConfig.index``, `make_pager`, ``stats()["index"]``), evaluation methods and their variants,
and the benchmarks' pager lists all use it. Values are read as JSON numbers, booleans, null (``None``/``none``
too) or lists where they parse, else kept as strings; `format_spec` writes what `parse_spec` reads back, so a
name any part of the package reports can be fed back to it.

Token counts have two meanings of "k" (`parse_tokens`): decimal (``4k`` = 4,000 tokens: contexts, prompts,
simulator grids) and RULER's binary lengths (``4k`` = 4,096, `parse_ruler_length`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

from icecache.core.errors import ConfigError

__all__ = ["DECIMAL_K", "RULER_K", "format_spec", "parse_params", "parse_ruler_length", "parse_spec", "parse_tokens",
           "split_items"]

_SPEC = re.compile(r"\s*([A-Za-z_][\w:.-]*)\s*(?:\[(.*)\])?\s*", re.DOTALL)
#: "k" in a token count: 1,000 (contexts, prompts, the simulator's grids) ...
DECIMAL_K = 1000
#: ... or 1,024 in RULER's lengths (its task lengths are powers of two: "4k" is 4,096 tokens)
RULER_K = 1024


def _split_top(text: str, separators: str) -> list[str]:
    """``text`` split at ``separators`` outside ``[...]``, items stripped, empty items dropped."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth = max(depth - 1, 0)
        elif ch in separators and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [x.strip() for x in items if x.strip()]


def split_items(text: str | None) -> list[str]:
    """Comma-separated items of a command-line list, stripped; commas inside ``[...]`` belong to the item
    (``"full,icecache[page_size=4,field_of_view=200]"`` -> two items)."""
    return _split_top(text or "", ",")


def _value(text: str) -> Any:
    t = text.strip()
    if t in ("None", "none"):
        return None
    try:
        return json.loads(t)
    except json.JSONDecodeError:
        return t


def parse_params(text: str | None) -> dict[str, Any]:
    """``"field_of_view=120;page_score=mass"`` (``,`` also separates) -> ``{"field_of_view": 120,
    "page_score": "mass"}``; a malformed item raises `ConfigError` in one line."""
    out: dict[str, Any] = {}
    for item in _split_top(text or "", ";,"):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ConfigError(f"expected key=value[;key=value...], got {item!r}")
        out[key] = _value(value)
    return out


def parse_spec(text: str) -> tuple[str, dict[str, Any]]:
    """``"mdci"`` -> ``("mdci", {})``; ``"mdci[search=exhaustive;field_of_view=120]"`` -> ``("mdci", {...})``.
    Raises `ConfigError` (one line) for anything else, including empty brackets."""
    match = _SPEC.fullmatch(str(text))
    if match is None:
        raise ConfigError(f"expected name or name[key=value;...], got {text!r}")
    name, inner = match.group(1), match.group(2)
    if inner is not None and not inner.strip():
        raise ConfigError(f"{text!r}: empty brackets; write {name} or {name}[key=value;...]")
    try:
        return name, parse_params(inner)
    except ConfigError as err:
        raise ConfigError(f"{text!r}: {err}") from None


def _format_value(key: str, value: Any) -> str:
    if isinstance(value, str):
        if _value(value) != value or any(c in value for c in ";,[]="):
            raise ConfigError(f"parameter {key}={value!r} cannot be written in a spec (it would read back as another value)")
        return value
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"parameter {key}={value!r} cannot be written in a spec")
    return json.dumps(value, separators=(",", ":"))


def format_spec(name: str, params: Mapping[str, Any] | None = None) -> str:
    """The inverse of `parse_spec`: ``("mdci", {"search": "exhaustive"})`` -> ``"mdci[search=exhaustive]"``
    (parameters in the given order, ``;``-separated; no brackets without parameters)."""
    if _SPEC.fullmatch(name) is None or "[" in name:
        raise ConfigError(f"not a spec name: {name!r}")
    if not params:
        return name
    return f"{name}[{';'.join(f'{key}={_format_value(key, value)}' for key, value in params.items())}]"


def parse_tokens(text: str | int, k: int = DECIMAL_K) -> int:
    """A token count as written on a command line: ``"36k"`` -> 36000, ``"1.5k"`` -> 1500, ``"1m"`` ->
    1000000, ``"8192"`` -> 8192 (an int passes through). Case and surrounding blanks are ignored; the result is
    rounded to the nearest integer. Anything else raises `ConfigError`. ``k=RULER_K``: binary lengths
    (`parse_ruler_length`)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    t = str(text).strip().lower()
    mult = {"k": k, "m": k * k}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if mult > 1 else t)
    except ValueError:
        raise ConfigError(f"cannot read a token count from {text!r} (examples: 4096, 36k, 1.5k, 1m)") from None
    if not math.isfinite(value):
        raise ConfigError(f"cannot read a token count from {text!r} (examples: 4096, 36k, 1.5k, 1m)")
    return int(round(value * mult))


def parse_ruler_length(text: str | int) -> int:
    """A RULER length: ``"4k"`` -> 4096, ``"8192"`` -> 8192 (RULER's binary k, `RULER_K`)."""
    return parse_tokens(text, k=RULER_K)
