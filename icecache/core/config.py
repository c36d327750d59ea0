"""`IceCacheConfig`: the knobs every method shares (see docs/method.md, Definitions)."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icecache.core.errors import ConfigError

# Inclusive ranges of the integer fields; one table so messages and checks cannot drift apart.
_INT_RANGES: dict[str, tuple[int, int]] = {
    "budget": (0, 1 << 24),
    "page_size": (1, 4096),
    "sink": (0, 1 << 16),
    "window": (1, 1 << 20),
    "reuse_every": (1, 1024),
    "insert_every": (1, 4096),
    "threads": (0, 1024),
    "seed": (0, 2**63 - 1),
}

#: where decode inserts run (`IceCacheConfig.inserts`)
INSERT_MODES: tuple[str, ...] = ("auto", "background", "inline")


def inserts_in_background(mode: str, accelerator: bool, free_cores: int) -> bool:
    """Whether decode inserts run on a worker thread (the one rule the runtime and the simulator share):
    ``mode`` ``"background"`` / ``"inline"`` as given; ``"auto"``: background when the KV cache is on an
    ``accelerator``, or when the model's intra-op threads leave ``free_cores`` > 0 CPU cores free."""
    if mode not in INSERT_MODES:
        raise ValueError(f"unknown insert mode {mode!r} (one of {', '.join(INSERT_MODES)})")
    if mode != "auto":
        return mode == "background"
    return accelerator or free_cores > 0


#: glibc heap policies (`IceCacheConfig.heap_policy`)
HEAP_POLICIES: tuple[str, ...] = ("trim", "pin", "none")


def _flag(flag: str, parse: Any, help: str, choices: tuple[str, ...] | None = None) -> dict[str, Any]:
    """A field's command-line metadata: its flag, the parser of the flag's text, one line of help, choices."""
    return {"flag": flag, "parse": parse, "help": help, "choices": choices}


def cli_fields() -> list[dataclasses.Field]:
    """The `IceCacheConfig` fields the command line sets (those with a flag), in declaration order."""
    return [f for f in dataclasses.fields(IceCacheConfig) if "flag" in f.metadata]


@dataclass
class IceCacheConfig:
    """Configuration of one IceCache run.

    Parameters
    ----------
    budget : int
        The most *middle* tokens attended per (layer, KV head) per decode step, after the GQA union.
        Selection is in whole pages, in rank order, stopping before the budget would be exceeded.
    page_size : int
        Capacity P of one physical page, in tokens (1 <= tokens in a page <= P).
    sink : int
        Number of first tokens of each sequence that always stay on the device.
    window : int
        Number of most recent tokens that always stay on the device (includes the current token).
    index : str
        Pager backend name, as registered in `icecache.indexes` (``"mdci"``, ``"sequential"``, ...; a spec
        ``"mdci[search=exhaustive]"`` is split into the name and ``index_params``), or
        ``"auto"``: M-DCI with every key scored (``mdci[search=exhaustive]``) when a head holds fewer offloaded
        keys than this machine's measured crossover, M-DCI's tree search otherwise (`icecache.indexes.auto`;
        ``index_params={"crossover": N}`` fixes it).
    index_params : dict
        Extra keyword arguments for the pager backend (for example ``{"field_of_view": 30}``).
    dense_layers : tuple of int
        Layers that keep full attention (the paper excludes the first two). Memory reports count them.
    reuse_every : int
        IceCache(r): a selection computed at one layer is reused by the next ``reuse_every - 1`` layers.
        1 (the default) selects at every layer.
    threads : int
        CPU threads for index build/query; 0 means ``os.cpu_count()``.
    seed : int
        Seed of every random choice (index directions, levels); results do not depend on ``threads``.
    trace : bool
        Record a per-step selection trace (for the simulator).
    gqa : {"union", "per-head"}
        How a GQA group shares its KV head's budget: ``"union"`` (IceCache) ranks pages once for the whole
        group (a token's score is its best q.k over the group's query heads); ``"per-head"`` lets every
        query head select ``budget // group`` tokens on its own and attends the union.
    inserts : {"auto", "background", "inline"}
        Where a decode step inserts the token leaving the window into its layer's pager and host store:
        ``"background"`` on a worker thread while the next layers compute, ``"inline"`` on the decode thread,
        ``"auto"`` (default) background when the KV cache is on an accelerator (the decode thread mostly waits for
        it) or when torch's intra-op threads leave a CPU core free, inline otherwise. On a CPU whose cores all
        run the model's ops, a worker takes a core from them: inline was 5-13 ms per step faster on 2 cores
        (``experiments/bench_runtime/README.md``, question 4). ``stats()["inserts"]`` says which ran.
    insert_every : int
        Tokens leave the window for the host pages this many at a time (default 1: one per decode step). The
        window then holds ``window`` to ``window + insert_every - 1`` tokens (that many more device slots), each
        flush inserts the group head by head while that head's index is in the CPU caches, and the layers flush
        at staggered steps (`icecache.runtime.placement`).
    top_p : float or None
        Adaptive budget (off by default): of the pages a step selects within ``budget``, keep only the
        best-ranked ones whose estimated attention mass reaches this share (0 < top_p <= 1) of theirs
        (`icecache.core.top_p`). ``stats()["tokens_per_selection"]`` reports the tokens attended.
    heap_policy : {"trim", "pin", "none"}
        Against glibc heap growth over long generations (``experiments/reliability.md``): ``"trim"`` (default)
        returns free heap memory to the system every 256 decode steps (``malloc_trim``; negligible cost, bounds
        most of the growth); ``"pin"`` fixes glibc's mmap threshold for the whole process (no growth measured,
        but index builds ~40% and TPOT ~3% slower); ``"none"`` leaves the allocator alone. No-op without glibc.
    """

    # ``metadata["help"]``: the one-line help of the command line's flag (``metadata["flag"]``), which the CLI
    # generates from these fields (`icecache.cli.ICE_OPTIONS`); a field without it has no flag.
    budget: int = field(default=256, metadata=_flag("--budget", int, "middle tokens attended per layer and KV head"))
    page_size: int = field(default=16, metadata=_flag("--page-size", int, "tokens per page"))
    sink: int = field(default=4, metadata=_flag("--sink", int, "first tokens always on the device"))
    window: int = field(default=64, metadata=_flag("--window", int, "recent tokens always on the device"))
    index: str = field(default="mdci", metadata=_flag(
        "--index", str, "pager backend or spec (icecache info lists them), or auto: mdci scoring every key below this "
                        "machine's crossover, mdci's tree search above"))
    index_params: dict[str, Any] = field(default_factory=dict, metadata=_flag(
        "--index-params", str, "parameters of the --index pager, e.g. field_of_view=120,page_score=mass"))
    dense_layers: tuple[int, ...] = field(default=(0, 1), metadata=_flag(
        "--dense-layers", str, "comma-separated layers that keep full KV ('' for none)"))
    reuse_every: int = field(default=1, metadata=_flag("--reuse-every", int, "IceCache(r): reuse a selection for r layers"))
    threads: int = field(default=0, metadata=_flag("--threads", int, "CPU threads for index work (0: all)"))
    seed: int = field(default=0, metadata=_flag("--seed", int, "random seed of the pagers"))
    trace: bool = False
    gqa: str = "union"
    heap_policy: str = field(default="trim", metadata=_flag(
        "--heap-policy", str, "glibc heap growth over long runs: trim, pin or none", HEAP_POLICIES))
    inserts: str = field(default="auto", metadata=_flag(
        "--inserts", str, "where decode inserts run: background (a worker thread), inline (the decode thread) or auto",
        INSERT_MODES))
    insert_every: int = field(default=1, metadata=_flag(
        "--insert-every", int, "tokens that leave the window together (the window holds up to window + this - 1)"))
    top_p: float | None = field(default=None, metadata=_flag(
        "--top-p", float, "adaptive budget: keep the ranked pages whose estimated attention mass reaches this share (0-1]"))

    def __post_init__(self) -> None:
        for name, (lo, hi) in _INT_RANGES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"IceCacheConfig.{name} must be an int in [{lo}, {hi}], got {value!r}")
            if not lo <= value <= hi:
                raise ConfigError(f"IceCacheConfig.{name} must be in [{lo}, {hi}], got {value}")
        if not isinstance(self.index, str) or not self.index:
            raise ConfigError(f"IceCacheConfig.index must be a pager name, got {self.index!r}")
        # Whether ``index`` names a registered pager (and ``index_params`` its parameters) is checked where
        # pagers are made (`icecache.indexes.make_pager`, `IceCache(...)`): core does not know the registry.
        if not isinstance(self.index_params, dict):
            raise ConfigError(f"IceCacheConfig.index_params must be a dict, got {type(self.index_params).__name__}")
        from icecache.core.spec import parse_spec

        name, params = parse_spec(self.index)  # a name, or a spec such as stats()["index"] reports ("0": refused here)
        if "[" in self.index:  # the spec's parameters join index_params
            clash = sorted(k for k in params if k in self.index_params and self.index_params[k] != params[k])
            if clash:
                raise ConfigError(f"IceCacheConfig: index {self.index!r} and index_params disagree on {', '.join(clash)}")
            self.index, self.index_params = name, {**params, **self.index_params}
        if not isinstance(self.dense_layers, (tuple, list, set, frozenset, range)) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in self.dense_layers
        ):
            raise ConfigError(f"IceCacheConfig.dense_layers must be a tuple of layer indices >= 0, got {self.dense_layers!r}")
        self.dense_layers = tuple(sorted(set(self.dense_layers)))
        if any(i < 0 for i in self.dense_layers):
            raise ConfigError(f"IceCacheConfig.dense_layers must be a tuple of layer indices >= 0, got {self.dense_layers!r}")
        if not isinstance(self.trace, bool):
            raise ConfigError(f"IceCacheConfig.trace must be a bool, got {self.trace!r}")
        if self.gqa not in ("union", "per-head"):
            raise ConfigError(f"IceCacheConfig.gqa must be 'union' or 'per-head', got {self.gqa!r}")
        if self.inserts not in INSERT_MODES:
            raise ConfigError(f"IceCacheConfig.inserts must be one of {', '.join(map(repr, INSERT_MODES))}, got {self.inserts!r}")
        if self.top_p is not None and (isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float))
                                       or not 0 < self.top_p <= 1):
            raise ConfigError(f"IceCacheConfig.top_p must be None or a number in (0, 1], got {self.top_p!r}")
        if self.heap_policy not in HEAP_POLICIES:
            raise ConfigError(f"IceCacheConfig.heap_policy must be 'trim', 'pin' or 'none', got {self.heap_policy!r}")

    @property
    def num_threads(self) -> int:
        """Resolved thread count (``threads``, or every CPU when 0)."""
        return self.threads or (os.cpu_count() or 1)

    def replace(self, **changes: Any) -> IceCacheConfig:
        """A validated copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def cache_root() -> Path:
    """Directory of icecache's caches (converted models, this machine's measurements): ``$ICECACHE_CACHE`` or
    ``~/.cache/icecache``."""
    return Path(os.environ.get("ICECACHE_CACHE") or Path.home() / ".cache" / "icecache")
