"""Evaluation plumbing: prefill a prompt once, then decode it under any number of methods.

Prefill is dense for every method, so the harness runs it once per sample (`run_prefill`, which also
records the observation-window queries SnapKV needs) and hands the same K/V to each method's cache
(`IceCache.load_prefill`); the results are identical to prefilling through each cache, at a fraction of
the cost. Decoding is a plain greedy loop (`decode_greedy`) or teacher forcing (`decode_forced`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from icecache.core.errors import ConfigError
from icecache.measure.capture import recording
from icecache.runtime.attention import ATTENTION_NAME, use_attention

__all__ = ["check_fits_context", "Prefill", "run_prefill", "clone_kv", "growing_kv", "GrowingLayer", "decode_greedy", "decode_forced"]


def check_fits_context(model: Any, lengths: Iterable[int]) -> None:
    """Refuse (`ConfigError`) prompt lengths, in tokens, beyond the model's context (``max_position_embeddings``):
    a long evaluation past what the model was trained on would measure nothing. No-op when the model states none."""
    from icecache.runtime.generate import model_context

    context = model_context(model)
    too_long = sorted({int(n) for n in lengths if context is not None and n > context})
    if too_long:
        raise ConfigError(
            f"length {', '.join(map(str, too_long))} is past the model's context of {context} tokens "
            f"(max_position_embeddings); lengths up to {context} fit"
        )


@dataclass
class Prefill:
    """A prompt's dense prefill, shared by every method evaluated on it."""

    input_ids: torch.Tensor  # [1, T]
    kv: DynamicCache  # full K/V of the prompt (never mutated: methods get copies)
    last_logits: torch.Tensor  # [V] logits after the last prompt token
    obs_queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [Hq, w, D] (post-RoPE)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])


@torch.inference_mode()
def run_prefill(model: Any, input_ids: torch.Tensor, obs_window: int = 64) -> Prefill:
    """Dense prefill of ``input_ids`` ``[1, T]`` with a plain `DynamicCache`; records the last ``obs_window``
    queries of every layer (`icecache.measure.capture`, model dtype and device) as ``obs_queries``."""
    kv = DynamicCache()
    with recording(model, last_queries=obs_window, keys=False, values=False, float_cpu=False, min_query_tokens=2) as cap:
        out = model(input_ids, past_key_values=kv, use_cache=True, logits_to_keep=1)
    return Prefill(input_ids=input_ids, kv=kv, last_logits=out.logits[0, -1].float(), obs_queries=cap.queries)


def clone_kv(kv: DynamicCache) -> DynamicCache:
    """A `DynamicCache` holding the same prompt K/V that later decoding can extend independently."""
    out = DynamicCache()
    for i, layer in enumerate(kv.layers):
        out.update(layer.keys, layer.values, i)
    return out


class GrowingLayer(DynamicLayer):
    """A `DynamicLayer` whose K/V ``[B, H, T, D]`` are views of buffers with spare room: a decode step writes its
    token in place instead of concatenating a new copy of the whole layer (what `DynamicLayer` does every step:
    377 MB per step for SmolLM2 at 8k). Attention sees the same values, so outputs are unchanged
    (tests/test_eval.py: 300 forced steps give bit-identical per-token NLL)."""

    #: spare room on each reallocation: a quarter of the length, at least this many tokens
    MIN_SPARE = 256

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self.get_seq_length(), key_states.shape[-2]
        buffers = getattr(self, "_room", None)
        if (buffers is None or n + m > buffers[0].shape[-2]
                or (n and self.keys.data_ptr() != buffers[0].data_ptr())):  # keys replaced from outside: adopt them
            room = n + m + max(self.MIN_SPARE, (n + m) // 4)
            buffers = tuple(torch.empty(*x.shape[:-2], room, x.shape[-1], dtype=x.dtype, device=x.device)
                            for x in (key_states, value_states))
            if n:
                buffers[0][..., :n, :].copy_(self.keys)
                buffers[1][..., :n, :].copy_(self.values)
            self._room = buffers
        buffers[0][..., n:n + m, :].copy_(key_states)
        buffers[1][..., n:n + m, :].copy_(value_states)
        self.keys, self.values = buffers[0][..., :n + m, :], buffers[1][..., :n + m, :]
        return self.keys, self.values


def growing_kv(kv: DynamicCache) -> DynamicCache:
    """A copy of ``kv`` for full-attention decoding whose layers append in place (`GrowingLayer`)."""
    out = DynamicCache()
    out.layers = [GrowingLayer() for _ in kv.layers]
    for i, layer in enumerate(kv.layers):
        out.update(layer.keys, layer.values, i)
    return out


@torch.inference_mode()
def decode_greedy(
    model: Any, cache: Any, first_logits: torch.Tensor, steps: int, stop_ids: set[int] | None = None,
    start_position: int | None = None, stop_when: Callable[[list[int]], bool] | None = None,
) -> list[int]:
    """Greedy tokens after the prompt (the first comes from ``first_logits``); stops early at ``stop_ids``.

    ``start_position``: the RoPE position of the first generated token, for caches that evicted tokens and
    report a physical length (kvpress); our caches report logical lengths and need none.
    ``stop_when(tokens)``: also stop once it returns True (for a score that more tokens cannot change).
    """
    tokens: list[int] = []
    logits = first_logits
    with use_attention(model, ATTENTION_NAME):
        for i in range(steps):
            tok = int(logits.argmax())
            tokens.append(tok)
            if (stop_ids and tok in stop_ids) or i == steps - 1 or (stop_when is not None and stop_when(tokens)):
                break
            kw = {} if start_position is None else {"position_ids": torch.tensor([[start_position + i]])}
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True, **kw)
            logits = out.logits[0, -1].float()
    return tokens


@torch.inference_mode()
def decode_forced(model: Any, cache: Any, first_logits: torch.Tensor, targets: list[int]) -> torch.Tensor:
    """Teacher forcing: negative log-likelihood of each of ``targets`` given everything before it, ``[N]``."""
    nll = torch.empty(len(targets))
    logits = first_logits
    with use_attention(model, ATTENTION_NAME):
        for i, tok in enumerate(targets):
            nll[i] = -torch.log_softmax(logits, dim=-1)[tok]
            if i == len(targets) - 1:
                break
            out = model(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            logits = out.logits[0, -1].float()
    return nll
