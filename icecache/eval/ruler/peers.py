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

One context prefill, many presses (`prefill_context`, `press_answer`). A press compresses each attention
layer's cache in a forward hook that runs after that layer's attention; the layer's output, and so every later
layer's input, does not depend on the compression. So the pipeline's prefill is run once per sample, densely,
with every attention call's inputs recorded; each press then replays its own ``forward_hook`` on those inputs,
layer by layer, on a clone of the dense cache (new tensors only where the press writes), and kvpress's own ``generate_answer`` answers from the result.
Tokenisation (``preprocess``), compression and generation are kvpress's code; only the repeated prefill is
saved. `kvpress_answer` runs the pipeline end to end and is the reference that
``tests/test_ruler_peers.py`` holds the shared path to, token for token.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
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
    press, details = _press_for(tokenizer, sample, press_name, budget, config)
    with torch.inference_mode():
        answer = pipe(sample.context, question=sample.question, answer_prefix=sample.answer_prefix, press=press,
                      max_new_tokens=sample.tokens_to_generate)["answer"]
    return answer, details


def _press_for(tokenizer: Any, sample: Any, press_name: str, budget: int,
               config: IceCacheConfig) -> tuple[Any, dict[str, Any]]:
    """The press for ``budget`` (`compression_ratio` of the sample's context and question tokens) and the
    record's details."""
    context_tokens = len(tokenizer(sample.context, add_special_tokens=False)["input_ids"])
    question_tokens = len(tokenizer(sample.question + sample.answer_prefix, add_special_tokens=False)["input_ids"])
    ratio = compression_ratio(context_tokens, question_tokens, budget, config)
    details = {"compression_ratio": ratio, "context_tokens": context_tokens, "question_tokens": question_tokens}
    return _presses()[press_name](ratio, config), details


@dataclass
class PressContext:
    """One sample's context, prefilled densely as kvpress's pipeline prefills it, kept for many presses.

    ``context_ids`` ``[1, n]`` and ``question_ids`` ``[1, q]`` are the pipeline's own tokenisation;
    ``calls`` holds each attention layer's ``(module, args, kwargs, output)`` of the prefill, in layer order;
    ``cache`` the dense context K/V; ``seconds`` the prefill's wall time (s).
    """

    context_ids: Any
    question_ids: Any
    cache: Any
    calls: list[tuple[Any, tuple, dict[str, Any], Any]]
    seconds: float


def _attention_modules(model: Any) -> list[Any]:
    """The attention modules kvpress hooks, in layer order (`BasePress.__call__`'s choice)."""
    if type(model).__name__ == "Gemma3ForConditionalGeneration":
        raise ConfigError("--kvpress: Gemma3ForConditionalGeneration skips sliding layers; not supported here")
    language_model = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return [layer.self_attn for layer in language_model.layers]


def prefill_context(model: Any, tokenizer: Any, sample: Any) -> PressContext:
    """Prefill ``sample``'s context as the pipeline does (its tokenisation, one forward of ``model.model``),
    recording every attention call's inputs for `press_answer`."""
    import torch
    from transformers import DynamicCache

    pipe = _pipeline(model, tokenizer)
    t0 = time.perf_counter()
    inputs = pipe.preprocess(sample.context, questions=[sample.question], answer_prefix=sample.answer_prefix,
                             max_context_length=min(tokenizer.model_max_length, int(1e10)))
    calls: list[tuple[Any, tuple, dict[str, Any], Any]] = []

    def record(module: Any, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        calls.append((module, args, dict(kwargs), output))

    cache = DynamicCache()
    hooks = [m.register_forward_hook(record, with_kwargs=True) for m in _attention_modules(model)]
    try:
        with torch.inference_mode():
            model.model(input_ids=inputs["context_ids"].to(model.device), past_key_values=cache)
    finally:
        for hook in hooks:
            hook.remove()
    return PressContext(inputs["context_ids"], inputs["questions_ids"][0], cache, calls, time.perf_counter() - t0)


def press_answer(model: Any, tokenizer: Any, context: PressContext, sample: Any, press_name: str, budget: int,
                 config: IceCacheConfig) -> tuple[str, dict[str, Any]]:
    """`kvpress_answer` from a shared `PressContext`: the press's ``forward_hook`` replayed on the recorded
    prefill, then the pipeline's ``generate_answer``; returns (text, details). ``kept_context_tokens``: the most
    context tokens a layer kept after the press."""
    import torch

    from icecache.eval.harness import clone_kv

    pipe = _pipeline(model, tokenizer)
    press, details = _press_for(tokenizer, sample, press_name, budget, config)
    cache = clone_kv(context.cache)  # the press replaces layers' tensors, never writes into the shared ones
    with torch.inference_mode():
        with press(model):  # the press's own set-up (post_init_from_model, rotary embeddings)
            for module, args, kwargs, output in context.calls:
                press.forward_hook(module, args, {**kwargs, "past_key_values": cache}, output)
        kept = [int(layer.keys.shape[2]) for layer in cache.layers]
        answer = pipe.generate_answer(question_ids=context.question_ids.to(model.device), cache=cache,
                                      context_length=int(context.context_ids.shape[1]),
                                      max_new_tokens=sample.tokens_to_generate)
    return answer, {**details, "kept_context_tokens": max(kept), "kvpress_prefill_seconds": context.seconds}
