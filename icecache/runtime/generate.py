"""One-call generation: ``icecache.generate(model, tokenizer, prompt, ...)`` returns the continuation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class GenerationResult:
    """The continuation and how long it took (TTFT = prefill + first token; TPOT per vLLM)."""

    text: str
    prompt_tokens: int
    new_tokens: int
    seconds: float
    ttft_seconds: float
    token_ids: list[int] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)

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


class _FirstTokenTimer:
    """A transformers streamer that records when the first generated token arrives."""

    def __init__(self) -> None:
        self.calls = 0
        self.first: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2 and self.first is None:  # call 1 is the prompt, call 2 the first new token
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


@torch.inference_mode()
def generate_full(
    model: Any, tokenizer: Any, prompt: str, *, max_new_tokens: int = 32, chat: bool = True
) -> GenerationResult:
    """Greedy generation with the model's own (full) attention; the baseline every method is compared with."""
    enc = encode_prompt(tokenizer, prompt, chat)
    timer = _FirstTokenTimer()
    t0 = time.perf_counter()
    out = model.generate(
        **enc, max_new_tokens=max_new_tokens, do_sample=False, streamer=timer, pad_token_id=tokenizer.pad_token_id
    )
    t1 = time.perf_counter()
    new = out[0, enc["input_ids"].shape[1] :]
    return GenerationResult(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(enc["input_ids"].shape[1]),
        new_tokens=int(new.numel()),
        seconds=t1 - t0,
        ttft_seconds=(timer.first or t1) - t0,
        token_ids=new.tolist(),
    )
