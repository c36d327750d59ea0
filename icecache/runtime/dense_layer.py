"""`GrowingLayer`: a full-KV cache layer that appends in place (the dense layers of `IceCache`).

transformers' `DynamicLayer` appends with ``torch.cat``: every decode step copies the whole layer's K and V into
a fresh tensor and frees the old one, O(context) memory traffic per step plus a large allocation and free per
step (which keeps glibc's heap from settling: RSS wanders). This layer keeps K and V in buffers
``[batch, kv_heads, capacity, head_dim]`` with spare capacity and writes new tokens into them; ``keys`` and
``values`` are views of the filled part, so attention reads exactly what a `DynamicLayer` would return.
Capacity grows by a quarter (at least `MIN_GROWTH` tokens) when full: amortised O(1) copies per token, at
most ~25% spare memory.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from icecache.core.errors import CacheMisuseError

#: smallest capacity increase, in tokens
MIN_GROWTH = 64


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` that appends into spare capacity instead of concatenating.

    ``keys``/``values`` ``[B, H, T, D]`` are views of the buffers ``[B, H, capacity, D]``. The base class's
    methods that replace them (crop, batch selection, beam reorder, offload) keep working: the next `update`
    adopts whatever tensors they left.
    """

    def __init__(self) -> None:
        super().__init__()
        self._kbuf: torch.Tensor | None = None
        self._vbuf: torch.Tensor | None = None
        self._len = 0

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold before they grow (0 before the first update)."""
        return 0 if self._kbuf is None else int(self._kbuf.shape[-2])

    def _views_are_ours(self) -> bool:
        k, v, kb, vb = self.keys, self.values, self._kbuf, self._vbuf
        if kb is None or vb is None or k is None or v is None or k.dim() != 4:
            return False
        return all(t.data_ptr() == b.data_ptr() and t.stride() == b.stride() and t.shape[:2] == b.shape[:2] and t.shape[-1] == b.shape[-1]
                   for t, b in ((k, kb), (v, vb)))

    def _adopt(self) -> None:
        """Take over the current ``keys``/``values`` (after the base class replaced them, or at the first update)."""
        if self._views_are_ours():  # a crop shortened the views: same buffers
            self._len = int(self.keys.shape[-2])
            return
        if self.keys is None or self.keys.numel() == 0:
            self._kbuf = self._vbuf = None
            self._len = 0
            return
        self._kbuf, self._vbuf = self.keys.contiguous(), self.values.contiguous()
        self._len = int(self._kbuf.shape[-2])

    def _grow(self, need: int, like_k: torch.Tensor, like_v: torch.Tensor) -> None:
        cap = need + max(need // 4, MIN_GROWTH)
        B, H, _, D = like_k.shape
        kb = torch.empty(B, H, cap, D, dtype=like_k.dtype, device=like_k.device)
        vb = torch.empty(B, H, cap, like_v.shape[-1], dtype=like_v.dtype, device=like_v.device)
        if self._len:
            kb[:, :, : self._len].copy_(self._kbuf[:, :, : self._len])
            vb[:, :, : self._len].copy_(self._vbuf[:, :, : self._len])
        self._kbuf, self._vbuf = kb, vb

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, cache_kwargs: dict[str, Any] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``key_states``/``value_states`` ``[B, H, t, D]``; returns K and V ``[B, H, T, D]`` (views)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._adopt()
        t = int(key_states.shape[-2])
        need = self._len + t
        if self._kbuf is not None and self._kbuf.shape[:2] != key_states.shape[:2]:
            raise CacheMisuseError(f"cache layer holds batch/heads {tuple(self._kbuf.shape[:2])}, update has {tuple(key_states.shape[:2])}")
        if self._kbuf is None or need > self._kbuf.shape[-2]:
            self._grow(need, key_states, value_states)
        self._kbuf[:, :, self._len : need].copy_(key_states)
        self._vbuf[:, :, self._len : need].copy_(value_states)
        self._len = need
        self.keys = self._kbuf[:, :, :need]
        self.values = self._vbuf[:, :, :need]
        return self.keys, self.values

    def release(self) -> None:
        """Drop the buffers (the cache's `close`); the layer is uninitialised afterwards."""
        self._kbuf = self._vbuf = self.keys = self.values = None
        self._len = 0
        self.is_initialized = False

    def reserved_bytes(self) -> int:
        """Bytes of the buffers, spare capacity included."""
        return 0 if self._kbuf is None else self._kbuf.nbytes + self._vbuf.nbytes  # type: ignore[union-attr]
