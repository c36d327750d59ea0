"""`PagerChoice`: the pager every sparse layer of one `IceCache` uses, resolved once.

``IceCacheConfig.index`` names a registered pager (with ``index_params``), or ``"auto"``: M-DCI's pages ranked by
scoring every key below this machine's crossover number of offloaded keys per head, by M-DCI's tree search at or
above it (`icecache.indexes.auto`). The cache checks the config when it is built (`check_pager_config`: an
unknown pager or parameter fails before any prefill) and resolves the choice at its first update
(`resolve_pager`), when the context is known; `PagerChoice.make` then makes every layer's pagers and
`PagerChoice.spec` is what ``stats()["index"]`` reports: a name `make_pager` and ``IceCacheConfig.index`` take
back.

This machine's crossover is measured once per shape and kept in ``$ICECACHE_CACHE/auto_index.json`` (default
``~/.cache/icecache``), one entry per (head width, GQA group, budget, page size, select threads, torch version,
select code version); measuring takes about 10-30 s, with a one-line note on stderr. Delete the file to measure
again, or fix the number with ``index_params={"crossover": N}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from icecache.core.config import IceCacheConfig, cache_root
from icecache.core.pager import SemanticPager
from icecache.core.spec import format_spec, parse_spec
from icecache.indexes.auto import AUTO, check_auto_params, choose_index, measure_crossover
from icecache.indexes.registry import make_pager

FILENAME = "auto_index.json"
#: Bumped when a pager's select code or the measurement changes (2: the exact scorer became one compiled call;
#: 3: selects timed from cold caches; 4: the exact scorer finds its k-th score from a sampled threshold; 5: each
#: pager's one-token insert is timed with its select, the two pagers alternating; 6: the exact scan runs on
#: ``select_threads`` threads; 7: the choices are M-DCI's pages scored exhaustively vs its tree search), so a
#: stored crossover measured on older code is measured again.
SELECT_CODE = 7


@dataclass(frozen=True)
class PagerChoice:
    """A registered pager with its parameters, as every sparse layer of one cache makes it.

    ``crossover``: with ``index="auto"``, the keys per head from which the tree search was chosen (None
    otherwise)."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    page_size: int = 16
    seed: int = 0
    crossover: int | None = None

    @property
    def spec(self) -> str:
        """``name[key=value;...]`` (`icecache.core.spec.format_spec`): what ``stats()["index"]`` reports."""
        return format_spec(self.name, self.params)

    def make(self, layer_idx: int, row: int, kv_head: int, head_dim: int) -> SemanticPager:
        """One (layer, row, KV head)'s pager (a `PagerFactory`), recording its page moves for the host store."""
        return make_pager(self.name, head_dim=head_dim, page_size=self.page_size, seed=self.seed, record_moves=True,
                          **self.params)


def check_pager_config(config: IceCacheConfig, head_dim: int) -> None:
    """Raise `ConfigError` (one line) unless ``config.index`` is ``"auto"`` with its parameters, or a registered
    pager that takes ``config.index_params`` (checked by making one, as the layers will)."""
    if config.index == AUTO:
        check_auto_params(config.index_params)
    else:
        PagerChoice(config.index, dict(config.index_params), config.page_size, config.seed).make(0, 0, 0, head_dim)


def resolve_pager(config: IceCacheConfig, *, head_dim: int, group: int, context_tokens: int, select_threads: int) -> PagerChoice:
    """The pager of every sparse layer: ``config.index`` with its parameters, or with ``"auto"`` the choice for a
    head holding ``context_tokens - sink - window`` offloaded keys (``context_tokens``: the prompt, or
    ``max_cache_len``) against the configured or this machine's crossover."""
    if config.index != AUTO:
        return PagerChoice(config.index, dict(config.index_params), config.page_size, config.seed)
    crossover = check_auto_params(config.index_params)
    if crossover is None:
        crossover = machine_crossover(head_dim, group, config.budget, config.page_size, select_threads=select_threads)
    pager, params = parse_spec(choose_index(max(0, context_tokens - config.sink - config.window), crossover))
    return PagerChoice(pager, params, config.page_size, config.seed, crossover=crossover)


def crossover_path() -> Path:
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
    """Keys per head above which M-DCI's tree search selects faster than scoring every key on this machine, for this
    shape and the threads a select may use (`SemanticPager`'s ``select_threads``): read from the stored
    measurements, else measured now and stored (atomically)."""
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
