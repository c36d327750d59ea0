"""`IceCacheLayer`: one sparse layer of an `IceCache`, as transformers sees it.

Prefill (``q_len > 1``) attends densely; `finish_prefill` places the tokens (`TokenPlacement`) and builds the
middle's host pages and pagers on the cache's index workers while the next layers compute. Decode
(``q_len == 1``): `update` appends the new token to the window ring, `attend` selects pages
(`selection.select_layer`), brings them into the budget slots (`BulkLoader`), prefetches the next host insert
and attends over sink + budget slots + window.

The layer uses what its cache hands it at the first update (`LayerContext`: config, pager factory, workers,
timer, accounting, fault hooks) and holds no reference back to the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from icecache.core.config import IceCacheConfig
from icecache.core.errors import CacheMisuseError
from icecache.runtime.cpu_attention import sparse_attention_cpu
from icecache.runtime.layer_context import LayerContext
from icecache.runtime.placement import TokenPlacement
from icecache.runtime.selection import LayerSelection, select_layer


class IceCacheLayer(TokenPlacement, CacheLayerMixin):
    """One sparse layer: device buffers, per-(row, KV head) pagers and host stores, the bulk loader."""

    is_sliding = False
    is_compileable = False

    def __init__(self, config: IceCacheConfig, layer_idx: int, num_kv_heads: int, head_dim: int) -> None:
        CacheLayerMixin.__init__(self)
        TokenPlacement.__init__(self, layer_idx, num_kv_heads, head_dim, sink=config.sink, window=config.window,
                                budget=config.budget, insert_every=config.insert_every)
        self._context: LayerContext | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def start(self, context: LayerContext) -> None:
        """Receive the cache's resolved context (once, before the layer's first update)."""
        if self._context is not None:
            raise CacheMisuseError(f"layer {self.layer_idx} was started twice")
        self._context = context

    @property
    def context(self) -> LayerContext:
        if self._context is None:
            raise CacheMisuseError(f"layer {self.layer_idx} was used before its IceCache started it (an IceCacheLayer "
                                   "belongs to an IceCache: update it through the cache)")
        return self._context

    # ------------------------------------------------------------------ transformers layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, T, D = key_states.shape
        if H != self.num_kv_heads or D != self.head_dim:
            raise CacheMisuseError(
                f"layer {self.layer_idx}: keys have {H} heads x {D} dims, the model config says "
                f"{self.num_kv_heads} x {self.head_dim}"
            )
        ctx = self.context
        self.dtype, self.device = key_states.dtype, key_states.device
        pagers = [[ctx.make_pager(self.layer_idx, b, h, D) for h in range(H)] for b in range(B)]
        self.allocate(B, self.dtype, self.device, pagers, max_length=max(T, ctx.max_length))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        q = key_states.shape[-2]
        if key_states.shape[0] != self.batch_size:
            raise CacheMisuseError(f"batch size changed from {self.batch_size} to {key_states.shape[0]} inside one IceCache")
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
        """Place the prefill tokens: window ring, sinks, and (on the index workers) host pages + pagers.

        ``valid`` ``[B, T]`` bool marks non-padding tokens (None: all valid). Padding must be on the left.
        """
        assert self._pending is not None, "finish_prefill without a pending prefill"
        k, v = self._pending
        self._pending = None
        workers = self.context.workers
        for b, (k_mid, v_mid) in enumerate(self.place_prefill(k, v, valid)):
            for h in range(self.num_kv_heads):
                workers.submit(self.layer_idx, f"offload+build row {b} head {h}", self._build_host_job, b, h, k_mid[h], v_mid[h])

    def _build_host_job(self, b: int, h: int, k_mid: torch.Tensor, v_mid: torch.Tensor) -> None:
        self.context.faults("build", self.layer_idx, b, h)
        self.build_host(b, h, k_mid, v_mid)

    # ------------------------------------------------------------------ decode
    def _decode_append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append the new token; the host insert of the token it displaces was normally prefetched on a worker
        during the previous step (see `attend`) and `workers.wait` makes sure it finished."""
        ctx = self.context
        ctx.faults("decode", self.layer_idx, self.length)
        ctx.workers.wait(self.layer_idx)
        with ctx.timer.stage("insert"):
            self.append_token(k, v)

    def _prefetch_insert(self) -> None:
        """Start inserting, on a worker, the tokens that leave the window at the next step. They stay in the
        window (and out of every selection) until then; the next step waits for the job before selecting."""
        nxt = self.next_leaving()
        if nxt is None:
            return
        kc, vc = self.take_leaving(nxt, self.insert_every)
        self.context.workers.submit(self.layer_idx, f"insert position {nxt}", self.insert_host, nxt, kc, vc, kind="insert")

    def attend(self, query: torch.Tensor, scaling: float, shared: dict[str, Any] | None) -> torch.Tensor:
        """Sparse decode attention. ``query`` ``[B, Hq, 1, D]`` -> output ``[B, 1, Hq, D]``.

        ``shared`` carries a selection between layers for IceCache(r): None = select here; a dict with
        ``"positions"`` = reuse them; an empty dict = select here and store them for the next layers.
        """
        ctx = self.context
        cfg = ctx.config
        B, Hq, _, D = query.shape
        H = self.num_kv_heads
        n_rep = Hq // H
        qg = query.reshape(B, H, n_rep, D)
        with ctx.timer.stage("select"):
            if shared is not None and "positions" in shared:
                selection = LayerSelection(shared["positions"], [[None] * H for _ in range(B)], [[None] * H for _ in range(B)])
            else:
                selection = select_layer(self.pagers, qg, self.budget, cfg.gqa, layer_idx=self.layer_idx,
                                         keep_pages=ctx.accounting.tracing, top_p=cfg.top_p, scale=scaling)
                if shared is not None:
                    shared["positions"] = selection.positions
        ctx.faults("load", self.layer_idx, self.length)
        report = self.loader.load(self.stores, selection.positions, selection.indptrs, ctx.timer)
        ctx.accounting.record_load(self.layer_idx, report, selection, 2 * self.head_dim * self.keys.element_size())
        with ctx.timer.stage("attend"):
            if self.keys.device.type == "cpu":  # single-threaded kernel: no fork/join beside the insert worker
                out = sparse_attention_cpu(qg, self.keys, self.values, self.valid, scaling)
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    qg, self.keys, self.values, attn_mask=self.valid[:, :, None, :], scale=scaling
                )  # [B, H, n_rep, D]
        if ctx.workers.prefetch_inserts:
            # After the attention: the worker's Python then overlaps the layer's projections and MLP (torch ops
            # that release the GIL) instead of contending with this step's own Python work.
            self._prefetch_insert()
        return out.reshape(B, Hq, 1, D).transpose(1, 2)

    # ------------------------------------------------------------------ introspection
    def host_bytes(self) -> int:
        """K/V bytes held by this layer's host stores, after any background insert of the layer finished (a
        read during one raced with it: a fresh-clone `make test` once saw 6 of 8 heads' prefetched token)."""
        if not self.is_initialized:
            return 0
        self.context.workers.wait(self.layer_idx)
        return sum(s.used_bytes() for row in self.stores for s in row)

    def release(self) -> None:
        TokenPlacement.release(self)
        self.is_initialized = False
