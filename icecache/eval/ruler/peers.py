"""kvpress's own presses as extra RULER rows, run through kvpress's text-generation pipeline.

kvpress (NVIDIA, the ``peers`` extra) compresses the KV cache of the *context* during prefill and then
answers the *question* (kept uncompressed) by greedy decoding until end-of-sequence. A RULER sample maps onto
that directly: the context is the task text up to the query, the question is the query, and the answer prefix
is passed as kvpress's ``answer_prefix``; with a chat template the pipeline rebuilds the same prompt text as
ours (`RulerSample.prompt`).

Budgets: our methods keep ``sink + window + budget`` prompt tokens per (layer, KV head) on the device. A press
row at budget B keeps the same number of prompt tokens: the question's tokens, which kvpress never
compresses, plus ``(1 - ratio) x`` the context, with ``ratio = 1 - (sink + window + B - question) / context``.
Differences by design, reported with the table: kvpress compresses every layer (ours keeps ``dense_layers``
dense), and its cache grows with each generated token, while ours keeps the budget fixed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError


def _presses() -> dict[str, Callable[[float, IceCacheConfig], Any]]:
    from kvpress import ExpectedAttentionPress, KnormPress, SnapKVPress, StreamingLLMPress

    return {
        "snapkv": lambda ratio, cfg: SnapKVPress(compression_ratio=ratio, window_size=cfg.window, kernel_size=5),
        "streaming": lambda ratio, cfg: StreamingLLMPress(compression_ratio=ratio, n_sink=cfg.sink),
        "expected_attention": lambda ratio, cfg: ExpectedAttentionPress(compression_ratio=ratio, n_sink=cfg.sink),
        "knorm": lambda ratio, cfg: KnormPress(compression_ratio=ratio),
    }


PRESS_NAMES = ("snapkv", "streaming", "expected_attention", "knorm")


def check_press(name: str) -> None:
    """One-line `ConfigError` for an unknown press or a missing kvpress."""
    if name not in PRESS_NAMES:
        raise ConfigError(f"--kvpress: unknown press {name!r}; known: {', '.join(PRESS_NAMES)}")
    try:
        import kvpress  # noqa: F401
    except ImportError:
        raise ConfigError("--kvpress needs NVIDIA kvpress: pip install 'icecache[peers]'") from None


def compression_ratio(context_tokens: int, question_tokens: int, budget: int, config: IceCacheConfig) -> float:
    """kvpress's ratio that keeps as many prompt tokens as our methods: sink + window + budget (see above)."""
    keep_context = config.sink + config.window + budget - question_tokens
    return min(max(1.0 - keep_context / max(context_tokens, 1), 0.0), 0.99)


_PIPELINES: dict[int, Any] = {}


def _pipeline(model: Any, tokenizer: Any) -> Any:
    key = id(model)
    if key not in _PIPELINES:
        from kvpress import KVPressTextGenerationPipeline

        _PIPELINES.clear()
        _PIPELINES[key] = KVPressTextGenerationPipeline(model=model, tokenizer=tokenizer, device=model.device)
    return _PIPELINES[key]


def kvpress_answer(model: Any, tokenizer: Any, sample: Any, press_name: str, budget: int,
                   config: IceCacheConfig) -> tuple[str, dict[str, Any]]:
    """kvpress's answer to ``sample`` with press ``press_name`` at ``budget``; returns (text, details)."""
    import torch

    pipe = _pipeline(model, tokenizer)
    context_tokens = len(tokenizer(sample.context, add_special_tokens=False)["input_ids"])
    question_tokens = len(tokenizer(sample.question + sample.answer_prefix, add_special_tokens=False)["input_ids"])
    ratio = compression_ratio(context_tokens, question_tokens, budget, config)
    press = _presses()[press_name](ratio, config)
    with torch.inference_mode():
        answer = pipe(sample.context, question=sample.question, answer_prefix=sample.answer_prefix, press=press,
                      max_new_tokens=sample.tokens_to_generate)["answer"]
    return answer, {"compression_ratio": ratio, "context_tokens": context_tokens, "question_tokens": question_tokens}
