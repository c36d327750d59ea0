"""The one capture of real post-RoPE queries, keys and values from a transformers model.

An attention function is registered under ``"icecache_capture"`` in transformers' ``AttentionInterface``
(with ``sdpa_mask`` under the same name in ``AttentionMaskInterface``) once, when this module is imported. It
copies what the active `Recorder` asks for (per layer: the keys / values ``[H_kv, T, D]`` and the last
queries ``[H_q, last, D]`` of batch element 0), then runs the ``"icecache"`` attention function, which is
plain SDPA without an `icecache.IceCache`: the forward pass is unchanged. The recorder is thread-local and the
function is registered only once, so wrappers that other libraries install around every registered function
(kvpress) keep working.

Users: `capture_kv` (the index benchmark), `capture_qk` (the calibration's pager timings and the simulator's
trace recording) and `icecache.eval.harness.run_prefill` (SnapKV's observation-window queries), all through
`recording`.

Long real text for captures: `long_text` (token ids ``[1, n]`` of `icecache.core.texts.long_text_ids`) and
`prompt_ids` (the first ``n`` tokens of Python's documentation).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from icecache.core.errors import ConfigError
from icecache.core.texts import TEXTS, long_text_ids, real_text, stdlib_text_ids
from icecache.runtime.attention import icecache_attention, use_attention

CAPTURE_NAME = "icecache_capture"

__all__ = [
    "CAPTURE_NAME", "Capture", "Recorder", "recording", "capture_kv", "capture_qk", "time_decode_steps",
    "long_text", "prompt_ids",
]


@dataclass
class Capture:
    """Tensors captured from one forward pass (batch element 0).

    Attributes
    ----------
    keys, values : dict[int, Tensor]
        Layer -> ``[H_kv, T, D]`` post-RoPE keys / values of every position (when the recorder asked for them).
    queries : dict[int, Tensor]
        Layer -> ``[H_q, last, D]`` post-RoPE queries of the last ``last`` positions (all of them when
        ``last_queries`` is None).
    num_tokens : int
        T.
    position_offset : int
        RoPE position of token 0 (positions are ``offset .. offset + T - 1``).
    seconds : float
        Wall time of the forward pass (s).
    past_key_values : Any
        The model's cache after the pass (``capture_kv(keep_cache=True)`` only), for timing decode steps.
    """

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    num_tokens: int = 0
    position_offset: int = 0
    seconds: float = 0.0
    past_key_values: Any = None


@dataclass
class Recorder:
    """What the capture attention function records while `recording` is active (in this thread).

    Parameters
    ----------
    layers : set of int, optional
        Layers to record (None: every layer).
    last_queries : int, optional
        Record the queries of the last this many positions (``query[0, :, -last:]``, so 0 also means all);
        None records every position.
    keys, values : bool
        Record the keys / values of every position.
    float_cpu : bool
        Store float32 copies on the CPU (False: detached copies in the model's dtype and device).
    min_query_tokens : int
        Record only calls with at least this many query positions (2: prefill only, never a decode step).
    """

    layers: set[int] | None = None
    last_queries: int | None = None
    keys: bool = True
    values: bool = True
    float_cpu: bool = True
    min_query_tokens: int = 1
    out: Capture = field(default_factory=Capture)

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach()
        if self.float_cpu:
            x = x.float().cpu()
        return x.clone()

    def record(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if (self.layers is not None and layer not in self.layers) or query.shape[2] < self.min_query_tokens:
            return
        if self.keys:
            self.out.keys[layer] = self._copy(key[0])
        if self.values:
            self.out.values[layer] = self._copy(value[0])
        q = query[0] if self.last_queries is None else query[0, :, -self.last_queries :]
        self.out.queries[layer] = self._copy(q)


class _CaptureAttention:
    """The registered attention function: records into this thread's active `Recorder`, then attends."""

    def __init__(self) -> None:
        self._local = threading.local()

    @property
    def active(self) -> Recorder | None:
        return getattr(self._local, "recorder", None)

    @contextlib.contextmanager
    def activate(self, rec: Recorder) -> Iterator[Recorder]:
        previous = self.active
        self._local.recorder = rec
        try:
            yield rec
        finally:
            self._local.recorder = previous

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 **kwargs: Any) -> tuple[torch.Tensor, Any]:
        rec = self.active
        layer = getattr(module, "layer_idx", None)
        if rec is not None and layer is not None:
            rec.record(layer, query, key, value)
        return icecache_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


_CAPTURE = _CaptureAttention()
AttentionInterface.register(CAPTURE_NAME, _CAPTURE)
AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)


@contextlib.contextmanager
def recording(model: Any, recorder: Recorder | None = None, **options: Any) -> Iterator[Capture]:
    """Within the block, ``model``'s forward passes (in this thread) record into ``recorder`` (or a new
    `Recorder(**options)`); yields its `Capture`, filled as the passes run."""
    rec = recorder if recorder is not None else Recorder(**options)
    with use_attention(model, CAPTURE_NAME), _CAPTURE.activate(rec):
        yield rec.out


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
    """One forward pass of ``model``'s decoder over ``input_ids`` ``[1, T]``, recording K/V/Q (float32, CPU).

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
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids must have shape [1, T], got {list(input_ids.shape)}")
    wanted = None if layers is None else {int(layer) for layer in layers}
    run_layers = None if (wanted is None or keep_cache) else max(wanted) + 1
    T = input_ids.shape[1]
    pos = torch.arange(position_offset, position_offset + T).unsqueeze(0)
    with recording(model, layers=wanted, last_queries=last_queries) as cap, _truncated(model, run_layers), torch.inference_mode():
        t0 = time.perf_counter()
        out = model.model(input_ids=input_ids, position_ids=pos, use_cache=keep_cache)
        cap.seconds = time.perf_counter() - t0
    cap.num_tokens = T
    cap.position_offset = position_offset
    if keep_cache:
        cap.past_key_values = out.past_key_values
    return cap


def capture_qk(model: Any, input_ids: Any, timing: dict[str, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Post-RoPE queries ``[L, Hq, n, d]`` and keys ``[L, Hkv, n, d]`` (float32) of one prefill of ``input_ids``
    ``[1, n]`` (a forward as generation's prefill: with a cache, logits of the last position only).

    ``timing``, when given, receives ``forward_s``: the wall time of the forward pass itself."""
    with recording(model, values=False) as cap, torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=input_ids, use_cache=True, logits_to_keep=1)
        if timing is not None:
            timing["forward_s"] = time.perf_counter() - t0
    layers = range(model.config.num_hidden_layers)
    return torch.stack([cap.queries[i] for i in layers]), torch.stack([cap.keys[i] for i in layers])


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


def long_text(tokenizer: Any, min_tokens: int, text: str = "docs") -> torch.Tensor:
    """Token ids ``[1, >= min_tokens]`` (if available) of long real text: ``text="docs"`` Python's documentation
    continued by the standard library (`icecache.core.texts.long_text_ids`), ``"stdlib"`` the standard library's
    sources alone (`stdlib_text_ids`)."""
    if text not in TEXTS:
        raise ConfigError(f"text must be one of {', '.join(TEXTS)}, got {text!r}")
    ids = long_text_ids(tokenizer, min_tokens) if text == "docs" else stdlib_text_ids(tokenizer, min_tokens)
    return torch.tensor([ids], dtype=torch.long)


def prompt_ids(tokenizer: Any, n: int) -> torch.Tensor:
    """``[1, n]``: the first ``n`` tokens of Python's own documentation text (`icecache.core.texts.real_text`,
    with the tokenizer's special tokens, no chat template)."""
    ids = tokenizer(real_text(), return_tensors="pt")["input_ids"]
    if ids.shape[1] < n:
        raise ConfigError(f"library text gives only {ids.shape[1]} tokens, {n} asked")
    return ids[:, :n]


def left_padded_random_ids(lengths: Sequence[int], seed: int = 1, low: int = 3, high: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of random token ids ``[B, max(lengths)]``, row ``b`` holding ``lengths[b]`` tokens in
    ``[low, high)`` after left padding (id 0), and its attention mask (the tiny models' exactness checks)."""
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n :] = torch.randint(low, high, (n,), generator=g)
        mask[b, T - n :] = 1
    return ids, mask
