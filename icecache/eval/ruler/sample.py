"""One RULER sample: its record, its random stream, its prompt format and the search for its haystack size.

A task builder turns a seeded RNG into a `Draft` (keys, values, answers, and a ``render(num_units)`` that lays
the haystack out at a given size). `fit_units` then finds the largest haystack whose prompt, as the model will
read it, fits ``length - tokens_to_generate`` tokens:

    length  = num_tokens + tokens_to_generate + slack,   0 <= slack <= length_tolerance(length)
    prompt  = format(context + question) + answer_prefix
    format  = the tokenizer's chat template (user turn, generation prompt) or nothing
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from icecache.core.errors import ConfigError
from icecache.eval.ruler.text import Span

Metric = Literal["all", "part"]

LENGTH_TOLERANCE_FRACTION = 0.02
LENGTH_TOLERANCE_MIN_TOKENS = 96
MAX_SECANT_STEPS = 8


def length_tolerance(length: int) -> int:
    """How far below ``length`` a sample may fall: ``max(2% of length, 96)`` tokens; it is never above.

    The search leaves less than one haystack unit unused. A unit is a noise line (~25 SmolLM2 tokens), an
    essay word (~1.5), a distractor needle (~30; ~80 with two UUIDs, the largest), a common-words entry
    (~6 x 3) or a coded word (~4); 96 tokens covers the largest unit at every length.
    """
    return max(int(LENGTH_TOLERANCE_FRACTION * length), LENGTH_TOLERANCE_MIN_TOKENS)


@dataclass(frozen=True)
class RulerSample:
    """One generated RULER sample.

    Attributes
    ----------
    task, index, seed : what regenerates it: ``make_sample(task, tokenizer, length, seed, index, ...)``.
    length : the target, ``num_tokens + tokens_to_generate`` plus at most `length_tolerance` tokens of slack.
    prompt : the full text the model reads, ending with ``answer_prefix``; ``tokenizer(prompt)["input_ids"]``
        has exactly ``num_tokens`` ids (with a chat template, a leading BOS that the tokenizer adds by itself
        is left out of the text, so it is not counted twice).
    context, question : the task text split at the query, ``context + question`` is the task text inside
        the chat template (kvpress's pipeline takes them apart).
    answer_prefix : RULER's answer prefix, appended after the assistant turn start.
    answers : the reference strings; ``metric`` says how they are scored (`icecache.eval.ruler.score`).
    needle_spans : ``[start, end)`` character spans in ``prompt`` of the inserted text that holds or leads
        to the answers, in prompt order: every needle a NIAH task inserts (for multikey_2/3 the real needle
        only, the distractor haystack is not listed), each line of the variable chain (vt), each occurrence
        of an answer word in the list (cwe, fwe). Map them to tokens with the tokenizer's offsets.
    num_units : the haystack size found by the search (lines, words, uncommon words or coded words).
    chat_template : whether the task text was wrapped in a chat template.
    """

    task: str
    index: int
    seed: int
    length: int
    prompt: str
    context: str
    question: str
    answer_prefix: str
    answers: tuple[str, ...]
    tokens_to_generate: int
    num_tokens: int
    needle_spans: tuple[Span, ...]
    metric: Metric
    num_units: int
    chat_template: bool

    @property
    def total_tokens(self) -> int:
        """Prompt tokens plus the tokens to generate (at most ``length``)."""
        return self.num_tokens + self.tokens_to_generate


@dataclass(frozen=True)
class Rendered:
    """A task's text at one haystack size. ``spans`` index ``context + question``."""

    context: str
    question: str
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class Draft:
    """One sample's random draws, waiting for a haystack size.

    ``render(num_units)`` must be deterministic (it reseeds its own RNG) and its token count non-decreasing
    in ``num_units``, up to tokenisation jitter, for the search to be exact.
    """

    answers: tuple[str, ...]
    answer_prefix: str
    render: Callable[[int], Rendered]
    min_units: int
    max_units: int | None = None
    unit: str = "line"


def sample_rng(seed: int, task: str, index: int) -> random.Random:
    """The RNG of one sample, derived from ``(seed, task, index)`` alone so any sample regenerates by itself."""
    digest = hashlib.sha256(f"ruler|{seed}|{task}|{index}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def count_tokens(tokenizer: Any, text: str) -> int:
    """``len(tokenizer(text)["input_ids"])``: what the runner feeds, special tokens included."""
    return len(tokenizer(text)["input_ids"])


@dataclass(frozen=True)
class PromptFormat:
    """How task text becomes the prompt: an optional chat wrapper, then the answer prefix.

    ``drop_prefix`` is a BOS text that the wrapper writes and the tokenizer adds again by itself; it is cut
    from the wrapped text so that ``tokenizer(prompt)`` holds it once.
    """

    wrap: Callable[[str], str] | None = None
    drop_prefix: str = ""

    def apply(self, task_text: str, answer_prefix: str) -> tuple[str, int]:
        """``(prompt, offset)``: the prompt and where ``task_text`` starts in it."""
        if self.wrap is None:
            return task_text + answer_prefix, 0
        wrapped = self.wrap(task_text)
        if self.drop_prefix and wrapped.startswith(self.drop_prefix):
            wrapped = wrapped[len(self.drop_prefix) :]
        offset = wrapped.find(task_text)
        if offset < 0:
            raise ConfigError("chat_template: the template changed the task text (it must be copied verbatim)")
        return wrapped + answer_prefix, offset


def make_prompt_format(tokenizer: Any, chat_template: bool | Callable[[str], str]) -> PromptFormat:
    """The `PromptFormat` for ``chat_template``: False (plain), True (the tokenizer's template) or a callable.

    With True the task text is the single user message and the generation prompt is added, as RULER does
    for instruct models: ``tokenizer.apply_chat_template([{"role": "user", "content": text}],
    add_generation_prompt=True, tokenize=False)``.
    """
    if chat_template is False:
        return PromptFormat()
    if chat_template is True:
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("chat_template=True needs a tokenizer with a chat template; pass chat_template=False")

        def wrap(text: str) -> str:
            messages = [{"role": "user", "content": text}]
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    elif callable(chat_template):
        wrap = chat_template
    else:
        raise ConfigError(f"chat_template must be True, False or a callable str -> str, not {chat_template!r}")
    return PromptFormat(wrap=wrap, drop_prefix=_self_added_bos(tokenizer))


def _self_added_bos(tokenizer: Any) -> str:
    """The BOS text when ``tokenizer(text)`` prepends BOS on its own (SmolLM2's GGUF tokenizer, Gemma), else ''."""
    bos_text = getattr(tokenizer, "bos_token", None)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    if not bos_text or bos_id is None:
        return ""
    with_special = tokenizer("a")["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return bos_text if with_special[:1] == [bos_id] and without[:1] != [bos_id] else ""


def fit_units(count: Callable[[int], int], budget: int, min_units: int, max_units: int | None = None) -> int:
    """The largest ``n`` in ``[min_units, max_units]`` with ``count(n) <= budget``.

    RULER's search (estimate tokens per unit, then search the unit count), with secant steps: each step
    predicts the last fitting ``n`` from the slope between the best fitting count so far and the latest one,
    so a near-linear ``count`` is bracketed in a few tokenizer calls; bisection finishes what is left.
    ``count(min_units) <= budget`` must hold. ``count`` is assumed non-decreasing; the result fits anyway.
    """
    top = max_units if max_units is not None else 1 << 40
    lo, hi = min_units, top + 1  # count(lo) <= budget; hi: the smallest n known not to fit (top + 1: none)
    if count(lo) > budget:
        raise AssertionError("fit_units: the smallest haystack does not fit (the caller checks this first)")
    last = min(lo + 16, top)
    for _ in range(MAX_SECANT_STEPS):
        if hi - lo <= 1:
            return lo
        last = min(max(last, lo + 1), hi - 1)
        if count(last) <= budget:
            lo = last
        else:
            hi = last
        if hi - lo <= 1:
            return lo
        ref = min_units if last == lo else lo
        slope = max((count(last) - count(ref)) / (last - ref), 1e-3) if last != ref else 1.0
        last = lo + max(1, int((budget - count(lo)) / slope))
    while hi > top and hi - lo > 1:  # no upper bound yet: gallop
        nxt = min(top + 1, 2 * lo + 1)
        if nxt <= top and count(nxt) <= budget:
            lo = nxt
        else:
            hi = nxt
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count(mid) <= budget:
            lo = mid
        else:
            hi = mid
    return lo
