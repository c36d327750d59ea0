"""One-call generation: ``icecache.generate(model, tokenizer, prompt, ...)`` returns the continuation.

The prompt follows transformers' convention: a plain string is raw text (a completion prompt is continued
as written); a list of messages (``[{"role": "user", "content": ...}]``) goes through the tokenizer's chat
template with the generation prompt added. ``chat=True`` forces the template on a string.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from icecache.core.config import IceCacheConfig
from icecache.core.errors import ConfigError, InputError
from icecache.runtime.attention import use_attention


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
    stats: dict[str, Any] = field(default_factory=dict)  # IceCache.stats(); empty for full attention
    trace: list[dict[str, Any]] = field(default_factory=list)  # with IceCacheConfig(trace=True)
    chat_template: bool = False  # the prompt went through the tokenizer's chat template

    @property
    def tpot_seconds(self) -> float:
        """(end-to-end - time to first token) / (output tokens - 1)."""
        return (self.seconds - self.ttft_seconds) / max(self.new_tokens - 1, 1)


def _is_messages(prompt: Any) -> bool:
    return (
        isinstance(prompt, (list, tuple)) and len(prompt) > 0
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, list))
                for m in prompt)
    )


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        if not value:
            return f"an empty {type(value).__name__}"
        kinds = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(kinds)}" + (" without str 'role'/'content'" if kinds == ["dict"] else "")
    return f"a {type(value).__name__}"


def uses_chat_template(tokenizer: Any, prompt: Any, chat: bool | None = None) -> bool:
    """Whether ``prompt`` goes through the chat template: a list of messages does, a plain string does only with
    ``chat=True`` (and a tokenizer that has a template). Raises `InputError` for any other prompt type, for
    ``chat=False`` with messages, and for messages with a tokenizer that has no chat template."""
    if chat is not None and not isinstance(chat, bool):
        raise InputError(f"chat must be True, False or None, got {chat!r}")
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if isinstance(prompt, str):
        return bool(chat) and has_template
    if not _is_messages(prompt):
        raise InputError(
            "prompt must be a str (raw text) or a list of {'role': ..., 'content': ...} dicts (chat template), "
            f"got {_describe(prompt)}"
        )
    if chat is False:
        raise InputError("chat=False needs a plain-string prompt; a list of messages always uses the chat template")
    if not has_template:
        raise InputError("this tokenizer has no chat template: pass the prompt as a plain string")
    return True


def encode_prompt(tokenizer: Any, prompt: Any, chat: bool | None = None) -> dict[str, torch.Tensor]:
    """Tokenise ``prompt`` (a str: raw text; a list of messages: the chat template; see `uses_chat_template`)."""
    if uses_chat_template(tokenizer, prompt, chat):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        enc = tokenizer(prompt, return_tensors="pt")
    if enc["input_ids"].shape[-1] == 0:
        raise InputError("the prompt is empty (0 tokens)")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}


def model_context(model: Any) -> int | None:
    """The model's context length (``max_position_embeddings`` of its text config), if it states one."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    context = getattr(cfg, "max_position_embeddings", None)
    return context if isinstance(context, int) and context > 0 else None


def _warn_if_past_context(model: Any, prompt_tokens: int, max_new_tokens: int) -> None:
    context = model_context(model)
    if context is not None and prompt_tokens + max_new_tokens > context:
        warnings.warn(
            f"prompt ({prompt_tokens} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_tokens + max_new_tokens} "
            f"exceeds the model's context ({context} tokens); tokens past it are unreliable",
            stacklevel=3,
        )


@contextlib.contextmanager
def _prefill_progress(model: Any, enabled: bool, desc: str = "prefill") -> Iterator[None]:
    """A progress bar over the decoder layers of the first forward pass (the prefill), so a long prefill does
    not sit at 0 tokens; forward hooks, removed on exit."""
    layers = getattr(model.get_decoder(), "layers", None) if enabled and hasattr(model, "get_decoder") else None
    if not layers:
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=len(layers), desc=desc, unit="layer", leave=False)

    def tick(module: Any, args: Any, output: Any) -> None:
        if bar.n < bar.total:
            bar.update(1)
            if bar.n == bar.total:
                bar.close()

    handles = [layer.register_forward_hook(tick) for layer in layers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        bar.close()


class _TokenClock:
    """A transformers streamer that records when the first and second generated tokens arrive, and can
    drive a progress bar over the new tokens (opened with the first one: the prefill has its own bar)."""

    def __init__(self, total: int, progress: bool = False, desc: str = "decode") -> None:
        self.calls = 0
        self.first: float | None = None
        self.second: float | None = None
        self.total, self.progress, self.desc = total, progress, desc
        self.bar = None

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1  # call 1 is the prompt, then one call per new token
        now = time.perf_counter()
        if self.calls == 2:
            self.first = now
            if self.progress:
                from tqdm.auto import tqdm

                self.bar = tqdm(total=self.total, desc=self.desc, unit="tok", leave=False)
        elif self.calls == 3:
            self.second = now
        if self.bar is not None:
            self.bar.update(1)

    def end(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _check_lengths(max_new_tokens: int, min_new_tokens: int) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(min_new_tokens, int) or not 0 <= min_new_tokens <= max_new_tokens:
        raise ConfigError(f"min_new_tokens must be an int in [0, max_new_tokens={max_new_tokens}], got {min_new_tokens!r}")


def generate(
    model: Any,
    tokenizer: Any,
    prompt: str | Sequence[dict[str, Any]],
    *,
    config: IceCacheConfig | None = None,
    max_new_tokens: int = 32,
    min_new_tokens: int = 0,
    chat: bool | None = None,
    return_result: bool = False,
    progress: bool = False,
) -> str | GenerationResult:
    """Greedy generation with IceCache (or full attention when ``config`` is None).

    Parameters
    ----------
    prompt : str or list of dict
        A str is raw text, tokenised as written (completion prompts); a list of messages
        (``[{"role": "user", "content": ...}]``) goes through the tokenizer's chat template.
    chat : bool, optional
        Override: True puts a str through the chat template as one user message; False with a list of messages
        raises `InputError`. None (default): decided by the prompt's type.
    min_new_tokens : int
        Suppresses end-of-sequence before that many tokens (timing runs use it to decode the same number of steps
        with every method).
    progress : bool
        Progress bars over the prefill's layers, then over the new tokens.

    Returns the continuation text only, or a `GenerationResult` (times, token ids, ``cache.stats()``, whether the
    chat template was used) when ``return_result``. Warns when prompt + ``max_new_tokens`` exceeds the model's
    context. The model's attention implementation is switched to "icecache" for the call and restored
    afterwards; the cache's worker threads are stopped before returning.
    """
    from icecache.runtime.cache import IceCache

    _check_lengths(max_new_tokens, min_new_tokens)
    if config is None:
        res = generate_full(model, tokenizer, prompt, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, chat=chat,
                            progress=progress)
        return res if return_result else res.text
    if not isinstance(config, IceCacheConfig):
        raise ConfigError(f"config must be an IceCacheConfig or None, got {type(config).__name__}")
    chat_template = uses_chat_template(tokenizer, prompt, chat)
    enc = encode_prompt(tokenizer, prompt, chat)
    prompt_tokens = int(enc["input_ids"].shape[1])
    _warn_if_past_context(model, prompt_tokens, max_new_tokens)
    cache = IceCache(model.config, config, max_cache_len=prompt_tokens + max_new_tokens)
    with use_attention(model), cache:
        res = _greedy(model, tokenizer, enc, max_new_tokens, min_new_tokens, progress,
                      desc=f"icecache {config.index}@{config.budget}", past_key_values=cache)
        res.stats = cache.stats()
        res.trace = list(cache.trace)
    res.chat_template = chat_template
    return res if return_result else res.text


@torch.inference_mode()
def generate_full(
    model: Any, tokenizer: Any, prompt: str | Sequence[dict[str, Any]], *, max_new_tokens: int = 32,
    min_new_tokens: int = 0, chat: bool | None = None, progress: bool = False,
) -> GenerationResult:
    """Greedy generation with the model's own (full) attention; the baseline every method is compared with.
    ``prompt`` and ``chat`` as in `generate`."""
    _check_lengths(max_new_tokens, min_new_tokens)
    chat_template = uses_chat_template(tokenizer, prompt, chat)
    enc = encode_prompt(tokenizer, prompt, chat)
    _warn_if_past_context(model, int(enc["input_ids"].shape[1]), max_new_tokens)
    res = _greedy(model, tokenizer, enc, max_new_tokens, min_new_tokens, progress, desc="full attention")
    res.chat_template = chat_template
    return res


def _greedy(model: Any, tokenizer: Any, enc: dict[str, torch.Tensor], max_new_tokens: int, min_new_tokens: int,
            progress: bool, desc: str, **kwargs: Any) -> GenerationResult:
    """``model.generate`` (greedy) on the encoded prompt, timed; ``kwargs`` go to ``model.generate``."""
    clock = _TokenClock(max_new_tokens, progress, desc=desc)
    with _prefill_progress(model, progress, desc=f"{desc}: prefill"):
        t0 = time.perf_counter()
        try:
            out = model.generate(
                **enc, max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens or None, do_sample=False,
                streamer=clock, pad_token_id=tokenizer.pad_token_id, **kwargs,
            )
        finally:
            clock.end()
        t1 = time.perf_counter()
    new = out[0, enc["input_ids"].shape[1] :]
    return GenerationResult(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=int(enc["input_ids"].shape[1]),
        new_tokens=int(new.numel()),
        seconds=t1 - t0,
        ttft_seconds=(clock.first or t1) - t0,
        tt2t_seconds=(clock.second or t1) - t0,
        token_ids=new.tolist(),
    )
