"""`IceCache`: a transformers `Cache` whose sparse layers keep only sink + window + budget KV on the device.

Token span of one batch row in a sparse layer, at logical length T (pad = the row's left padding)::

    | pad | sink (S) |            middle: host pages + pager             |  window (W)  |
    0     pad        pad+S                                               T-W            T
                     <-- offloaded as tokens leave the window (insert) --

    device buffer per (row, KV head):  [ sink S | budget slots B | window ring W ]  (+ a validity mask)

Every position of a row is in exactly one of: the sink slots, one host page, the window ring (the
conservation invariant, checked by `IceCache.check_conservation`). Prefill (``q_len > 1``) attends densely;
its middle K/V goes to the host store and the pagers are built on the prefill pipeline's threads while
the next layers compute. Decode (``q_len == 1``) attends sparsely over the device buffer after the
`BulkLoader` has brought in the selected pages. Layers listed in ``dense_layers`` keep full KV
(`GrowingLayer`: a `DynamicLayer` that appends in place); sliding-window layers keep their window
(`DynamicSlidingWindowLayer`).
"""

from __future__ import annotations

import time
import warnings
import weakref
from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from icecache.core.config import IceCacheConfig
from icecache.core.errors import CacheMisuseError, ConfigError, InputError
from icecache.indexes.registry import make_pager
from icecache.runtime import link
from icecache.runtime.cpu_attention import sparse_attention_cpu
from icecache.runtime.dense_layer import GrowingLayer
from icecache.runtime.loader import BulkLoader
from icecache.runtime.malloc import pin_mmap_threshold, trim_heap
from icecache.runtime.prefill import PrefillPipeline
from icecache.runtime.store import HeadStore
from icecache.runtime.timing import StageTimer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


class IceCacheLayer(CacheLayerMixin):
    """One sparse layer: device buffers, per-(row, KV head) pagers and host stores, the bulk loader."""

    is_sliding = False
    is_compileable = False

    def __init__(self, cache: "IceCache", layer_idx: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        self._cache_ref = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        cfg = cache.ice
        self.S, self.W, self.budget = cfg.sink, cfg.window, cfg.budget
        self.length = 0  # logical tokens seen (including padding)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------------ transformers layer API
    @property
    def cache(self) -> "IceCache":
        c = self._cache_ref()
        assert c is not None, "IceCacheLayer outlived its IceCache"
        return c

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.cache.ice
        B, H, _, D = key_states.shape
        if H != self.num_kv_heads or D != self.head_dim:
            raise CacheMisuseError(
                f"layer {self.layer_idx}: keys have {H} heads x {D} dims, the model config says "
                f"{self.num_kv_heads} x {self.head_dim}"
            )
        self.dtype, self.device, self.B = key_states.dtype, key_states.device, B
        L = self.S + self.budget + self.W
        self.L = L
        self.buf_k = torch.zeros(B, H, L, D, dtype=self.dtype, device=self.device)
        self.buf_v = torch.zeros_like(self.buf_k)
        self.buf_valid = torch.zeros(B, H, L, dtype=torch.bool, device=self.device)
        pin = self.device.type == "cuda"
        factory = self.cache.pager_factory
        self.pagers = [[factory(self.layer_idx, b, h, D) for h in range(H)] for b in range(B)]
        for row in self.pagers:
            for p in row:
                if not p.table.record_moves:
                    raise CacheMisuseError("a pager_factory must create pagers with record_moves=True")
        self.stores = [[HeadStore(p.table, D, self.dtype, pin=pin) for p in row] for row in self.pagers]
        self.loader = BulkLoader(self.buf_k, self.buf_v, self.buf_valid, self.S, self.budget)
        self.pad = np.zeros(B, dtype=np.int64)
        self.num_sinks = np.zeros(B, dtype=np.int64)
        self.offloaded = 0
        self.keys = self.buf_k  # what `CacheLayerMixin` users look at
        self.values = self.buf_v
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if key_states.shape[0] != self.B:
            raise CacheMisuseError(f"batch size changed from {self.B} to {key_states.shape[0]} inside one IceCache")
        if self.length == 0:
            # Prefill: attention runs densely on what we return; the offload starts once the attention
            # function has told us which tokens are padding (`finish_prefill`).
            self._pending = (key_states, value_states)
            self.length = q
            return key_states, value_states
        if q != 1:
            raise CacheMisuseError(
                f"IceCache received {q} new tokens in one step after prefill (chunked prefill, assisted or "
                "speculative decoding); only one token per decode step is supported"
            )
        self._decode_append(key_states, value_states)
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, cache_position: torch.Tensor) -> tuple[int, int]:
        return self.length + cache_position.shape[0], 0

    def get_max_cache_shape(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("IceCache does not support beam search yet (use greedy or sampling)")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("IceCache cannot be cropped (assisted/speculative decoding is not supported)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("IceCache does not support batch expansion (num_return_sequences > 1, beams)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("IceCache does not support batch selection")

    def reset(self) -> None:
        raise NotImplementedError("create a new IceCache instead of resetting one")

    # ------------------------------------------------------------------ prefill
    def finish_prefill(self, valid: torch.Tensor | None) -> None:
        """Place the prefill tokens: window ring, sinks, and (in the background) host pages + pagers.

        ``valid`` ``[B, T]`` bool marks non-padding tokens (None: all valid). Padding must be on the left.
        """
        assert self._pending is not None, "finish_prefill without a pending prefill"
        k, v = self._pending
        self._pending = None
        B, H, T, D = k.shape
        S, W, R = self.S, self.W, self.S + self.budget
        if valid is None:
            pad = np.zeros(B, dtype=np.int64)
        else:
            vm = valid.to("cpu", torch.bool).numpy()
            pad = np.argmax(vm, axis=1).astype(np.int64)
            pad[~vm.any(axis=1)] = T
            if not all(vm[b, pad[b]:].all() for b in range(B)):
                raise CacheMisuseError("IceCache supports left padding only (a row has padding after a real token)")
        self.pad = pad
        # window ring: the last W positions
        w0 = max(0, T - W)
        self.offloaded = w0  # positions below this one have left the window (sinks or host pages)
        wpos = torch.arange(w0, T)
        ring = R + wpos % W
        self.buf_k[:, :, ring] = k[:, :, w0:T]
        self.buf_v[:, :, ring] = v[:, :, w0:T]
        ok = torch.from_numpy(wpos.numpy()[None, :] >= pad[:, None]).to(self.device)  # [B, n]
        self.buf_valid[:, :, ring] = ok[:, None, :].expand(B, H, -1)
        # positions that already left the window: sinks and middle
        cache = self.cache
        for b in range(B):
            p0 = int(pad[b])
            sink_end = min(p0 + S, w0)
            ns = max(0, sink_end - p0)
            if ns:
                self.buf_k[b, :, :ns] = k[b, :, p0:sink_end]
                self.buf_v[b, :, :ns] = v[b, :, p0:sink_end]
                self.buf_valid[b, :, :ns] = True
            self.num_sinks[b] = ns
            m0 = p0 + S
            if w0 > m0:
                k_mid = k[b, :, m0:w0].to("cpu")
                v_mid = v[b, :, m0:w0].to("cpu")
                if k.device.type == "cuda":
                    torch.cuda.current_stream(k.device).synchronize()
            else:
                k_mid = v_mid = k.new_zeros(H, 0, D, device="cpu")
            for h in range(H):
                cache.pipeline.submit(
                    self.layer_idx, f"offload+build row {b} head {h}", self._build_one, b, h, k_mid[h], v_mid[h]
                )

    def _build_one(self, b: int, h: int, k_mid: torch.Tensor, v_mid: torch.Tensor) -> None:
        fault = self.cache._fault_hooks.get("build")
        if fault is not None:
            fault(self.layer_idx, b, h)
        pager = self.pagers[b][h]
        pager.build(k_mid)
        self.stores[b][h].sync(pager.table.take_moves(), k_mid, v_mid, first_new=0)

    # ------------------------------------------------------------------ decode
    def _decode_append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the new token to the window ring; the token it displaces becomes a sink or goes to the host.

        The host insert of a displaced middle token was normally prefetched on a worker during the previous
        step (see `attend`); `pipeline.wait` makes sure it finished. Otherwise it happens here.
        """
        cache = self.cache
        fault = cache._fault_hooks.get("decode")
        if fault is not None:
            fault(self.layer_idx, self.length)
        cache.pipeline.wait(self.layer_idx)
        S, W, R = self.S, self.W, self.S + self.budget
        p = self.length
        self.length += 1
        ring = R + p % W
        old = p - W
        with cache.timer.stage("insert"):
            if old >= 0:  # the token in this ring slot leaves the window now
                if self.offloaded <= old:  # not prefetched: insert it into the host pages now
                    kc, vc = self._leaving(old)
                    self._insert_host(old, kc, vc)
                for b in range(self.B):
                    p0 = int(self.pad[b])
                    if p0 <= old < p0 + S:  # one of the row's first S real tokens: a sink
                        j = old - p0
                        self.buf_k[b, :, j] = self.buf_k[b, :, ring]
                        self.buf_v[b, :, j] = self.buf_v[b, :, ring]
                        self.buf_valid[b, :, j] = True
                        self.num_sinks[b] = j + 1
            self.buf_k[:, :, ring] = k[:, :, 0]
            self.buf_v[:, :, ring] = v[:, :, 0]
            self.buf_valid[:, :, ring] = True

    def _leaving(self, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[B, H, D]`` (host copies) of the window token at absolute position ``pos``."""
        ring = self.S + self.budget + pos % self.W
        kc = self.buf_k[:, :, ring].to("cpu")
        vc = self.buf_v[:, :, ring].to("cpu")
        if not bool(torch.isfinite(kc).all()):
            raise InputError(f"layer {self.layer_idx}: the model produced NaN/inf keys")
        self.offloaded = pos + 1
        return kc, vc

    def _insert_host(self, pos: int, kc: torch.Tensor, vc: torch.Tensor) -> None:
        """Insert the token at absolute position ``pos`` into every row's pagers and host stores where it is a
        middle token. Touches only this layer's pagers and stores (safe on a worker thread)."""
        keys32 = kc.float()
        for b in range(self.B):
            p0 = int(self.pad[b])
            if pos < p0 + self.S:
                continue  # padding or a sink
            local = pos - p0 - self.S
            for h in range(self.num_kv_heads):
                pager = self.pagers[b][h]
                assert len(pager) == local, "pager positions out of step with the sequence"
                pager.insert(keys32[b, h][None], check=False)
                self.stores[b][h].sync(pager.table.take_moves(), kc[b, h][None], vc[b, h][None], first_new=local)

    def _prefetch_insert(self) -> None:
        """Start inserting, on a worker, the token that leaves the window at the next step. It stays in the
        window (and out of every selection) until then; the next step waits for the job before selecting."""
        nxt = self.length - self.W
        if nxt < 0 or self.offloaded > nxt:
            return
        if all(nxt < int(p0) + self.S for p0 in self.pad):
            return  # padding or sinks only: handled synchronously when it leaves
        kc, vc = self._leaving(nxt)
        self.cache.pipeline.submit(self.layer_idx, f"insert position {nxt}", self._insert_host, nxt, kc, vc)

    def attend(self, query: torch.Tensor, scaling: float, shared: dict[str, Any] | None) -> torch.Tensor:
        """Sparse decode attention. ``query`` ``[B, Hq, 1, D]`` -> output ``[B, 1, Hq, D]``.

        ``shared`` carries a selection between layers for IceCache(r): None = select here; a dict with
        ``"positions"`` = reuse them; an empty dict = select here and store them for the next layers.
        """
        cache = self.cache
        cfg = cache.ice
        B, Hq, _, D = query.shape
        H = self.num_kv_heads
        n_rep = Hq // H
        qg = query.reshape(B, H, n_rep, D)
        reuse = shared is not None and "positions" in shared
        with cache.timer.stage("select"):
            if reuse:
                positions = shared["positions"]
                indptrs = [[None] * H for _ in range(B)]
            else:
                q_host = qg.detach().to("cpu", torch.float32).contiguous()
                if not bool(torch.isfinite(q_host).all()):
                    raise InputError(f"layer {self.layer_idx}: the model produced NaN/inf queries")
                positions, indptrs = [], []
                for b in range(B):
                    prow, irow = [], []
                    for h in range(H):
                        pager = self.pagers[b][h]
                        if cfg.gqa == "union":
                            pages, ip, pos, _ = pager.select_arrays(q_host[b, h], self.budget, check=False)
                        else:  # every query head picks budget // n_rep tokens; attend the union
                            sels = [pager.select_arrays(q_host[b, h, g : g + 1], self.budget // n_rep, check=False)[0] for g in range(n_rep)]
                            pages, keep = np.unique(np.concatenate(sels), return_index=True)
                            pages = np.concatenate(sels)[np.sort(keep)]
                            ip, pos = pager.table.csr(pages)
                        prow.append(pos)
                        irow.append(ip)
                        if cfg.trace:
                            cache._trace_pages[(self.layer_idx, b, h)] = pages
                    positions.append(prow)
                    indptrs.append(irow)
                if shared is not None:
                    shared["positions"] = positions
        fault = cache._fault_hooks.get("load")
        if fault is not None:
            fault(self.layer_idx, self.length)
        report = self.loader.load(self.stores, positions, indptrs, cache.timer)
        cache._account(self, report, positions, indptrs)
        if cache.prefetch_inserts:
            self._prefetch_insert()
        with cache.timer.stage("attend"):
            if self.buf_k.device.type == "cpu":  # single-threaded kernel: no fork/join beside the insert worker
                out = sparse_attention_cpu(qg, self.buf_k, self.buf_v, self.buf_valid, scaling)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    qg, self.buf_k, self.buf_v, attn_mask=self.buf_valid[:, :, None, :], scale=scaling
                )  # [B, H, n_rep, D]
        return out.reshape(B, Hq, 1, D).transpose(1, 2)

    # ------------------------------------------------------------------ introspection
    def device_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        return 2 * self.buf_k.numel() * self.buf_k.element_size()

    def host_bytes(self) -> int:
        """K/V bytes held by this layer's host stores, after any background insert of the layer finished (a
        read during one raced with it: a fresh-clone `make test` once saw 6 of 8 heads' prefetched token)."""
        if not self.is_initialized:
            return 0
        self.cache.pipeline.wait(self.layer_idx)
        return sum(s.used_bytes() for row in self.stores for s in row)


#: ``heap_policy="trim"``: decode steps between two `trim_heap` calls.
TRIM_EVERY = 256


class IceCache(Cache):
    """A `transformers` cache that keeps only sink + window + budget KV per sparse layer on the device.

    Parameters
    ----------
    model_config : transformers.PretrainedConfig
        The model's config (``model.config``); layers are created from it.
    config : IceCacheConfig, optional
        IceCache settings (defaults to ``IceCacheConfig()``).

    Use with ``model.set_attn_implementation("icecache")`` (``import icecache`` registers it) and
    ``model.generate(..., past_key_values=cache)``. Close it (or use it as a context manager) to stop
    its worker threads; `stats` reports times, bytes and memory.

    Long generations: ``config.heap_policy`` keeps glibc's heaps from creeping up (`icecache.runtime.malloc`);
    ``"trim"`` (default) trims them every 256 decode steps, ``"pin"`` fixes the mmap threshold process-wide.
    """

    def __init__(self, model_config: Any, config: IceCacheConfig | None = None, *, pager_factory: Any = None) -> None:
        self.ice = config if config is not None else IceCacheConfig()
        if not isinstance(self.ice, IceCacheConfig):
            raise ConfigError(f"config must be an IceCacheConfig, got {type(self.ice).__name__}")
        text_cfg = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
        self.model_config = text_cfg
        self._check_model(text_cfg)
        n_layers = text_cfg.num_hidden_layers
        bad = [i for i in self.ice.dense_layers if i >= n_layers]
        if bad:
            raise ConfigError(f"IceCacheConfig.dense_layers must be in [0, {n_layers - 1}] for this model, got {bad}")
        H = text_cfg.num_key_value_heads or text_cfg.num_attention_heads
        D = getattr(text_cfg, "head_dim", None) or text_cfg.hidden_size // text_cfg.num_attention_heads
        types = list(getattr(text_cfg, "layer_types", None) or ["full_attention"] * n_layers)
        self.pager_factory = pager_factory or self._default_pager
        #: insert the token that will leave the window next step on a worker during this step (exact semantics)
        self.prefetch_inserts = True
        if self.ice.heap_policy == "pin":
            pin_mmap_threshold()
        self.pipeline = PrefillPipeline(self.ice.num_threads)
        self.timer = StageTimer()
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
                layers.append(IceCacheLayer(self, i, H, D))
                self.kind.append("sparse")
        super().__init__(layers=layers)
        sparse = [i for i, k in enumerate(self.kind) if k == "sparse"]
        r = self.ice.reuse_every
        self.reuse_leader = {i: sparse[(j // r) * r] for j, i in enumerate(sparse)}
        self._shared: dict[int, dict[str, Any]] = {}
        # Fault injection for reliability tests: name -> callable raising an exception.
        # "build" (layer, row, head) runs in an index-build worker; "load" (layer, length) before the bulk
        # loader; "decode" (layer, length) at the start of a decode step.
        self._fault_hooks: dict[str, Any] = {}
        self._trace_pages: dict[tuple[int, int, int], np.ndarray] = {}
        self.trace: list[dict[str, Any]] = []
        self.counters = {"steps": 0, "bytes_copied": 0, "copies": 0, "layer_steps": 0, "pages_copied": 0,
                         "pages_selected": 0, "pages_reused": 0, "tokens_selected": 0, "tokens_copied": 0}
        self._t_first_update: float | None = None
        self._t_prefill_done: float | None = None
        self.closed = False
        self._finalizer = weakref.finalize(self, PrefillPipeline.close, self.pipeline)

    def _default_pager(self, layer_idx: int, row: int, kv_head: int, head_dim: int) -> Any:
        cfg = self.ice
        return make_pager(cfg.index, head_dim=head_dim, page_size=cfg.page_size, seed=cfg.seed, record_moves=True, **cfg.index_params)

    def load_prefill(self, past_key_values: Any, attention_mask: torch.Tensor | None = None) -> "IceCache":
        """Start from an already computed dense prefill (a `DynamicCache`) instead of running it again.

        Prefill is dense for every method, so evaluations prefill once and hand the same K/V to each
        method's cache; the result is identical to prefilling through this cache. ``attention_mask`` ``[B, T]``
        marks real tokens (left padding). Returns ``self``; decode with ``model(next_token, past_key_values=self)``.
        """
        if any(l.is_initialized for l in self.layers):
            raise CacheMisuseError("load_prefill needs a fresh IceCache")
        for i, (layer, kind) in enumerate(zip(self.layers, self.kind)):
            src = past_key_values.layers[i]
            k, v = src.keys, src.values
            if kind == "sliding" and hasattr(src, "cumulative_length"):  # already truncated to its window
                layer.lazy_initialization(k, v)
                layer.keys, layer.values, layer.cumulative_length = k, v, src.cumulative_length
                continue
            layer.update(k, v)
            if kind == "sparse":
                layer.finish_prefill(attention_mask.bool() if attention_mask is not None else None)
        return self

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

    # ------------------------------------------------------------------ Cache API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, cache_kwargs: dict[str, Any] | None = None):
        if self.closed:
            raise CacheMisuseError("this IceCache was closed; create a new one for a new generation")
        if not 0 <= layer_idx < len(self.layers):
            raise CacheMisuseError(f"layer index {layer_idx} out of range: this IceCache was built for {len(self.layers)} layers")
        link.publish(self, layer_idx)
        if self._t_first_update is None:
            self._t_first_update = time.perf_counter()
        layer = self.layers[layer_idx]
        if layer_idx == 0 and key_states.shape[-2] == 1:
            self._on_decode_step()
        return layer.update(key_states, value_states, cache_kwargs)

    def _on_decode_step(self) -> None:
        if self._t_prefill_done is None:
            self._t_prefill_done = time.perf_counter()
        self.counters["steps"] += 1
        self._shared.clear()
        if self.ice.heap_policy == "trim" and self.counters["steps"] % TRIM_EVERY == 0:
            trim_heap()

    def shared_selection(self, layer_idx: int) -> dict[str, Any] | None:
        """The selection slot for IceCache(r): None when every layer selects for itself."""
        if self.ice.reuse_every == 1:
            return None
        return self._shared.setdefault(self.reuse_leader[layer_idx], {})

    # ------------------------------------------------------------------ accounting
    def _account(self, layer: IceCacheLayer, report: Any, positions: Any, indptrs: Any) -> None:
        c = self.counters
        c["layer_steps"] += 1
        c["bytes_copied"] += report.bytes_copied
        c["copies"] += report.copies
        c["pages_selected"] += report.pages_selected
        c["pages_reused"] += report.pages_reused
        c["pages_copied"] += report.pages_selected - report.pages_reused
        c["tokens_selected"] += report.tokens_selected
        c["tokens_copied"] += report.tokens_copied
        if self.ice.trace:
            elt = 2 * layer.head_dim * layer.buf_k.element_size()
            for b, h, n_sel, n_reused, n_copied in report.per_head:
                pages = self._trace_pages.pop((layer.layer_idx, b, h), None)
                self.trace.append({
                    "step": c["steps"], "layer": layer.layer_idx, "row": b, "kv_head": h,
                    "pages": [] if pages is None else pages.tolist(),
                    "tokens": int(len(positions[b][h])),
                    "new_pages": n_sel - n_reused,
                    "new_tokens": n_copied,
                    "bytes": n_copied * elt,
                })

    def device_kv_bytes(self, kinds: tuple[str, ...] = ("sparse", "dense", "sliding")) -> int:
        """KV bytes resident on the device now: sparse layers' buffers (fixed after prefill), dense layers'
        full KV and sliding layers' window (restricted to the layer ``kinds`` given)."""
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
        return sum(l.host_bytes() for l, k in zip(self.layers, self.kind) if k == "sparse")

    def full_kv_bytes(self) -> int:
        """KV bytes a full cache of the same length would hold on the device."""
        total = 0
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse" and layer.is_initialized:
                total += 2 * layer.B * layer.num_kv_heads * layer.length * layer.head_dim * layer.buf_k.element_size()
            elif kind != "sparse" and layer.is_initialized and layer.keys is not None:
                B, H, _, D = layer.keys.shape
                total += 2 * B * H * layer.get_seq_length() * D * layer.keys.element_size()
        return total

    def stats(self) -> dict[str, Any]:
        """Per-stage times, bytes moved, page reuse, device vs host KV bytes (see the README for the keys)."""
        c = dict(self.counters)
        sel = c["pages_selected"]
        out: dict[str, Any] = {
            **c,
            "stage_seconds": dict(self.timer.seconds),
            "page_reuse_rate": (c["pages_reused"] / sel) if sel else 0.0,
            "copies_per_layer_step": (c["copies"] / c["layer_steps"]) if c["layer_steps"] else 0.0,
            "device_kv_bytes": self.device_kv_bytes(),
            "host_kv_bytes": self.host_kv_bytes(),
            "full_kv_bytes": self.full_kv_bytes(),
            "index_build_seconds": self.pipeline.job_seconds,
            "index_wait_seconds": self.pipeline.wait_seconds,
            "layers": {k: self.kind.count(k) for k in ("sparse", "dense", "sliding")},
        }
        if self._t_first_update is not None and self._t_prefill_done is not None:
            out["prefill_seconds"] = self._t_prefill_done - self._t_first_update
        return out

    # ------------------------------------------------------------------ invariants
    def check_conservation(self) -> None:
        """Every position of every row is in exactly one of sink / one host page / window (AssertionError if not)."""
        self.pipeline.wait_all()
        for layer, kind in zip(self.layers, self.kind):
            if kind != "sparse" or not layer.is_initialized:
                continue
            T, S, W = layer.length, layer.S, layer.W
            for b in range(layer.B):
                p0 = int(layer.pad[b])
                counts = np.zeros(T, dtype=np.int64)
                counts[p0 : p0 + int(layer.num_sinks[b])] += 1
                counts[max(0, T - W) : T] += 1
                for h in range(layer.num_kv_heads):
                    pager = layer.pagers[b][h]
                    c = counts.copy()
                    pos = np.concatenate(list(pager.table.as_dict().values()) or [np.zeros(0, np.int64)])
                    absolute = pos + p0 + S
                    prefetched = absolute >= max(0, T - W)  # inserted ahead while still in the window
                    assert (absolute[prefetched] < layer.offloaded).all(), "host holds a window token nobody prefetched"
                    np.add.at(c, absolute[~prefetched], 1)
                    pager.table.check()
                    assert len(pager) == len(pos), f"layer {layer.layer_idx}: pager size != paged positions"
                    assert (c[:p0] == 0).all(), "padding is stored somewhere"
                    assert (c[p0:] == 1).all(), (
                        f"layer {layer.layer_idx} row {b} head {h}: positions {np.flatnonzero(c[p0:] != 1)[:8] + p0} "
                        "are not in exactly one of sink / host page / window"
                    )

    def host_kv(self, layer_idx: int, b: int, h: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
        """The host store's middle K/V of (layer, row, KV head) in position order:
        ``(absolute positions [m], K [m, D], V [m, D])``."""
        self.pipeline.wait(layer_idx)
        layer = self.layers[layer_idx]
        n = len(layer.pagers[b][h])
        k, v = layer.stores[b][h].read(np.arange(n))
        return np.arange(n) + int(layer.pad[b]) + layer.S, k, v

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Stop the worker threads and drop host/device buffers. Idempotent; the cache is unusable after."""
        if self.closed:
            return
        self.closed = True
        self.pipeline.close()
        link.clear(self)
        for layer, kind in zip(self.layers, self.kind):
            if kind == "sparse" and layer.is_initialized:
                layer.pagers = []
                layer.stores = []
                layer.loader = None
                layer.buf_k = layer.buf_v = layer.keys = layer.values = None
                layer.is_initialized = False
            elif isinstance(layer, GrowingLayer):
                layer.release()
            elif layer.is_initialized:
                layer.keys = layer.values = None
                layer.is_initialized = False

    def __enter__(self) -> "IceCache":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def is_compileable(self) -> bool:
        return False
