"""Capture real post-RoPE keys, values and queries from a transformers model (for index benchmarks).

A custom attention function is registered under ``"icecache_capture"`` in transformers'
``AttentionInterface`` (and ``sdpa_mask`` under the same name in ``AttentionMaskInterface``). It copies the
``key``/``value`` ``[B, H_kv, T, D]`` and the last queries ``[B, H_q, T, D]`` of the layers asked for, then
runs the stock SDPA attention, so the forward pass is unchanged. The model's attention implementation is
switched for the duration of `capture_kv` and restored afterwards (also on error).

Long real text: `long_text` concatenates Python's own documentation (``pydoc_data.topics``, about 113k
tokens for SmolLM2's tokenizer) and, when more is needed, the standard library's ``*.py`` sources.
"""

from __future__ import annotations

import contextlib
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from icecache.eval.harness import attention_impl

CAPTURE_NAME = "icecache_capture"


@dataclass
class Capture:
    """Tensors captured from one forward pass (batch element 0), float32 on the CPU.

    Attributes
    ----------
    keys, values : dict[int, Tensor]
        Layer -> ``[H_kv, T, D]`` post-RoPE keys / values of every position.
    queries : dict[int, Tensor]
        Layer -> ``[H_q, last, D]`` post-RoPE queries of the last ``last`` positions.
    num_tokens : int
        T.
    position_offset : int
        RoPE position of token 0 (positions are ``offset .. offset + T - 1``).
    seconds : float
        Wall time of the forward pass (s).
    past_key_values : Any
        The model's cache after the pass (``keep_cache=True`` only), for timing decode steps.
    """

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0
    position_offset: int = 0
    seconds: float = 0.0
    past_key_values: Any = None


class _Recorder:
    def __init__(self, layers: set[int] | None, last: int) -> None:
        self.layers, self.last = layers, last
        self.out = Capture()


_active: _Recorder | None = None


def _capture_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    rec = _active
    layer = getattr(module, "layer_idx", None)
    if rec is not None and layer is not None and (rec.layers is None or layer in rec.layers):
        rec.out.keys[layer] = key[0].detach().float().cpu().clone()
        rec.out.values[layer] = value[0].detach().float().cpu().clone()
        rec.out.queries[layer] = query[0, :, -rec.last :].detach().float().cpu().clone()
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def register_capture_attention() -> str:
    """Register ``"icecache_capture"`` in transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_NAME, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)
    return CAPTURE_NAME




@contextlib.contextmanager
def _truncated(model: Any, num_layers: int | None) -> Iterator[None]:
    """Run only the first ``num_layers`` decoder layers (the decoder loop reads ``config.num_hidden_layers``)."""
    cfg = model.config
    old = cfg.num_hidden_layers
    if num_layers is not None:
        cfg.num_hidden_layers = min(old, num_layers)
    try:
        yield
    finally:
        cfg.num_hidden_layers = old


def capture_kv(
    model: Any,
    input_ids: torch.Tensor,
    *,
    layers: Iterable[int] | None = None,
    last_queries: int = 32,
    position_offset: int = 0,
    keep_cache: bool = False,
) -> Capture:
    """One forward pass of ``model``'s decoder over ``input_ids`` ``[1, T]``, recording K/V/Q.

    Parameters
    ----------
    model : transformers causal LM (Llama-like: ``model.model`` is the decoder stack)
    input_ids : LongTensor ``[1, T]``
    layers : iterable of int, optional
        Layers to record (default all). Only layers up to the largest one asked for are run.
    last_queries : int
        Record the queries of the last this many positions.
    position_offset : int
        RoPE position of the first token (``position_ids = offset + arange(T)``), so that windows of a long
        text captured separately carry the rotations of one long context.
    keep_cache : bool
        Run with ``use_cache=True`` (all layers) and keep the cache in the result, for decode-step timing.
    """
    global _active
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
    wanted = None if layers is None else {int(l) for l in layers}
    run_layers = None if (wanted is None or keep_cache) else max(wanted) + 1
    register_capture_attention()
    rec = _Recorder(wanted, last_queries)
    T = input_ids.shape[1]
    pos = torch.arange(position_offset, position_offset + T).unsqueeze(0)
    _active = rec
    try:
        with attention_impl(model, CAPTURE_NAME), _truncated(model, run_layers), torch.inference_mode():
            t0 = time.perf_counter()
            out = model.model(input_ids=input_ids, position_ids=pos, use_cache=keep_cache)
            rec.out.seconds = time.perf_counter() - t0
    finally:
        _active = None
    rec.out.num_tokens = T
    rec.out.position_offset = position_offset
    if keep_cache:
        rec.out.past_key_values = out.past_key_values
    return rec.out


def time_decode_steps(model: Any, past_key_values: Any, start_token: int, num_steps: int = 5) -> list[float]:
    """Wall time (s) of ``num_steps`` full-attention decode forward passes (lm head included) on top of a
    prefilled cache. The cache grows by one position per step."""
    times = []
    tok = torch.tensor([[start_token]])
    with torch.inference_mode():
        for _ in range(num_steps):
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=past_key_values, use_cache=True)
            times.append(time.perf_counter() - t0)
            past_key_values = out.past_key_values
            tok = out.logits[:, -1:].argmax(-1)
    return times


def long_text(tokenizer: Any, min_tokens: int) -> torch.Tensor:
    """Token ids ``[1, >= min_tokens]`` (if available) of long real text: Python's ``pydoc_data`` topics in
    name order, then the standard library's ``*.py`` files in name order."""
    import pydoc_data.topics as topics

    parts = [topics.topics[k] for k in sorted(topics.topics)]
    ids = tokenizer("\n\n".join(parts), return_tensors="pt").input_ids
    chunks = [ids]
    total = ids.shape[1]
    if total < min_tokens:
        lib = Path(sysconfig.get_paths()["stdlib"])
        for f in sorted(lib.glob("*.py")):
            if total >= min_tokens:
                break
            try:
                text = f.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            t = tokenizer("\n\n" + text, return_tensors="pt", add_special_tokens=False).input_ids
            chunks.append(t)
            total += t.shape[1]
    return torch.cat(chunks, dim=1)
