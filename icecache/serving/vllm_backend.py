"""`IceCacheCPUBackend`: vLLM's CPU attention backend with IceCache's sparse decode (docs/serving.md).

Without ``additional_config["icecache"]`` every method is vLLM's own (`CPUAttentionBackend`, its builder and
impl), so output is token-for-token that of stock vLLM. With it, a decode row (query length 1) of a request
whose context exceeds ``sink + window + budget`` attends, on every layer outside ``dense_layers``, over its
first ``sink`` tokens, its last ``window`` tokens (the current one included) and the ``budget`` middle tokens
that the request's pager of that (layer, KV head) selects for the step's query group, as the HF runtime
(`icecache.runtime.layer`) does; with ``top_p`` only the shortest best-ranked prefix of those pages whose estimated
attention mass reaches it (`icecache.core.top_p`; the log line that frees a request reports the middle tokens
attended per selection). Everything else (prefill and chunked prefill, short contexts, dense layers,
sliding-window layers) is vLLM's dense kernel.

Pagers live in the worker process, one `RequestState` per request: built lazily at the request's first
sparse decode step from the keys in vLLM's paged KV cache (positions ``[sink, T - 1 - window)``, as if the
prompt had just been prefilled, then the token leaving the window inserted, the order of the HF runtime) and
fed, every step, the tokens that left the window since. Keys and values are read from the paged cache
through the request's block-table row (`KVLayout` knows how the CPU kernel lays a block out).

Request identity (design choice): the builder reads the row -> request-id map of the worker's model runner
(``input_batch.req_ids``, the runner being ``self`` of a caller's frame). A request's state is freed when the
runner drops its request object (finished or aborted; `RequestStates`) and when the step's scheduler output
(a local of the runner's ``execute_model``) names it preempted; when it is scheduled again, its state is
rebuilt from the cache.
Limits: this relies on private internals of vLLM 0.32.0's V1 runner (pinned by the serve environment; the
builder fails with a one-line error if it cannot find them); one worker process (the CPU platform's default);
in a batch that mixes sparse and dense rows the dense kernel also runs for the sparse ones (their output is
then overwritten); selection and gathering are per-row Python, so decode is not yet faster than dense.
The KV-connector route (lifecycle events without the stack walk) is not implemented.
"""

from __future__ import annotations

import sys
import time
import weakref
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
from icecache.runtime.selection import select_layer
from icecache.serving.paged_kv import KVLayout, gather_kv_heads
from icecache.serving.vllm_plugin import check_index, icecache_config

logger = init_logger("vllm.icecache")  # under "vllm": vLLM configures only its own loggers


# ---------------------------------------------------------------------------------------------- request state
@dataclass
class LayerState:
    pagers: list[Any]  # one per KV head
    inserted_until: int  # absolute positions [sink, inserted_until) are in the pagers


#: stages of a sparse decode row, timed per request (logged when its state is freed)
STAGES = ("build", "insert", "select", "gather", "attend")


@dataclass
class RequestState:
    """The pagers of one request, per sparse layer (created on first use)."""

    blocks: tuple[int, ...] = ()  # block-table prefix the pagers were fed from
    layers: dict[int, LayerState] = field(default_factory=dict)
    #: seconds spent per stage of the sparse decode (build, insert, select, gather, attend), all layers and steps
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    layer_steps: int = 0  # sparse (layer, step) pairs decoded
    selections: int = 0  # (layer, step, KV head) selections made
    tokens_selected: int = 0  # middle tokens they selected (fewer than the budget with ``top_p``)

    def stage_summary(self) -> str:
        """``"84 layer-steps: build 0.41 s, insert 0.01 s, ...; 256.0 middle tokens per selection"`` for the log
        line that frees the state."""
        per = self.tokens_selected / self.selections if self.selections else 0.0
        return (f"{self.layer_steps} layer-steps: " + ", ".join(f"{k} {v:.3f} s" for k, v in self.seconds.items())
                + f"; {per:.1f} middle tokens per selection")



class RequestStates:
    """Per-process map request id -> `RequestState` (the CPU platform runs one worker process).

    A state is freed when vLLM frees the request: its runner drops the request's `CachedRequestState` when the
    request finishes or is aborted (a finalizer on that object), and the builder frees the requests that the
    step's scheduler output names as preempted (rebuilt from the cache when they come back). Requests merely
    absent from a batch keep their state (pipeline parallelism keeps several batches in flight)."""

    def __init__(self) -> None:
        self.states: dict[str, RequestState] = {}

    def bytes_held(self) -> int:
        """Bytes of index memory held by every live request's pagers (`SemanticPager.index_bytes`)."""
        return sum(p.index_bytes() for st in self.states.values() for ls in st.layers.values() for p in ls.pagers)

    def release(self, rid: str, state: RequestState | None = None, why: str = "finished") -> None:
        """Free the pagers of ``rid`` (only if they are still ``state``, when given: ids can be reused)."""
        st = self.states.get(rid)
        if st is None or (state is not None and st is not state):
            return
        del self.states[rid]
        logger.info("icecache: freed the pagers of request %s (%s); %d live, %d index bytes held; it took %s",
                    rid, why, len(self.states), self.bytes_held(), st.stage_summary())

    def keep_only(self, live: Any, why: str) -> None:
        """Free every state whose request id is not in ``live``."""
        for rid in [r for r in self.states if r not in live]:
            self.release(rid, why=why)

    def for_row(self, rid: str, block_row: torch.Tensor, seq_len: int, block_size: int, owner: Any = None) -> RequestState:
        """The state of ``rid``; rebuilt when the request's blocks changed (preempted and rescheduled).
        ``owner`` (vLLM's per-request object) frees the state when it is garbage-collected."""
        n_blocks = -(-seq_len // block_size)
        blocks = tuple(block_row[:n_blocks].tolist())
        st = self.states.get(rid)
        if st is None or blocks[: len(st.blocks)] != st.blocks:
            logger.info("icecache: request %s decodes sparse from context %d%s", rid, seq_len,
                        "" if st is None else " (rebuilt: its blocks changed)")
            st = self.states[rid] = RequestState()
            if owner is not None:
                weakref.finalize(owner, self.release, rid, st)
        st.blocks = blocks
        return st


STATES = RequestStates()


def find_runner() -> tuple[Any, Any]:
    """vLLM's model runner (``self`` of the first calling frame that has ``input_batch`` and ``requests``) and the
    step's ``scheduler_output`` (a local of the runner's ``execute_model``); None for what is not found."""
    runner = sched = None
    frame = sys._getframe(1)
    while frame is not None and (runner is None or sched is None):
        local = frame.f_locals
        obj = local.get("self")
        if runner is None and obj is not None and hasattr(obj, "input_batch") and hasattr(obj, "requests"):
            runner = obj
        out = local.get("scheduler_output")
        if sched is None and out is not None and hasattr(out, "preempted_req_ids"):
            sched = out
        frame = frame.f_back
    return runner, sched


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
        # Candidates: one query token past sink + window + budget. Which of them decode is known from the runner.
        rows = [i for i in range(num_reqs) if qsl[i + 1] - qsl[i] == 1 and seq_lens[i] > threshold]
        runner, sched = find_runner()
        if runner is None:
            if rows:
                raise CacheMisuseError("icecache: cannot find vLLM's model runner to map batch rows to requests (vLLM other than 0.32.0?)")
            return md
        req_ids = runner.input_batch.req_ids
        STATES.keep_only(runner.requests, "finished")
        if len(req_ids) < num_reqs:  # a dummy (profiling / warm-up) batch
            return md
        for rid in (sched.preempted_req_ids or ()) if sched is not None else ():
            STATES.release(rid, why="preempted")
        # A prompt token is never decoded sparsely: with prefix caching a repeated prompt recomputes only its last
        # token, and a chunked prefill may end in a one-token chunk; both have query length 1. A row decodes only
        # once the token it computes comes after the prompt (position seq_len - 1 >= the prompt's length).
        prompt_lens = runner.input_batch.num_prompt_tokens
        rows = [i for i in rows if seq_lens[i] > int(prompt_lens[i])]
        bt = common_attn_metadata.block_table_tensor
        for i in rows:
            st = STATES.for_row(req_ids[i], bt[i], seq_lens[i], self.block_size, owner=runner.requests.get(req_ids[i]))
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
        clock = row.state.seconds
        t0 = time.perf_counter()
        ls = row.state.layers.get(self.layer_idx)
        if ls is None:  # first sparse step of this request here: build as if the prompt were T - 1 tokens
            from icecache.indexes import make_pager

            ls = LayerState([make_pager(cfg.index, head_dim=D, page_size=cfg.page_size, seed=cfg.seed, **cfg.index_params)
                             for _ in range(H)], S)
            end = max(S, T - 1 - W)
            k, _ = gather_kv_heads(kv_cache, row.blocks, np.broadcast_to(np.arange(S, end), (H, end - S)), transposed)
            for h in range(H):
                ls.pagers[h].build(k[h])
            ls.inserted_until = end
            row.state.layers[self.layer_idx] = ls
        t1 = time.perf_counter()
        if ls.inserted_until < T - W:  # tokens that left the window since the last step, one by one
            leaving = np.arange(ls.inserted_until, T - W)
            k, _ = gather_kv_heads(kv_cache, row.blocks, np.broadcast_to(leaving, (H, len(leaving))), transposed)
            for j in range(len(leaving)):
                insert_row(ls.pagers, k[:, j])
            ls.inserted_until = T - W
        t2 = time.perf_counter()
        qg = q.detach().to(torch.float32).reshape(H, -1, D)
        # every KV head in one call where the pager class has one (mdci, exact, Quest pages: `select_layer`)
        selected = select_layer([ls.pagers], qg[None], cfg.budget, cfg.gqa, layer_idx=self.layer_idx, top_p=cfg.top_p,
                                scale=self.scale).positions[0]
        t3 = time.perf_counter()
        row.state.selections += H
        row.state.tokens_selected += sum(len(p) for p in selected)
        n_sel = max((len(p) for p in selected), default=0)
        F = S + W
        positions = np.empty((H, F + n_sel), np.int64)
        positions[:, :S] = np.arange(S)
        positions[:, S:F] = np.arange(T - W, T)
        valid = np.ones((H, F + n_sel), np.bool_)
        for h, pos in enumerate(selected):  # middle positions; a head that selected fewer pads with masked slots
            positions[h, F : F + len(pos)] = np.asarray(pos) + S
            positions[h, F + len(pos) :] = 0
            valid[h, F + len(pos) :] = False
        keys, values = gather_kv_heads(kv_cache, row.blocks, positions, transposed)  # [H, L, D]
        t4 = time.perf_counter()
        out = sparse_attention_cpu(qg[None], keys[None], values[None], torch.from_numpy(valid)[None], self.scale)  # [1, H, n_rep, D]
        t5 = time.perf_counter()
        clock["build"] += t1 - t0
        clock["insert"] += t2 - t1
        clock["select"] += t3 - t2
        clock["gather"] += t4 - t3
        clock["attend"] += t5 - t4
        row.state.layer_steps += 1
        return out.reshape(-1, D)


def insert_row(pagers: list[Any], keys: torch.Tensor) -> None:
    """Insert one token's keys ``[H, D]`` (float32, finite) into a row's pagers: in one call where the pager class
    has a layer insert (``insert_layer_stored``: mdci; the plugin keeps no host store, so nothing is written
    beside the index), else head by head."""
    cls = type(pagers[0])
    layer_insert = getattr(cls, "insert_layer_stored", None)
    if layer_insert is None or any(type(p) is not cls for p in pagers):
        for h, pager in enumerate(pagers):
            pager.insert(keys[h : h + 1], check=False)
        return
    nothing = np.zeros(tuple(keys.shape), np.float32)  # K/V for a store there is not
    layer_insert(pagers, np.ascontiguousarray(keys.numpy(), dtype=np.float32), [_NO_ROWS] * len(pagers), [_NO_BLOCKS] * len(pagers), nothing,
                 nothing)


_NO_ROWS = np.zeros((0, 2, 1), np.float32)  # no host store: every page is without a block
_NO_BLOCKS = np.zeros(0, np.int64)


class IceCacheCPUBackend(CPUAttentionBackend):
    """vLLM's CPU backend with IceCache's sparse decode (see the module docstring)."""

    @staticmethod
    def get_impl_cls() -> type[IceCacheCPUImpl]:
        return IceCacheCPUImpl

    @staticmethod
    def get_builder_cls() -> type[IceCacheCPUBuilder]:
        return IceCacheCPUBuilder
