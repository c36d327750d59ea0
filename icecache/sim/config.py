"""What to simulate: `SimConfig` (one configuration), the variants and implementations, and layer roles.

`SimConfig` takes `icecache.core.config.IceCacheConfig`'s names, meanings and defaults (read from its fields,
`SHARED_FIELDS`) where both describe the same thing: ``budget``, ``page_size``, ``sink``, ``window``,
``dense_layers``, ``reuse_every``, ``inserts``, ``trace`` and ``index`` (the pager; None here means the
variant's own, `DEFAULT_PAGER`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any

from icecache.core.config import INSERT_MODES, IceCacheConfig
from icecache.core.errors import ConfigError, UnknownNameError
from icecache.sim.costs import SCATTER_OPS
from icecache.sim.hardware import canonical_hardware
from icecache.sim.shapes import ModelShape, get_shape

__all__ = ["VARIANTS", "IMPLS", "DEFAULT_PAGER", "SHARED_FIELDS", "SimConfig", "check_dense_layers", "layer_roles"]

#: the fields `SimConfig` shares with `IceCacheConfig`, with the same names and defaults
SHARED_FIELDS: tuple[str, ...] = ("budget", "page_size", "sink", "window", "dense_layers", "reuse_every", "inserts", "trace")
_ICE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(IceCacheConfig) if f.name in SHARED_FIELDS}

VARIANTS: tuple[str, ...] = ("full", "icecache", "icecache-r", "quest")
IMPLS: tuple[str, ...] = ("runtime", "paper")
DEFAULT_PAGER: dict[str, str | None] = {"full": None, "icecache": "mdci", "icecache-r": "mdci", "quest": "sequential"}


@dataclass(frozen=True)
class SimConfig:
    """One configuration to simulate.

    Parameters
    ----------
    model : str
        Model shape name (`icecache.sim.shapes`).
    hardware : str
        Hardware profile name (`icecache.sim.hardware`).
    variant : str
        One of `VARIANTS`.
    context : int
        Prompt tokens.
    budget, page_size, sink, window : int
        As `IceCacheConfig`'s (tokens; its defaults).
    threads : int
        CPU threads of the worker pool (index builds, prefetched inserts; index queries with ``impl="paper"``).
    dense_layers : tuple of int
        Layers that keep full attention on the device, as `IceCacheConfig.dense_layers` (default ``(0, 1)``; a
        sliding layer stays a sliding layer). Stored sorted and without repeats.
    reuse_every : int
        ``icecache-r``: sparse layers sharing one selection (the selecting layer included), >= 1, as
        `IceCacheConfig.reuse_every` (default 1; other variants select at every sparse layer).
    impl : str
        ``"runtime"`` (our runtime) or ``"paper"`` (the paper's implementation); see the module docstring.
    index : str or None
        Pager whose measured costs stand for the index, as `IceCacheConfig.index` (None: `DEFAULT_PAGER` of the
        variant).
    new_tokens : int
        Generated tokens; TPOT is taken at the mean decode context ``context + new_tokens / 2``.
    kv_dtype_bytes : int
        Bytes per KV element; 0 takes the hardware's default.
    gather_calls : int
        ``index_select`` calls per sparse layer and step; 0 (default): one per KV head with new tokens, as the
        runtime's `BulkLoader` does (one per (batch row, KV head) into one staging buffer).
    copy_calls : int
        Host-to-device copies per sparse layer and step (the runtime: one, of the whole staging buffer).
    scatter_calls : int
        Scatter operations per sparse layer and step (the runtime: `SCATTER_OPS`, index_copy_ of K and V plus
        the validity-mask write; the mask is written even when nothing was copied).
    inserts : str
        Where the runtime's decode inserts run, as `IceCacheConfig.inserts`: ``"background"`` (a worker thread;
        the layer waits for it one step later), ``"inline"`` (on the decode thread, when the layer is reached),
        or ``"auto"`` (default): decided per machine as the runtime decides (`CostModel.background_inserts`).
        ``impl="paper"`` ignores it.
    trace : bool
        The runtime records a selection trace (``IceCacheConfig(trace=True)``), which costs untimed host work
        per sparse layer (measured as ``overhead_traced``).
    """

    model: str
    hardware: str
    variant: str
    context: int
    budget: int = _ICE_DEFAULTS["budget"]
    page_size: int = _ICE_DEFAULTS["page_size"]
    threads: int = 8
    sink: int = _ICE_DEFAULTS["sink"]
    window: int = _ICE_DEFAULTS["window"]
    dense_layers: tuple[int, ...] = _ICE_DEFAULTS["dense_layers"]
    reuse_every: int = _ICE_DEFAULTS["reuse_every"]
    impl: str = "runtime"
    index: str | None = None
    new_tokens: int = 32
    kv_dtype_bytes: int = 0
    gather_calls: int = 0
    copy_calls: int = 1
    scatter_calls: int = SCATTER_OPS
    inserts: str = _ICE_DEFAULTS["inserts"]
    trace: bool = _ICE_DEFAULTS["trace"]

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise UnknownNameError(f"unknown variant {self.variant!r}; known: {', '.join(VARIANTS)}")
        if self.impl not in IMPLS:
            raise UnknownNameError(f"unknown implementation {self.impl!r}; known: {', '.join(IMPLS)}")
        if self.inserts not in INSERT_MODES:
            raise ConfigError(f"SimConfig.inserts must be one of {', '.join(map(repr, INSERT_MODES))}, got {self.inserts!r}")
        shape = get_shape(self.model)
        object.__setattr__(self, "model", shape.name)  # canonical names (aliases accepted)
        object.__setattr__(self, "hardware", canonical_hardware(self.hardware))
        ints = dict(
            context=(self.context, 1), budget=(self.budget, 0), page_size=(self.page_size, 1), threads=(self.threads, 1),
            sink=(self.sink, 0), window=(self.window, 1), reuse_every=(self.reuse_every, 1),
            new_tokens=(self.new_tokens, 1), kv_dtype_bytes=(self.kv_dtype_bytes, 0), gather_calls=(self.gather_calls, 0),
            copy_calls=(self.copy_calls, 0), scatter_calls=(self.scatter_calls, 0),
        )
        for name, (v, lo) in ints.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"SimConfig.{name} must be an int >= {lo}, got {v!r}")
        if self.budget > self.context:
            raise ConfigError(f"SimConfig.budget ({self.budget}) must not exceed the context ({self.context} tokens)")
        object.__setattr__(self, "dense_layers", check_dense_layers(self.dense_layers, shape))

    @property
    def pager_name(self) -> str | None:
        return self.index if self.index is not None else DEFAULT_PAGER[self.variant]

    @property
    def decode_context(self) -> int:
        """Mean context over the decode steps TPOT averages."""
        return self.context + self.new_tokens // 2

    def replace(self, **changes: Any) -> SimConfig:
        return replace(self, **changes)


def check_dense_layers(dense_layers: Any, shape: ModelShape) -> tuple[int, ...]:
    """``dense_layers`` as a sorted tuple of distinct layer indices of ``shape``; `ConfigError` otherwise (a
    count, as older versions took, is refused: layer k is not the first k layers)."""
    if not isinstance(dense_layers, (tuple, list, set, frozenset, range)) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in dense_layers
    ):
        raise ConfigError(f"SimConfig.dense_layers must be a tuple of layer indices like IceCacheConfig.dense_layers "
                          f"(the first k layers: tuple(range(k))), got {dense_layers!r}")
    out = tuple(sorted(set(dense_layers)))
    if any(not 0 <= i < shape.layers for i in out):
        raise ConfigError(f"SimConfig.dense_layers must be layer indices in [0, {shape.layers - 1}] for {shape.name}, "
                          f"got {tuple(dense_layers)!r}")
    return out


def layer_roles(shape: ModelShape, variant: str, dense_layers: tuple[int, ...]) -> tuple[str, ...]:
    """Per layer: ``"sliding"`` (window KV through the model's cache), ``"dense"`` (full KV) or ``"sparse"``
    (IceCache), as the runtime's `IceCache` (``runtime/cache.py``) assigns them (sliding first, then ``dense_layers``)."""
    out = []
    for layer in range(shape.layers):
        if shape.is_sliding(layer):
            out.append("sliding")
        elif variant == "full" or layer in dense_layers:
            out.append("dense")
        else:
            out.append("sparse")
    return tuple(out)
