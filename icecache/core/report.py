"""Plain-text results: CSV writing and Markdown tables (no torch, no numpy).

    >>> print(md_table(["method", "recall"], [["mdci", 0.98765], ["exact", float("nan")]]))
    | method | recall |
    |---|---|
    | mdci | 0.9877 |
    | exact | - |
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from icecache.core.errors import InputError

__all__ = ["write_csv", "md_table", "format_cell"]


def write_csv(path: str | Path, rows: Sequence[Mapping[str, Any]], *, float_format: str | None = None) -> Path:
    """Write ``rows`` (dicts) to ``path`` as CSV and return the path.

    Columns: every key of every row, in order of first appearance (a row without a key leaves its cell
    empty). ``float_format`` (a format spec such as ``".6g"``) formats float cells; None writes ``repr``-exact
    values. Parent folders are created; an empty ``rows`` writes an empty file.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with p.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        for r in rows:
            if float_format is None:
                w.writerow(r)
            else:
                w.writerow({k: (format(v, float_format) if isinstance(v, float) else v) for k, v in r.items()})
    return p


def format_cell(v: Any) -> str:
    """A Markdown table cell: floats with 4 significant digits (no exponent from 1e4 up), NaN as ``-``."""
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.0f}"
    return str(v)


def md_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table of ``rows`` under ``header`` (cells through `format_cell`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(format_cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def json_objects(lines: Iterable[str], what: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for every non-blank line of a JSON-lines file; a line that is not a JSON object
    raises `InputError` naming ``what`` (e.g. ``"trace t.jsonl"``) and the line."""
    for i, line in enumerate(lines):
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{what}:{i + 1} is not JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InputError(f"{what}:{i + 1} is not a JSON object")
        yield i + 1, obj
