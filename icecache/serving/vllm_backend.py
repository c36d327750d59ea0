"""`IceCacheCPUBackend`: vLLM's CPU attention backend with IceCache's sparse decode (docs/serving.md).

Without ``additional_config["icecache"]`` every method is vLLM's own (`CPUAttentionBackend`, its builder and
impl), so output is token-for-token that of stock vLLM. With it, a decode row (query length 1) of a request
whose context exceeds ``sink + window + budget`` attends, on every layer outside ``dense_layers``, over its
first ``sink`` tokens, its last ``window`` tokens (the current one included) and the ``budget`` middle tokens
that the request's pager of that (layer, KV head) selects for the step's query group, as the HF runtime
(`icecache.runtime.layer`) does. Everything else (prefill and chunked prefill, short contexts, dense layers,
sliding-window layers) is vLLM's dense kernel.

Pagers live in the worker process, one `RequestState` per request: built lazily at the request's first
sparse decode step from the keys in vLLM's paged KV cache (positions ``[sink, T - 1 - window)``, as if the
prompt had just been prefilled, then the token leaving the window inserted, the order of the HF runtime) and
fed, every step, the tokens that left the window since. Keys and values are read from the paged cache
through the request's block-table row (`KVLayout` knows how the CPU kernel lays a block out).

Request identity (design choice): the builder reads the row -> request-id map of the worker's model runner
(``input_batch.req_ids``, the runner being ``self`` of a caller's frame) and frees the state of any request the
runner no longer holds (finished or aborted). A preempted request keeps its state while the runner keeps it;
when it is scheduled again with a different block-table prefix, its state is rebuilt from the cache.
Limits: this relies on private internals of vLLM 0.32.0's V1 runner (pinned by the serve environment; the
builder fails with a one-line error if it cannot find them); one worker process (the CPU platform's default);
in a batch that mixes sparse and dense rows the dense kernel also runs for the sparse ones (their output is
then overwritten); selection and gathering are per-row Python, so decode is not yet faster than dense.
The KV-connector route (lifecycle events without the stack walk) is not implemented.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from icecache.core.config import IceCacheConfig
from icecache.core.errors import CacheMisuseError, ConfigError
from icecache.runtime.cpu_attention import sparse_attention_cpu
from icecache.runtime.selection import select_pages
from icecache.serving.vllm_plugin import check_index, icecache_config

logger = init_logger("vllm.icecache")  # under "vllm": vLLM configures only its own loggers


# ---------------------------------------------------------------------------------------------- KV layout
class KVLayout:
    """How the CPU kernel (``cpu_attn_reshape_and_cache``) lays out one block of one KV head for an ISA:
    keys ``[block_size, D]`` or transposed ``[D, block_size]`` (the ``vec`` kernel), values ``[block_size, D]``.
    Found once per (ISA, dtype, block size, head size) by writing known keys and looking where they went."""

    _known: dict[tuple[str, torch.dtype, int, int], bool] = {}

    @classmethod
    def keys_transposed(cls, isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> bool:
        key = (isa, dtype, block_size, head_size)
        if key not in cls._known:
            from vllm import _custom_ops as ops

            kv = torch.zeros(2, 1, block_size, 2 * head_size, dtype=dtype)
            kc, vc = kv.view(2, 1, 2 * block_size, head_size).chunk(2, dim=2)
            k = torch.randn(block_size, 1, head_size, generator=torch.Generator().manual_seed(0)).to(dtype)
            ops.cpu_attn_reshape_and_cache(k, k.clone(), kc, vc, torch.arange(block_size) + block_size, isa)
            flat = kv.view(2, 1, 2, block_size * head_size)[1, 0, 0]
            if torch.equal(flat.view(block_size, head_size), k[:, 0]):
                cls._known[key] = False
            elif torch.equal(flat.view(head_size, block_size).t(), k[:, 0]):
                cls._known[key] = True
            else:
                raise CacheMisuseError(f"icecache: unknown vLLM CPU KV-cache block layout for isa {isa!r} ({dtype}, block {block_size})")
        return cls._known[key]


def read_kv(kv_cache: torch.Tensor, blocks: torch.Tensor, positions: np.ndarray, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[n, H, D]`` (float32 copies) of a request's token ``positions`` from the paged cache
    ``kv_cache`` ``[num_blocks, H, block_size, 2 * D]``; ``blocks`` is the request's block-table row."""
    NB, H, BS, D2 = kv_cache.shape
    D = D2 // 2
    pos = torch.from_numpy(np.asarray(positions, dtype=np.int64))
    blk = blocks[pos // BS].long()
    off = pos % BS
    halves = kv_cache.view(NB, H, 2, BS * D)
    if transposed:
        k = halves[:, :, 0].unflatten(-1, (D, BS))[blk, :, :, off]  # [n, H, D]
    else:
        k = halves[:, :, 0].unflatten(-1, (BS, D))[blk, :, off, :]
    v = halves[:, :, 1].unflatten(-1, (BS, D))[blk, :, off, :]
    return k.to(torch.float32), v.to(torch.float32)


# ---------------------------------------------------------------------------------------------- request state
@dataclass
class LayerState:
    pagers: list[Any]  # one per KV head
    inserted_until: int  # absolute positions [sink, inserted_until) are in the pagers


@dataclass
class RequestState:
    """The pagers of one request, per sparse layer (created on first use)."""

    blocks: tuple[int, ...] = ()  # block-table prefix the pagers were fed from
    layers: dict[int, LayerState] = field(default_factory=dict)


class RequestStates:
    """Per-process map request id -> `RequestState` (the CPU platform runs one worker process)."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def drop_except(self, live: Any) -> None:
        gone = [r for r in self.states if r not in live]
        for rid in gone:
            del self.states[rid]
        if gone:
            logger.info("icecache: freed the pagers of %d finished request(s); %d live", len(gone), len(self.states))

    def for_row(self, rid: str, block_row: torch.Tensor, seq_len: int, block_size: int) -> RequestState:
        """The state of ``rid``; rebuilt when the request's blocks changed (preempted and rescheduled)."""
        n_blocks = -(-seq_len // block_size)
        blocks = tuple(block_row[:n_blocks].tolist())
        st = self.states.get(rid)
        if st is None or blocks[: len(st.blocks)] != st.blocks:
            logger.info("icecache: request %s decodes sparse from context %d%s", rid, seq_len,
                        "" if st is None else " (rebuilt: its blocks changed)")
            st = self.states[rid] = RequestState()
        st.blocks = blocks
        return st


STATES = RequestStates()


def find_runner() -> Any:
    """vLLM's model runner: ``self`` of the first calling frame that has ``input_batch`` and ``requests``."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and hasattr(obj, "input_batch") and hasattr(obj, "requests"):
            return obj
        frame = frame.f_back
    return None


# ---------------------------------------------------------------------------------------------- config
_CONFIGS: dict[str, IceCacheConfig | None] = {}


def current_config() -> IceCacheConfig | None:
    """The IceCache config of the vLLM run being built (read inside vLLM's config context; cached)."""
    import json

    extra = get_current_vllm_config().additional_config
    key = json.dumps(extra, sort_keys=True, default=str)
    if key not in _CONFIGS:
        _CONFIGS[key] = icecache_config(extra)
    return _CONFIGS[key]


# ---------------------------------------------------------------------------------------------- backend
@dataclass
class SparseRow:
    """One decode row that runs sparse this step."""

    token: int  # index of its query token in the batch
    seq_len: int  # context length including the current token
    blocks: torch.Tensor  # its block-table row
    state: RequestState


class IceCacheCPUBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.ice = icecache_config(vllm_config.additional_config)

    def build(self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False) -> Any:
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        md.icecache_rows = []
        cfg = self.ice
        if cfg is None or self.is_cross_attention or self.is_encoder_only_attention:
            return md
        threshold = cfg.sink + cfg.window + cfg.budget
        num_reqs = common_attn_metadata.num_reqs
        qsl = common_attn_metadata.query_start_loc_cpu.tolist()
        seq_lens = common_attn_metadata.seq_lens.cpu().tolist()
        rows = [i for i in range(num_reqs) if qsl[i + 1] - qsl[i] == 1 and seq_lens[i] > threshold]
        runner = find_runner()
        if runner is None:
            if rows:
                raise CacheMisuseError("icecache: cannot find vLLM's model runner to map batch rows to requests (vLLM other than 0.32.0?)")
            return md
        req_ids = runner.input_batch.req_ids
        STATES.drop_except(runner.requests)
        if len(req_ids) < num_reqs:  # a dummy (profiling / warm-up) batch
            return md
        bt = common_attn_metadata.block_table_tensor
        for i in rows:
            st = STATES.for_row(req_ids[i], bt[i], seq_lens[i], self.block_size)
            md.icecache_rows.append(SparseRow(qsl[i], seq_lens[i], bt[i], st))
        return md


class IceCacheCPUImpl(CPUAttentionBackendImpl):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ice = current_config()
        if self.ice is not None:
            check_index(self.ice, self.head_size)
            logger.info_once(f"icecache: sparse decode on: {self.ice}")
            if self.num_heads % self.num_kv_heads:
                raise ConfigError(f"icecache: {self.num_heads} query heads do not split into {self.num_kv_heads} KV heads")
        self.layer_idx: int | None = None

    def forward(self, layer: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any, output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        rows = getattr(attn_metadata, "icecache_rows", None)
        if rows and self.layer_idx is None:
            self.layer_idx = extract_layer_index(layer.layer_name)
        if not rows or self.ice is None or self.sliding_window != -1 or self.layer_idx in self.ice.dense_layers:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        if len(rows) < attn_metadata.query_start_loc.shape[0] - 1:  # rows that stay dense: vLLM's kernel for all
            super().forward(layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale)
        NB, H, BS, _ = kv_cache.shape
        transposed = KVLayout.keys_transposed(layer.isa, kv_cache.dtype, BS, self.head_size)
        for row in rows:
            o = self._sparse_row(query[row.token], kv_cache, row, transposed)
            output[row.token].copy_(o.to(output.dtype).view_as(output[row.token]))
        return output

    def _sparse_row(self, q: torch.Tensor, kv_cache: torch.Tensor, row: SparseRow, transposed: bool) -> torch.Tensor:
        """Attention of one decode query ``q`` ``[Hq, D]`` over sink + selected middle + window."""
        cfg = self.ice
        S, W, T = cfg.sink, cfg.window, row.seq_len
        H, D = self.num_kv_heads, self.head_size
        ls = row.state.layers.get(self.layer_idx)
        if ls is None:  # first sparse step of this request here: build as if the prompt were T - 1 tokens
            from icecache.indexes import make_pager

            ls = LayerState([make_pager(cfg.index, head_dim=D, page_size=cfg.page_size, seed=cfg.seed, **cfg.index_params)
                             for _ in range(H)], S)
            end = max(S, T - 1 - W)
            k, _ = read_kv(kv_cache, row.blocks, np.arange(S, end), transposed)
            for h in range(H):
                ls.pagers[h].build(k[:, h].contiguous())
            ls.inserted_until = end
            row.state.layers[self.layer_idx] = ls
        if ls.inserted_until < T - W:  # tokens that left the window since the last step, one by one
            k, _ = read_kv(kv_cache, row.blocks, np.arange(ls.inserted_until, T - W), transposed)
            for j in range(k.shape[0]):
                for h in range(H):
                    ls.pagers[h].insert(k[j : j + 1, h].contiguous(), check=False)
            ls.inserted_until = T - W
        qg = q.detach().to(torch.float32).reshape(H, -1, D)
        selected = [select_pages(ls.pagers[h], qg[h].contiguous(), cfg.budget, cfg.gqa)[2] for h in range(H)]
        n_sel = max((len(p) for p in selected), default=0)
        fixed = np.concatenate([np.arange(S), np.arange(T - W, T)])
        L = len(fixed) + n_sel
        keys = torch.zeros(1, H, L, D)
        values = torch.zeros(1, H, L, D)
        valid = torch.zeros(1, H, L, dtype=torch.bool)
        kf, vf = read_kv(kv_cache, row.blocks, fixed, transposed)  # [n, H, D]
        keys[0, :, : len(fixed)] = kf.transpose(0, 1)
        values[0, :, : len(fixed)] = vf.transpose(0, 1)
        valid[0, :, : len(fixed)] = True
        for h, pos in enumerate(selected):
            if len(pos):
                ks, vs = read_kv(kv_cache, row.blocks, np.asarray(pos) + S, transposed)
                keys[0, h, len(fixed) : len(fixed) + len(pos)] = ks[:, h]
                values[0, h, len(fixed) : len(fixed) + len(pos)] = vs[:, h]
                valid[0, h, len(fixed) : len(fixed) + len(pos)] = True
        out = sparse_attention_cpu(qg[None], keys, values, valid, self.scale)  # [1, H, n_rep, D]
        return out.reshape(-1, D)


class IceCacheCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend with IceCache's sparse decode (see the module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[IceCacheCPUImpl]:
        return IceCacheCPUImpl

    @staticmethod
    def get_builder_cls() -> type[IceCacheCPUBuilder]:
        return IceCacheCPUBuilder
