"""One-call generation: ``icecache.generate(model, tokenizer, prompt, ...)`` returns the continuation."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError


@dataclass
class GenerationResult:
    """The continuation and how long it took (TTFT = prefill + first token; TPOT per vLLM)."""

    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    ttft_seconds: float
    tt2t_seconds: float = float("nan")
    token_ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    trace: list[dict[str, Any]] = field(default_factory=list)  # with IceCacheConfig(trace=True)

    @property
    def tpot_seconds(self) -> float:
        """(end-to-end - time to first token) / (output tokens - 1)."""
        return (self.seconds - self.ttft_seconds) / max(self.new_tokens - 1, 1)


def encode_prompt(tokenizer: Any, prompt: str, chat: bool = True) -> dict[str, torch.Tensor]:
    """Tokenise ``prompt`` (through the chat template when ``chat`` and the tokenizer has one)."""
    if chat and getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


class _TokenClock:
    """A transformers streamer that records when the first and second generated tokens arrive, and can
    drive a progress bar over the new tokens."""

    def __init__(self, total: int, progress: bool = False, desc: str = "decode") -> None:
        self.calls = 0
        self.first: float | None = None
        self.second: float | None = None
        self.bar = None
        if progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=desc, unit="tok", leave=False)

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1  # call 1 is the prompt, then one call per new token
        now = time.perf_counter()
        if self.calls == 2:
            self.first = now
        elif self.calls == 3:
            self.second = now
        if self.bar is not None and self.calls >= 2:
            self.bar.update(1)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextlib.contextmanager
def icecache_attention(model: Any) -> Iterator[None]:
    """Switch ``model`` to the "icecache" attention for the duration (restores the previous one)."""
    from icecache.runtime.attention import ATTENTION_NAME, register

    register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@torch.inference_mode()
def _check_lengths(max_new_tokens: int, min_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens <= max_new_tokens:
        raise ConfigError(f"min_new_tokens must be an int in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens!r}")


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str,
    *,
    config: IceCacheConfig | None = None,
    max_new_tokens: int = 32,
    min_new_tokens: int = 0,
    chat: bool = True,
    return_result: bool = False,
    progress: bool = False,
) -> str | GenerationResult:
    """Greedy generation with IceCache (or full attention when ``config`` is None).

    ``min_new_tokens`` suppresses end-of-sequence before that many tokens (timing runs use it to decode the
    same number of steps with every method).

    Returns the continuation text only, or a `GenerationResult` (times, token ids, ``cache.stats()``) when
    ``return_result``. The model's attention implementation is switched to "icecache" for the call and
    restored afterwards; the cache's worker threads are stopped before returning.
    """
    from icecache.runtime.cache import IceCache

    _check_lengths(max_new_tokens, min_new_tokens)
    if config is None:
        res = generate_full(model, tokenizer, prompt, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, chat=chat,
                            progress=progress)
        return res if return_result else res.text
    enc = encode_prompt(tokenizer, prompt, chat)
    clock = _TokenClock(max_new_tokens, progress, desc=f"icecache {config.index}@{config.budget}")
    with icecache_attention(model), IceCache(model.config, config) as cache:
        t0 = time.perf_counter()
        out = model.generate(
            **enc, past_key_values=cache, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None, do_sample=False,
            streamer=clock, pad_token_id=tokenizer.pad_token_id,
        )
        t1 = time.perf_counter()
        stats = cache.stats()
        trace = list(cache.trace)
    new = out[0, enc["input_ids"].shape[1] :]
    res = GenerationResult(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(enc["input_ids"].shape[1]),
        new_tokens=int(new.numel()),
        seconds=t1 - t0,
        ttft_seconds=(clock.first or t1) - t0,
        tt2t_seconds=(clock.second or t1) - t0,
        token_ids=new.tolist(),
        stats=stats,
        trace=trace,
    )
    return res if return_result else res.text


@torch.inference_mode()
def generate_full(
    model: Any, tokenizer: Any, prompt: str, *, max_new_tokens: int = 32, min_new_tokens: int = 0, chat: bool = True,
    progress: bool = False,
) -> GenerationResult:
    """Greedy generation with the model's own (full) attention; the baseline every method is compared with."""
    _check_lengths(max_new_tokens, min_new_tokens)
    enc = encode_prompt(tokenizer, prompt, chat)
    timer = _TokenClock(max_new_tokens, progress, desc="full attention")
    t0 = time.perf_counter()
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None, do_sample=False, streamer=timer,
        pad_token_id=tokenizer.pad_token_id,
    )
    t1 = time.perf_counter()
    new = out[0, enc["input_ids"].shape[1] :]
    return GenerationResult(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(enc["input_ids"].shape[1]),
        new_tokens=int(new.numel()),
        seconds=t1 - t0,
        ttft_seconds=(timer.first or t1) - t0,
        tt2t_seconds=(timer.second or t1) - t0,
        token_ids=new.tolist(),
    )
