"""The methods we compare, behind one interface, all at the same budget, sink and window (docs/method.md, Definitions).

    full        dense attention over the whole cache (a plain DynamicCache)
    exact       oracle: the top-B middle tokens by q.k (max over the GQA group), every step
    icecache    semantic pages from the configured pager (``IceCacheConfig.index``, M-DCI by default, with
                its ``index_params``; ``icecache:<pager>`` names another registered pager explicitly)
    icecache-r  IceCache(r): the same pager, one selection reused by ``reuse_every`` consecutive layers
                (``IceCacheConfig.reuse_every``; 2 when the config leaves it at 1)
    quest       token-order pages of P tokens ranked by Quest's min/max bound, every step
    streaming   StreamingLLM: sink + the most recent W + B tokens (the same device KV as the others)
    snapkv      SnapKV: prefill-time eviction; the observation window's pooled attention keeps B middle
                tokens for good, later tokens leaving the window are evicted (options ``window_size``, the
                observation window in tokens, at most the prefill's captured queries, and ``kernel_size``,
                the pooling width; kvpress's names)
    pqcache     PQCache: product-quantised keys, top-B tokens by approximate attention, every step

Every method except ``full`` runs through `IceCache`, so the device holds the same sink + window + budget
slots; they differ only in which middle tokens fill the budget slots.

A *variant* changes a method's settings for its rows only: ``name[key=value;...]``, e.g.
``icecache[page_size=4;field_of_view=200]`` or ``quest[page_size=4]``. Keys are `IceCacheConfig` fields (not
``budget`` or ``index``) or parameters of the method's pager (merged into ``index_params``), so one run can
compare configurations side by side from one prefill per sample. A method's own options (SnapKV's
``window_size`` and ``kernel_size``) are set the same way: ``snapkv[window_size=16]``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError, UnknownNameError
from icecache.core.pager import SemanticPager
from icecache.core.spec import parse_spec
from icecache.eval.harness import Prefill, growing_kv
from icecache.indexes.registry import available_pagers
from icecache.runtime.cache import IceCache


class FixedScorePager(SemanticPager):
    """Single-token pages ranked by scores fixed at construction (prefill-time eviction policies).

    ``scores`` ``[n]`` rank the ``n`` keys given to `build`; positions inserted later score -inf (evicted:
    never selected), as in a one-shot eviction method that keeps its prefill choice.
    """

    semantic = False

    def __init__(self, head_dim: int, scores: np.ndarray, *, record_moves: bool = True) -> None:
        super().__init__(head_dim, page_size=1, seed=0, record_moves=record_moves)
        self._scores = np.asarray(scores, dtype=np.float64)

    def _table_page_size(self) -> int:
        return 1

    def _build(self, keys: torch.Tensor) -> None:
        if keys.shape[0] != len(self._scores):
            raise ValueError(f"FixedScorePager got {keys.shape[0]} keys for {len(self._scores)} scores")
        self.table.new_pages(np.arange(keys.shape[0]).reshape(-1, 1))
        finite = np.flatnonzero(self._scores > -np.inf)  # -inf: evicted
        #: every key that can be selected, best first (ties by position); inserts score -inf and never join it,
        #: so the ranking is the same at every step and is sorted once
        self._ranking = finite[np.lexsort((finite, -self._scores[finite]))]

    def _insert(self, keys: torch.Tensor, start: int) -> None:
        self._scores = np.concatenate([self._scores, np.full(keys.shape[0], -np.inf)])
        self.table.new_pages(np.arange(start, start + keys.shape[0]).reshape(-1, 1))

    def _rank_pages(self, queries: torch.Tensor, budget: int) -> tuple[np.ndarray, np.ndarray]:
        order = self._ranking[:budget]
        return np.asarray(self.table.page_of(order)), self._scores[order]


def snapkv_scores(prefill: Prefill, layer_idx: int, kv_head: int, n_rep: int, kernel: int = 5,
                  window: int | None = None) -> np.ndarray:
    """SnapKV importance of the prompt positions before the observation window, ``[T - w]``.

    The window's queries (the last ``window`` captured ones; None: all of them) attend (causally) to the whole
    prompt; each prefix position's attention is averaged over the window, average-pooled with ``kernel`` so that
    neighbours of important tokens survive, and averaged over the GQA group (as kvpress's `SnapKVPress` does;
    Li et al., 2024, arXiv 2404.14469).
    """
    captured = prefill.obs_queries[layer_idx]  # [Hq, w_captured, D]; `_snapkv` checks w <= w_captured
    q = captured[kv_head * n_rep : (kv_head + 1) * n_rep, -(window or captured.shape[1]) :].float()  # [n_rep, w, D]
    K = prefill.kv.layers[layer_idx].keys[0, kv_head].float()  # [T, D]
    T, w = K.shape[0], q.shape[1]
    logits = q @ K.T / math.sqrt(K.shape[-1])  # [n_rep, w, T]
    qpos = torch.arange(T - w, T)[:, None]
    logits = logits.masked_fill(torch.arange(T)[None, :] > qpos, float("-inf"))
    attn = torch.softmax(logits, dim=-1)[..., : T - w].mean(1)  # [n_rep, T - w]
    pooled = torch.nn.functional.avg_pool1d(attn[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return pooled.mean(0).double().numpy()


@dataclass(frozen=True)
class Method:
    """A named way of filling the budget slots. ``pager(config)`` names the pager it runs under ``config``
    (None: no pager takes parameters, e.g. ``full``)."""

    name: str
    make: Callable[[Any, Prefill, IceCacheConfig], Any]
    uses_budget: bool = True
    pager: Callable[[IceCacheConfig], str | None] = lambda cfg: None
    #: the method's own options (not config fields, not pager parameters) and how to make it with them
    options: tuple[str, ...] = ()
    with_options: Callable[..., Method] | None = None

    def cache(self, model: Any, prefill: Prefill, config: IceCacheConfig) -> Any:
        return self.make(model, prefill, config)

    def check(self, config: IceCacheConfig) -> None:
        """Raise `ConfigError` (one line) when this method cannot run under ``config`` (a variant's settings)."""


def for_pager(cfg: IceCacheConfig, index: str, **changes: Any) -> IceCacheConfig:
    """``cfg`` switched to pager ``index``; ``cfg.index_params`` belong to ``cfg.index`` and are dropped for any
    other pager (``--index-params field_of_view=120`` tunes ``icecache``, not ``quest``'s pager)."""
    return cfg.replace(index=index, **({} if index == cfg.index else {"index_params": {}}), **changes)


def _ice(index: str | None, **changes: Any) -> Callable[[Any, Prefill, IceCacheConfig], Any]:
    """A method running `IceCache` with pager ``index`` (None: the config's own ``index``)."""

    def make(model: Any, prefill: Prefill, cfg: IceCacheConfig) -> IceCache:
        return IceCache.from_dense(prefill.kv, for_pager(cfg, index or cfg.index, **changes), model_config=model.config)

    return make


def _ice_reuse(model: Any, prefill: Prefill, cfg: IceCacheConfig) -> IceCache:
    reuse = cfg.reuse_every if cfg.reuse_every > 1 else 2
    return IceCache.from_dense(prefill.kv, cfg.replace(reuse_every=reuse), model_config=model.config)


def _full(model: Any, prefill: Prefill, cfg: IceCacheConfig) -> Any:
    return growing_kv(prefill.kv)


def _streaming(model: Any, prefill: Prefill, cfg: IceCacheConfig) -> IceCache:
    c = for_pager(cfg, "sequential", window=cfg.window + cfg.budget, budget=0, top_p=None)  # nothing to select
    return IceCache.from_dense(prefill.kv, c, model_config=model.config)


def _snapkv(window_size: int | None = None, kernel_size: int = 5) -> Callable[[Any, Prefill, IceCacheConfig], Any]:
    """SnapKV with an observation window of ``window_size`` queries (None: every captured one, the cache
    window) and pooling width ``kernel_size``."""
    for name, value in (("window_size", window_size), ("kernel_size", kernel_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ConfigError(f"snapkv: {name} must be an int >= 1, got {value!r}")
    if kernel_size % 2 == 0:
        raise ConfigError(f"snapkv: kernel_size must be odd (the pooling is centred), got {kernel_size}")

    def make(model: Any, prefill: Prefill, cfg: IceCacheConfig) -> IceCache:
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        n_rep = text.num_attention_heads // text.num_key_value_heads
        T = prefill.num_tokens
        lo, hi = cfg.sink, max(cfg.sink, T - cfg.window)  # the prompt's middle positions
        captured = min((q.shape[1] for q in prefill.obs_queries.values()), default=0)
        if window_size is not None and window_size > captured:
            raise ConfigError(f"snapkv: window_size={window_size} exceeds the {captured} observation queries the "
                              "prefill captured (the cache window)")

        def factory(layer_idx: int, row: int, kv_head: int, head_dim: int) -> SemanticPager:
            scores = snapkv_scores(prefill, layer_idx, kv_head, n_rep, kernel_size, window_size)  # positions [0, T - w)
            mid = np.full(hi - lo, np.inf)  # the observation window is always kept (as in SnapKV)
            n = min(len(scores), hi) - lo
            mid[: max(n, 0)] = scores[lo : lo + max(n, 0)]
            return FixedScorePager(head_dim, mid)

        # top_p: SnapKV's fixed scores are not q.k, so a mass estimate from them would mean nothing
        return IceCache.from_dense(prefill.kv, for_pager(cfg, "exact", top_p=None), model_config=model.config,
                                   pager_factory=factory)

    return make


def _snapkv_method(name: str = "snapkv", **options: Any) -> Method:
    return Method(name, _snapkv(**options), options=("window_size", "kernel_size"), with_options=_snapkv_method)


def _own(cfg: IceCacheConfig) -> str:
    return cfg.index


def _fixed(pager: str) -> Callable[[IceCacheConfig], str]:
    return lambda cfg: pager


#: `IceCacheConfig` fields a variant may not set: the run's budgets and the method's pager decide them
VARIANT_LOCKED = ("budget", "index", "index_params")


@dataclass(frozen=True)
class VariantMethod(Method):
    """``base[key=value;...]``: ``base``'s method with some settings changed (see the module docstring)."""

    base: Method | None = None
    fields: dict[str, Any] = dataclasses.field(default_factory=dict)
    params: dict[str, Any] = dataclasses.field(default_factory=dict)

    def configure(self, config: IceCacheConfig) -> IceCacheConfig:
        """``config`` with this variant's fields and pager parameters (on top of the config's own parameters when
        the method runs the config's pager; alone otherwise)."""
        assert self.base is not None
        cfg = config.replace(**self.fields)
        if self.params:
            pager = self.base.pager(cfg)
            own = cfg.index_params if pager == cfg.index else {}
            cfg = cfg.replace(index=pager, index_params={**own, **self.params})
        return cfg

    def check(self, config: IceCacheConfig) -> None:
        assert self.base is not None
        if self.params and self.base.pager(config) is None:
            own = f"; its options: {', '.join(self.base.options)}" if self.base.options else ""
            raise ConfigError(f"method {self.name!r}: {self.base.name} runs no pager, so it takes no pager parameters "
                              f"({', '.join(self.params)}){own}")
        try:
            cfg = self.configure(config)  # IceCacheConfig validates the fields
        except ConfigError as err:
            raise ConfigError(f"method {self.name!r}: {err}") from None
        if self.params:
            from icecache.runtime.pager_choice import check_pager_config

            try:
                check_pager_config(cfg, head_dim=8)
            except ConfigError as err:
                raise ConfigError(f"method {self.name!r}: {err}") from None


def _variant(name: str, base: Method, settings: dict[str, Any]) -> VariantMethod:
    config_fields = {f.name for f in dataclasses.fields(IceCacheConfig)}
    locked = [k for k in settings if k in VARIANT_LOCKED]
    if locked:
        raise ConfigError(f"method {name!r}: a variant cannot set {', '.join(locked)} (budgets come from --budgets, "
                          "the pager from the method: use icecache:<pager>[...])")
    options = {k: v for k, v in settings.items() if k in base.options}
    if options:
        assert base.with_options is not None
        try:
            base = base.with_options(base.name, **options)
        except ConfigError as err:
            raise ConfigError(f"method {name!r}: {err}") from None
    fields = {k: v for k, v in settings.items() if k in config_fields}
    if "dense_layers" in fields and isinstance(fields["dense_layers"], list):
        fields["dense_layers"] = tuple(fields["dense_layers"])
    params = {k: v for k, v in settings.items() if k not in config_fields and k not in options}

    def make(model: Any, prefill: Prefill, cfg: IceCacheConfig) -> Any:
        return base.make(model, prefill, variant.configure(cfg))

    def pager(cfg: IceCacheConfig) -> str | None:
        return base.pager(cfg.replace(**fields))

    variant = VariantMethod(name, make, base.uses_budget, pager, base=base, fields=fields, params=params)
    return variant


def get_method(name: str) -> Method:
    """``full``, ``exact``, ``icecache``, ``icecache-r``, ``quest``, ``streaming``, ``snapkv``, ``pqcache``,
    ``icecache:<pager>`` for any registered pager, or a variant of one of them, ``name[key=value;...]``."""
    fixed: dict[str, Method] = {
        "full": Method("full", _full, uses_budget=False),
        "exact": Method("exact", _ice("exact"), pager=_fixed("exact")),
        "icecache": Method("icecache", _ice(None), pager=_own),
        "icecache-r": Method("icecache-r", _ice_reuse, pager=_own),
        "quest": Method("quest", _ice("sequential"), pager=_fixed("sequential")),
        "streaming": Method("streaming", _streaming),
        "snapkv": _snapkv_method(),
        "pqcache": Method("pqcache", _ice("pq"), pager=_fixed("pq")),
    }
    if "[" in name:
        try:
            base_name, settings = parse_spec(name)
        except ConfigError as err:
            raise ConfigError(f"method {err}") from None
        return _variant(name, get_method(base_name), settings)
    if name in fixed:
        return fixed[name]
    if name.startswith("icecache:"):
        pager = name.split(":", 1)[1]
        if pager not in available_pagers():
            raise UnknownNameError(f"unknown pager {pager!r} in method {name!r}; known pagers: {available_pagers()}")
        return Method(name, _ice(pager), pager=_fixed(pager))
    raise UnknownNameError(f"unknown method {name!r}; known: {sorted(fixed)}, icecache:<pager>, or a variant "
                           "name[key=value;...]")


METHOD_NAMES = ("full", "exact", "icecache", "icecache-r", "quest", "streaming", "snapkv", "pqcache")
