"""`IceCache`: a transformers `Cache` whose sparse layers keep only sink + window + budget KV on the device.

Layer kinds: sparse layers are `IceCacheLayer`s (`layer.py`; token placement in `placement.py`, page
selection and accounting in `selection.py`, loading in `loader.py`). Layers listed in ``dense_layers`` keep
full KV (`GrowingLayer`: a `DynamicLayer` that appends in place); sliding-window layers keep their window
(`DynamicSlidingWindowLayer`). Background offload, index builds and decode-time inserts run on the cache's
`IndexWorkers` (`workers.py`).
"""

from __future__ import annotations

import sys
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Self

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from icecache.core.config import IceCacheConfig
from icecache.core.errors import CacheMisuseError, ConfigError, InputError, InputTypeError
from icecache.indexes.auto import AUTO
from icecache.kernels.library import kernel_status
from icecache.runtime import link
from icecache.runtime.dense_layer import GrowingLayer
from icecache.runtime.layer import IceCacheLayer
from icecache.runtime.layer_context import FAULT_POINTS, FaultHooks, LayerContext, PagerFactory
from icecache.runtime.malloc import pin_mmap_threshold, trim_heap
from icecache.runtime.pager_choice import PagerChoice, check_pager_config, resolve_pager
from icecache.runtime.selection import DecodeAccounting
from icecache.runtime.timing import StageTimer
from icecache.runtime.workers import IndexWorkers, background_inserts

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")

__all__ = ["FAULT_POINTS", "SUPPORTED_MODEL_TYPES", "IceCache", "IceCacheLayer"]


#: ``heap_policy="trim"``: decode steps between two `trim_heap` calls.
TRIM_EVERY = 256


class IceCache(Cache):
    """A `transformers` cache that keeps only sink + window + budget KV per sparse layer on the device.

    Parameters
    ----------
    model_config : transformers.PretrainedConfig
        The model's config (``model.config``); layers are created from it.
    config : IceCacheConfig, optional
        IceCache settings (defaults to ``IceCacheConfig()``). ``window`` and ``sink + budget + window`` must fit
        in the model's context (``max_position_embeddings``).
    pager_factory : callable, optional
        ``(layer_idx, row, kv_head, head_dim) -> pager`` (with ``record_moves=True``); default: the registry's
        ``config.index``.
    max_cache_len : int, optional
        Positions the generation will reach (prompt + new tokens). Device buffers are sized for it at prefill;
        without it they are sized for the prompt and grow (amortised) while decoding. Never changes outputs.

    Use with ``model.set_attn_implementation("icecache")`` (importing this module registers it) and
    ``model.generate(..., past_key_values=cache)``. One cache serves one generation. Close it (or use it as a
    context manager) to stop its worker threads; `stats` reports times, bytes and memory.

    Long generations: ``config.heap_policy`` keeps glibc's heaps from creeping up (`icecache.runtime.malloc`);
    ``"trim"`` (default) trims them every 256 decode steps, ``"pin"`` fixes the mmap threshold process-wide.
    """

    def __init__(self, model_config: Any, config: IceCacheConfig | None = None, *, pager_factory: PagerFactory | None = None,
                 max_cache_len: int | None = None) -> None:
        self.ice = config if config is not None else IceCacheConfig()
        if not isinstance(self.ice, IceCacheConfig):
            raise ConfigError(f"config must be an IceCacheConfig, got {type(self.ice).__name__}")
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ConfigError(f"max_cache_len must be a positive int or None, got {max_cache_len!r}")
        self.length_hint = max_cache_len  # positions the generation is expected to reach (None: unknown)
        text_cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.model_config = text_cfg
        self._check_model(text_cfg)
        self._check_context(text_cfg, self.ice)
        n_layers = text_cfg.num_hidden_layers
        bad = [i for i in self.ice.dense_layers if i >= n_layers]
        if bad:
            raise ConfigError(f"IceCacheConfig.dense_layers must be in [0, {n_layers - 1}] for this model, got {bad}")
        H = text_cfg.num_key_value_heads or text_cfg.num_attention_heads
        D = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        types = list(getattr(text_cfg, "layer_types", None) or ["full_attention"] * n_layers)
        self.group = text_cfg.num_attention_heads // H  # query heads per KV head
        self.kv_head_dim = D
        if pager_factory is None:  # an unknown pager or pager parameter fails here, before any prefill
            check_pager_config(self.ice, D)
        elif self.ice.index == AUTO:
            raise ConfigError("index='auto' chooses the pagers itself: it takes no pager_factory")
        self._pager_factory = pager_factory
        #: the pager the sparse layers use (``stats()["index"]``): ``config.index``, or what ``"auto"`` chooses
        #: at the first update (None until then)
        self.pager_choice: PagerChoice | None = None if self.ice.index == AUTO else resolve_pager(
            self.ice, head_dim=D, group=self.group, context_tokens=0, select_threads=1)
        self._context: LayerContext | None = None
        self.select_threads: int | None = None  # set at the first decode step (`_set_select_threads`)
        if self.ice.heap_policy == "pin":
            pin_mmap_threshold()
        self.workers = IndexWorkers(self.ice.num_threads)
        self.timer = StageTimer()
        self.accounting = DecodeAccounting(trace=self.ice.trace)
        self.faults = FaultHooks()
        layers: list[CacheLayerMixin] = []
        self.kind: list[str] = []
        for i, kind in enumerate(types):
            if kind == "sliding_attention":
                layers.append(DynamicSlidingWindowLayer(text_cfg.sliding_window))
                self.kind.append("sliding")
            elif i in self.ice.dense_layers:
                layers.append(GrowingLayer())
                self.kind.append("dense")
            else:
                layers.append(IceCacheLayer(self.ice, i, H, D))
                self.kind.append("sparse")
        super().__init__(layers=layers)
        sparse = [i for i, k in enumerate(self.kind) if k == "sparse"]
        r = self.ice.reuse_every
        self.reuse_leader = {i: sparse[(j // r) * r] for j, i in enumerate(sparse)}
        self._shared: dict[int, dict[str, Any]] = {}
        self._t_first_update: float | None = None
        self._t_prefill_done: float | None = None
        self.closed = False
        self._finalizer = weakref.finalize(self, IndexWorkers.close, self.workers)

    @property
    def prefetch_inserts(self) -> bool | None:
        """Whether decode steps insert the token that will leave the window next on a worker during this step
        (same result as inline): ``config.inserts`` resolved for the KV's device at the first update (None before).
        Setting it switches the mode for the following steps (a measurement hook: `icecache.measure` times both)."""
        return self.workers.prefetch_inserts

    @prefetch_inserts.setter
    def prefetch_inserts(self, value: bool) -> None:
        self.workers.prefetch_inserts = bool(value)

    @property
    def counters(self) -> dict[str, int]:
        """Cumulative decode counters (`selection.COUNTERS`)."""
        return self.accounting.counters

    @property
    def trace(self) -> list[dict[str, Any]]:
        """With ``IceCacheConfig(trace=True)``: one record per (decode step, layer, row, KV head)."""
        return self.accounting.trace

    def _start(self, tokens: int, device: torch.device) -> None:
        """Fix what the first update decides, once: where decode inserts run (the KV's device), the pager
        (``index="auto"`` chooses from ``tokens``, the prompt, or ``max_cache_len`` when larger), and each sparse
        layer's `LayerContext`."""
        if self.prefetch_inserts is None:
            self.prefetch_inserts = background_inserts(self.ice.inserts, device)
        max_length = max(tokens, self.length_hint or 0)
        if self.pager_choice is None:
            self.pager_choice = resolve_pager(self.ice, head_dim=self.kv_head_dim, group=self.group,
                                              context_tokens=max_length, select_threads=self._select_threads())
        self._context = LayerContext(
            config=self.ice, make_pager=self._pager_factory or self.pager_choice.make, workers=self.workers,
            timer=self.timer, accounting=self.accounting, faults=self.faults, max_length=max_length)
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse":
                layer.start(self._context)

    @classmethod
    def from_dense(cls, dense: Any, config: IceCacheConfig | None = None, *, model_config: Any,
                   attention_mask: torch.Tensor | None = None, pager_factory: Any = None,
                   max_cache_len: int | None = None) -> IceCache:
        """Build an `IceCache` from a prompt that was already prefilled densely, without running it again.

        ``dense`` is a transformers cache holding the prompt's K/V (a `DynamicCache` after ``model(ids,
        past_key_values=dense)``); it is read, never changed, so one dense prefill serves any number of
        methods, budgets and configs (each call builds its own host store and indexes). To ask several
        questions about one long document, prefill the document once, extend a copy of the dense cache with
        each question (a dense forward of the question tokens only), and build from that. Decoding from the
        result gives token for token what prefilling the same prompt through an `IceCache` gives.

        ``model_config`` is the model's config (``model.config``); ``attention_mask`` ``[B, T]`` marks real
        tokens (left padding). The other arguments are `IceCache`'s.
        """
        cache = cls(model_config, config, pager_factory=pager_factory, max_cache_len=max_cache_len)
        try:
            return cache.load_prefill(dense, attention_mask)
        except BaseException:
            cache.close()
            raise

    def load_prefill(self, past_key_values: Any, attention_mask: torch.Tensor | None = None) -> IceCache:
        """Start from an already computed dense prefill (a `DynamicCache`) instead of running it again.

        Prefill is dense for every method, so evaluations prefill once and hand the same K/V to each
        method's cache; the result is identical to prefilling through this cache. ``attention_mask`` ``[B, T]``
        marks real tokens (left padding). Returns ``self``; decode with ``model(next_token, past_key_values=self)``.
        """
        if any(layer.is_initialized for layer in self.layers) or self._context is not None:
            raise CacheMisuseError("load_prefill needs a fresh IceCache")
        sources = self._dense_layers_of(past_key_values)
        self._start(max(src.keys.shape[-2] for src in sources), sources[0].keys.device)
        for i, (layer, kind) in enumerate(zip(self.layers, self.kind)):
            src = sources[i]
            k, v = src.keys, src.values
            if kind == "sliding" and hasattr(src, "cumulative_length"):  # already truncated to its window
                layer.lazy_initialization(k, v)
                layer.keys, layer.values, layer.cumulative_length = k, v, src.cumulative_length
                continue
            layer.update(k, v)
            if kind == "sparse":
                layer.finish_prefill(attention_mask.bool() if attention_mask is not None else None)
        return self

    def _dense_layers_of(self, dense: Any) -> list[Any]:
        """The layers of a prefilled dense cache, checked: a transformers `Cache` with one layer per model layer,
        each holding K/V. Raises `InputTypeError` / `InputError` in one line otherwise."""
        layers = getattr(dense, "layers", None)
        if not isinstance(dense, Cache) or layers is None:
            raise InputTypeError(
                "the dense prefill must be a transformers Cache (a DynamicCache after model(ids, past_key_values=cache)), "
                f"got {type(dense).__name__}"
            )
        if not layers or any(getattr(layer, "keys", None) is None or layer.keys.numel() == 0 for layer in layers):
            raise InputError("the dense cache holds no tokens: run the prompt through the model with it first")
        if len(layers) != len(self.layers):
            raise InputError(f"the dense cache has {len(layers)} layers; this model has {len(self.layers)}")
        return list(layers)

    # ------------------------------------------------------------------ model checks
    @staticmethod
    def _check_model(cfg: Any) -> None:
        mt = getattr(cfg, "model_type", "?")
        if getattr(cfg, "attn_logit_softcapping", None):
            raise ConfigError(f"IceCache does not support attention logit softcapping (model type {mt!r})")
        if getattr(cfg, "use_sliding_window", False) and not getattr(cfg, "layer_types", None):
            raise ConfigError(f"IceCache does not support a model-wide sliding window (model type {mt!r})")
        if mt not in SUPPORTED_MODEL_TYPES:
            warnings.warn(f"IceCache has not been tested with model type {mt!r}; check its outputs", stacklevel=3)

    @staticmethod
    def _check_context(cfg: Any, ice: IceCacheConfig) -> None:
        """Window, and sink + budget + window, must fit in the model's context (``max_position_embeddings``)."""
        context = getattr(cfg, "max_position_embeddings", None)
        if not isinstance(context, int) or context <= 0:
            return
        if ice.window > context:
            raise ConfigError(f"IceCacheConfig.window ({ice.window}) is larger than the model's context ({context} tokens)")
        extra = ice.insert_every - 1  # window tokens waiting for a group insert
        device_tokens = ice.sink + ice.budget + ice.window + extra
        if device_tokens > context:
            terms = f"{ice.sink} + {ice.budget} + {ice.window}" + (f" + {extra}" if extra else "")
            raise ConfigError(
                f"IceCacheConfig sink + budget + window{' + insert_every - 1' if extra else ''} ({terms} = "
                f"{device_tokens}) is larger than the model's context ({context} tokens)"
            )

    # ------------------------------------------------------------------ reliability tests
    def inject_fault(self, point: str, hook: Callable[..., Any] | None) -> None:
        """Run ``hook`` (which may raise) at fault point ``point`` (see `FAULT_POINTS`); None removes it."""
        self.faults.set(point, hook)

    # ------------------------------------------------------------------ Cache API
    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.closed:
            raise CacheMisuseError("this IceCache was closed; create a new IceCache for each generation")
        length = super().get_seq_length(layer_idx)
        prompt = _starting_generation_of(sys._getframe(1)) if length else None
        if prompt is not None and prompt <= length:
            raise CacheMisuseError(
                f"this IceCache already holds a generation ({length} tokens) and a new one of {prompt} prompt tokens "
                "started in it; create a new IceCache for each generation"
            )
        return length

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: dict[str, Any] | None = None):
        if self.closed:
            raise CacheMisuseError("this IceCache was closed; create a new IceCache for each generation")
        if not 0 <= layer_idx < len(self.layers):
            raise CacheMisuseError(f"layer index {layer_idx} out of range: this IceCache was built for {len(self.layers)} layers")
        layer = self.layers[layer_idx]
        q = key_states.shape[-2]
        if layer_idx == 0 and q > 1 and layer.get_seq_length() > 0:
            raise CacheMisuseError(
                f"this IceCache already holds {layer.get_seq_length()} tokens and received {q} more in one step: create "
                "a new IceCache for each generation (chunked prefill, assisted and speculative decoding are not "
                "supported: only one token per decode step)"
            )
        link.publish(self, layer_idx)
        if self._t_first_update is None:
            self._t_first_update = time.perf_counter()
        if self._context is None:
            self._start(key_states.shape[-2], key_states.device)
        if layer_idx == 0 and q == 1:
            self._on_decode_step()
        return layer.update(key_states, value_states, cache_kwargs)

    def _on_decode_step(self) -> None:
        if self._t_prefill_done is None:
            self._t_prefill_done = time.perf_counter()
        steps = self.accounting.start_step()
        self.workers.release_build_threads()  # the prefill is over (see `IndexWorkers.release_build_threads`)
        if steps == 1:
            self._set_select_threads()
        self._shared.clear()
        if self.ice.heap_policy == "trim" and steps % TRIM_EVERY == 0:
            trim_heap()

    def _select_threads(self) -> int:
        return 1 if self.prefetch_inserts else torch.get_num_threads()

    def _set_select_threads(self) -> None:
        """Let the selects scan on torch's intra-op threads when the decode inserts run inline: between two
        torch ops of the decode thread the other cores are idle. With background inserts a select keeps to one
        thread: the insert worker holds a core (``stats()["select_threads"]``)."""
        self.select_threads = self._select_threads()
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse" and layer.is_initialized:
                for row in layer.pagers:
                    for pager in row:
                        pager.select_threads = self.select_threads

    def shared_selection(self, layer_idx: int) -> dict[str, Any] | None:
        """The selection slot for IceCache(r): None when every layer selects for itself."""
        if self.ice.reuse_every == 1:
            return None
        return self._shared.setdefault(self.reuse_leader[layer_idx], {})

    # ------------------------------------------------------------------ accounting
    def device_kv_bytes(self, kinds: tuple[str, ...] = ("sparse", "dense", "sliding")) -> int:
        """KV bytes resident on the device now: sparse layers' buffers, dense layers' full KV and sliding
        layers' window (restricted to the layer ``kinds`` given)."""
        total = 0
        for layer, kind in zip(self.layers, self.kind):
            if kind not in kinds:
                continue
            if kind == "sparse":
                total += layer.device_bytes()
            elif layer.is_initialized and layer.keys is not None:
                total += 2 * layer.keys.numel() * layer.keys.element_size()
        return total

    def host_kv_bytes(self) -> int:
        return sum(layer.host_bytes() for layer, k in zip(self.layers, self.kind) if k == "sparse")

    def full_kv_bytes(self) -> int:
        """KV bytes a full cache of the same length would hold on the device."""
        total = 0
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse" and layer.is_initialized:
                total += 2 * layer.batch_size * layer.num_kv_heads * layer.length * layer.head_dim * layer.keys.element_size()
            elif kind != "sparse" and layer.is_initialized and layer.keys is not None:
                B, H, _, D = layer.keys.shape
                total += 2 * B * H * layer.get_seq_length() * D * layer.keys.element_size()
        return total

    def offloaded_tokens(self) -> int:
        """Tokens of the sequence (summed over batch rows) that left sink + window for the host pages; 0 when
        the whole sequence fits in sink + window (IceCache then attends exactly like full attention)."""
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse" and layer.is_initialized:
                return layer.offloaded_tokens()
        return 0

    def stats(self) -> dict[str, Any]:
        """Per-stage times, bytes moved, page reuse, device vs host KV bytes (see the README for the keys)."""
        c = dict(self.counters)
        sel = c["pages_selected"]
        offloaded = self.offloaded_tokens()
        out: dict[str, Any] = {
            **c,
            "stage_seconds": dict(self.timer.seconds),
            "page_reuse_rate": (c["pages_reused"] / sel) if sel else 0.0,
            "copies_per_layer_step": (c["copies"] / c["layer_steps"]) if c["layer_steps"] else 0.0,
            "tokens_per_selection": (c["tokens_selected"] / c["selections"]) if c["selections"] else 0.0,
            "device_kv_bytes": self.device_kv_bytes(),
            "host_kv_bytes": self.host_kv_bytes(),
            "full_kv_bytes": self.full_kv_bytes(),
            "offloaded_tokens": offloaded,
            "nothing_offloaded": offloaded == 0,
            "index_build_seconds": self.workers.job_seconds,
            "index_wait_seconds": self.workers.wait_seconds,
            "layers": {k: self.kind.count(k) for k in ("sparse", "dense", "sliding")},
            "index": self.pager_choice.spec if self.pager_choice is not None else None,
            "inserts": {None: "not started", True: "background", False: "inline"}[self.prefetch_inserts],
            "select_threads": self.select_threads,
            "kernels": kernel_status().as_dict(),
        }
        if self.ice.index == AUTO:
            out["auto_crossover_keys"] = self.pager_choice.crossover if self.pager_choice else self.ice.index_params.get("crossover")
        if self._t_first_update is not None and self._t_prefill_done is not None:
            out["prefill_seconds"] = self._t_prefill_done - self._t_first_update
        return out

    # ------------------------------------------------------------------ invariants
    def check_conservation(self) -> None:
        """Every position of every row is in exactly one of sink / one host page / window (AssertionError if not)."""
        self.workers.wait_all()
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse" and layer.is_initialized:
                layer.check_conservation()

    def host_kv(self, layer_idx: int, b: int, h: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """The host store's middle K/V of (layer, row, KV head) in position order:
        ``(absolute positions [m], K [m, D], V [m, D])``."""
        self.workers.wait(layer_idx)
        return self.layers[layer_idx].host_kv(b, h)

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the worker threads and drop host/device buffers. Idempotent; the cache is unusable after."""
        if self.closed:
            return
        self.closed = True
        self.workers.close()
        link.clear(self)
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse" and layer.is_initialized or isinstance(layer, GrowingLayer):
                layer.release()
            elif layer.is_initialized:
                layer.keys = layer.values = None
                layer.is_initialized = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_compileable(self) -> bool:
        return False


def _starting_generation_of(frame: Any) -> int | None:
    """The prompt length when ``frame`` is transformers' `GenerationMixin._get_initial_cache_position` (the one
    place `generate` asks a user-supplied cache for its length before its prefill), else None.

    A second `generate` into a used cache with a prompt no longer than the cache fails inside transformers with
    a bare IndexError before the cache sees a token; this lets `get_seq_length` say what went wrong instead.
    Any other caller (or a future transformers without that frame) gets the plain length.
    """
    if frame is None or frame.f_code.co_name != "_get_initial_cache_position":
        return None
    seq_length = frame.f_locals.get("seq_length")
    return seq_length if isinstance(seq_length, int) else None
