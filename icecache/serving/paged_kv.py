"""Reading a request's keys and values out of vLLM's paged CPU KV cache (the vLLM plugin's data path).

vLLM's CPU backend keeps one layer's cache as ``kv_cache`` ``[num_blocks, H, block_size, 2 * D]``: per (block,
KV head), the first ``block_size * D`` numbers are the keys, stored ``[block_size, D]`` or, for the ``vec`` ISA,
transposed ``[D, block_size]`` (`KVLayout` finds out which), the second half the values ``[block_size, D]``. A
request's token ``p`` lives in block ``blocks[p // block_size]`` at offset ``p % block_size``, ``blocks`` being
its block-table row. Only `KVLayout` needs vLLM (imported when first asked).
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit

from icecache.core.errors import CacheMisuseError


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


def _gather_kv_heads_torch(kv_cache: torch.Tensor, blocks: torch.Tensor, positions: np.ndarray, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_kv_heads` in torch ops (any cache dtype; the reference of the numba kernel)."""
    NB, H, BS, D2 = kv_cache.shape
    D = D2 // 2
    pos = torch.from_numpy(np.ascontiguousarray(positions, np.int64))
    blk = blocks.long()[pos // BS]  # [H, L]
    off = pos % BS
    head = torch.arange(H)[:, None].expand_as(pos)
    halves = kv_cache.view(NB, H, 2, BS * D)
    if transposed:
        k = halves[:, :, 0].unflatten(-1, (D, BS))[blk, head, :, off]  # [H, L, D]
    else:
        k = halves[:, :, 0].unflatten(-1, (BS, D))[blk, head, off, :]
    v = halves[:, :, 1].unflatten(-1, (BS, D))[blk, head, off, :]
    return k.to(torch.float32), v.to(torch.float32)


@njit(nogil=True, cache=True)
def _gather_kv_heads_f32(cache: np.ndarray, blocks: np.ndarray, positions: np.ndarray, transposed: bool,
                         keys: np.ndarray, values: np.ndarray) -> None:
    """``cache`` ``[num_blocks, H, 2 * block_size * D]`` float32; fills ``keys``/``values`` ``[H, L, D]``.
    Transposed keys are read dimension by dimension across the positions: the tokens of a selected page are
    neighbours in a block, so each dimension's values for them share a cache line."""
    H, L = positions.shape
    D = keys.shape[2]
    BS = cache.shape[2] // (2 * D)
    block = np.empty(L, np.int64)
    off = np.empty(L, np.int64)
    staged = np.empty((D, L), np.float32)
    for h in range(H):
        for i in range(L):  # one division per token, not per number
            block[i] = blocks[positions[h, i] // BS]
            off[i] = positions[h, i] % BS
        if transposed:  # gathered as [D, L] (reads of a page share cache lines), then transposed in cache
            for d in range(D):
                for i in range(L):
                    staged[d, i] = cache[block[i], h, d * BS + off[i]]
            for i in range(L):
                for d in range(D):
                    keys[h, i, d] = staged[d, i]
        for i in range(L):
            row = cache[block[i], h]
            if not transposed:
                for d in range(D):
                    keys[h, i, d] = row[off[i] * D + d]
            base = BS * D + off[i] * D
            for d in range(D):
                values[h, i, d] = row[base + d]


def gather_kv_heads(kv_cache: torch.Tensor, blocks: torch.Tensor, positions: np.ndarray, transposed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V ``[H, L, D]`` (float32) where KV head ``h`` reads the request's tokens ``positions[h]``
    (``positions`` ``[H, L]`` int64): one call for every head. float32 caches take a numba kernel (one pass,
    no index tensors), others the torch gather."""
    if kv_cache.dtype != torch.float32 or not kv_cache.is_contiguous():
        return _gather_kv_heads_torch(kv_cache, blocks, positions, transposed)
    NB, H, BS, D2 = kv_cache.shape
    D = D2 // 2
    L = positions.shape[1]
    keys = np.empty((H, L, D), np.float32)
    values = np.empty((H, L, D), np.float32)
    block_ids = blocks.numpy() if blocks.dtype in (torch.int32, torch.int64) else blocks.long().numpy()
    _gather_kv_heads_f32(kv_cache.numpy().reshape(NB, H, BS * D2), block_ids, np.ascontiguousarray(positions, np.int64),
                         transposed, keys, values)
    return torch.from_numpy(keys), torch.from_numpy(values)
