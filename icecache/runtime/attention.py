"""The ``"icecache"`` attention function, registered in transformers' `AttentionInterface` and
`AttentionMaskInterface` when `icecache` is imported.

Prefill (``q_len > 1``) and dense / sliding layers run transformers' own SDPA attention on the K/V the cache
returned (`dense_attention`). Decode (``q_len == 1``) on a sparse layer attends over the layer's device buffer
(sink + selected pages + window) after selection and bulk loading. Without an IceCache (a plain `DynamicCache`,
or ``use_cache=False``) it is SDPA.

A sliding-window layer's prefill (Gemma-3: 15 of 18 layers, 512-token windows) gets a mask that hides all but
``window`` keys from each query, yet SDPA computes every query against every key: at 8k tokens that was 18 of a
30 s prefill (2 threads). `dense_attention` answers such a prefill in blocks of ``window`` queries, each against
only the keys its rows of the mask let through (SDPA on those blocks, with those rows of the mask): the same
attention, summed over fewer masked-out zeros, so equal to the one-call result up to float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from icecache.runtime import link

# `import icecache` imports this module and nothing else of ours: `icecache.core` (numba-compiled page tables)
# loads only when an error is raised.

ATTENTION_NAME = "icecache"
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks")


def _valid_from_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """Non-padding tokens ``[B, T]`` from the prefill mask ``[B, 1, q, T]`` (bool or additive float)."""
    if mask is None:
        return None
    last = mask[:, 0, -1, :]
    return last if last.dtype == torch.bool else last == 0


def _visible_span(mask: torch.Tensor, start: int, end: int, lo: int) -> bool:
    """Whether query rows ``start:end`` of ``mask`` ``[B, 1, q, T]`` (bool: True attends; float: additive) hide
    every key before ``lo`` and from ``end`` on, so that keys ``lo:end`` are all they see."""
    rows = mask[:, :, start:end]
    outside = torch.cat([rows[..., :lo], rows[..., end:]], dim=-1)
    if outside.numel() == 0:
        return True
    return not bool(outside.any()) if outside.dtype == torch.bool else bool((outside == float("-inf")).all())


def dense_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention; a sliding-window prefill (``query`` ``[B, Hq, q, D]`` against as many keys,
    ``q`` over twice the window) in blocks of ``window`` queries, each against the keys the mask shows it (see
    the module docstring). Falls back to one SDPA call when the mask shows a block more keys than its window
    (padding or a mask of another shape): the blocks are taken only where the mask itself hides the rest."""
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    q, t = query.shape[2], key.shape[2]
    if not window or attention_mask is None or q != t or q <= 2 * window or attention_mask.shape[-2] != q:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    spans = [(start, min(start + window, q), max(0, start - window + 1)) for start in range(0, q, window)]
    if not all(_visible_span(attention_mask, start, end, lo) for start, end, lo in spans):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    outs = [sdpa_attention_forward(module, query[:, :, start:end], key[:, :, lo:end], value[:, :, lo:end],
                                   attention_mask[:, :, start:end, lo:end], dropout=dropout, scaling=scaling, **kwargs)[0]
            for start, end, lo in spans]
    return torch.cat(outs, dim=1), None


def icecache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention for one layer. ``query`` ``[B, Hq, q, D]``; returns ``([B, q, Hq, D], None)``."""
    pending = link.consume()
    if pending is None:
        return dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    cache, layer_idx = pending
    if layer_idx != getattr(module, "layer_idx", layer_idx):
        from icecache.core.errors import CacheMisuseError

        raise CacheMisuseError(f"IceCache was updated for layer {layer_idx} but attention runs layer {module.layer_idx}")
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            from icecache.core.errors import CacheMisuseError

            raise CacheMisuseError(f"IceCache does not support the attention feature {name!r} of this model")
    kind = cache.kind[layer_idx]
    if kind != "sparse" or query.shape[2] > 1:
        out = dense_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if kind == "sparse":
            cache.layers[layer_idx].finish_prefill(_valid_from_mask(attention_mask))
        return out
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return cache.layers[layer_idx].attend(query, scale, cache.shared_selection(layer_idx)), None


def register_attention() -> None:
    """Register ``"icecache"`` with transformers' attention and mask registries (idempotent). Importing
    `icecache.runtime` (any of its modules: `IceCache`, `load_model`, `generate`) does it; call it yourself
    to select ``attn_implementation="icecache"`` on a model before touching the runtime."""
    AttentionInterface.register(ATTENTION_NAME, icecache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@contextlib.contextmanager
def use_attention(model: Any, name: str = ATTENTION_NAME) -> Iterator[None]:
    """Switch ``model`` to the attention implementation ``name`` for the duration of the block.

    The previous implementation is restored on exit, also when the block raises. ``"icecache"`` is registered
    first if needed; any other name must already be known to transformers (``"sdpa"``, ``"eager"``, ...).
    """
    if name == ATTENTION_NAME:
        register_attention()
    previous = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)
