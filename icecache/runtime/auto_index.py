"""This machine's crossover for ``index="auto"``, measured once per shape and kept in the cache directory.

The measurement itself is `icecache.indexes.auto.measure_crossover`; this module stores its result in
``$ICECACHE_CACHE/auto_index.json`` (default ``~/.cache/icecache``), one entry per (head width, GQA group,
budget, page size, select threads, torch version, select code version), and measures on first use with a one-line note on stderr (about 10-30 s).
Delete the file to measure again, or fix the number with ``index_params={"crossover": N}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from icecache.indexes.auto import measure_crossover

FILENAME = "auto_index.json"
#: Bumped when a pager's select code or the measurement changes (2: the exact scorer became one compiled call;
#: 3: selects timed from cold caches; 4: the exact scorer finds its k-th score from a sampled threshold; 5: each
#: pager's one-token insert is timed with its select, the two pagers alternating; 6: the exact scan runs on
#: ``select_threads`` threads; 7: the choices are M-DCI's pages scored exhaustively vs its tree search), so a
#: stored crossover measured on older code is measured again.
SELECT_CODE = 7


def crossover_path() -> Path:
    from icecache.runtime.models import cache_root

    return cache_root() / FILENAME


def shape_key(head_dim: int, group: int, budget: int, page_size: int, select_threads: int = 1) -> str:
    return (f"head_dim={head_dim},group={group},budget={budget},page_size={page_size},select_threads={select_threads},"
            f"torch={torch.__version__},select_code={SELECT_CODE}")


def read_entries(path: Path) -> dict[str, Any]:
    """The stored measurements (an unreadable file counts as none: it is measured again and rewritten)."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def machine_crossover(head_dim: int, group: int, budget: int, page_size: int, *, select_threads: int = 1) -> int:
    """Keys per head above which M-DCI's tree search selects faster than scoring every key on this machine, for this shape and
    the threads a select may use (`SemanticPager`'s ``select_threads``): read from the stored measurements, else
    measured now and stored (atomically)."""
    path = crossover_path()
    key = shape_key(head_dim, group, budget, page_size, select_threads)
    entry = read_entries(path).get(key)
    if isinstance(entry, dict) and isinstance(entry.get("crossover_keys"), int):
        return entry["crossover_keys"]
    print(f"icecache: index='auto' measures M-DCI's select by scan vs by tree search on this machine once ({key}); "
          f"stored in {path}", file=sys.stderr, flush=True)
    entry = measure_crossover(head_dim, group, budget, page_size, select_threads=select_threads)
    entries = read_entries(path)
    entries[key] = entry
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=FILENAME, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(tmp, path)
    print(f"icecache: index='auto' crossover {entry['crossover_keys']:,} keys per head "
          f"(measured in {entry['seconds']} s)", file=sys.stderr, flush=True)
    return entry["crossover_keys"]
