"""The RULER task registry and `make_sample`, which generates one sample of one task at one length.

Eleven synthetic tasks (docs/ruler.md: eight NIAH variants, vt, cwe, fwe; the two QA tasks need SQuAD/HotpotQA
and are not built). A sample is a pure function of
``(task, tokenizer, length, seed, index, chat_template)``: its RNG comes from ``(seed, task, index)``
(`sample_rng`), so any one sample regenerates on its own, which resumable runs need.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from icecache.core.errors import ConfigError, UnknownNameError
from icecache.eval.ruler import aggregation, niah, tracing
from icecache.eval.ruler.sample import (
    Draft,
    Metric,
    Rendered,
    RulerSample,
    count_tokens,
    fit_units,
    length_tolerance,
    make_prompt_format,
    sample_rng,
)

DEFAULT_SEED = 42


@dataclass(frozen=True)
class TaskSpec:
    """One registered task: how many tokens to generate, how to score, and its draft builder."""

    name: str
    family: str
    tokens_to_generate: int
    metric: Metric
    draft: Callable[[random.Random, int], Draft]


def _specs() -> dict[str, TaskSpec]:
    """The registry, in RULER's order."""
    specs = [
        TaskSpec(name, "niah", niah.TOKENS_TO_GENERATE, "all", partial(niah.draft_niah, config))
        for name, config in niah.NIAH_TASKS.items()
    ]
    specs += [
        TaskSpec("vt", "vt", tracing.TOKENS_TO_GENERATE, "all", tracing.draft_vt),
        TaskSpec("cwe", "cwe", aggregation.CWE_TOKENS_TO_GENERATE, "all", aggregation.draft_cwe),
        TaskSpec("fwe", "fwe", aggregation.FWE_TOKENS_TO_GENERATE, "all", aggregation.draft_fwe),
    ]
    registry: dict[str, TaskSpec] = {}
    for spec in specs:
        if spec.name in registry:
            raise AssertionError(f"RULER task {spec.name!r} registered twice")
        registry[spec.name] = spec
    return registry


TASK_SPECS: dict[str, TaskSpec] = _specs()
TASKS: tuple[str, ...] = tuple(TASK_SPECS)


def get_task(task: str) -> TaskSpec:
    """The `TaskSpec` of ``task``; `UnknownNameError` (a ValueError) names the known tasks otherwise."""
    if task not in TASK_SPECS:
        raise UnknownNameError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    return TASK_SPECS[task]


def make_sample(
    task: str,
    tokenizer: Any,
    length: int,
    seed: int = DEFAULT_SEED,
    index: int = 0,
    *,
    chat_template: bool | Callable[[str], str] = False,
) -> RulerSample:
    """Generate sample ``index`` of ``task`` whose prompt plus its tokens to generate fits ``length`` tokens.

    Parameters
    ----------
    task : one of `TASKS`.
    tokenizer : the model's tokenizer; ``tokenizer(text)["input_ids"]`` is what is counted (and what the
        runner feeds). With ``chat_template=True`` it also needs ``chat_template`` and ``apply_chat_template``.
    length : target tokens, prompt plus ``tokens_to_generate``. The sample falls short of it by at most
        `length_tolerance` tokens and never exceeds it.
    seed, index : the sample's random stream is derived from ``(seed, task, index)``.
    chat_template : False (plain task text, as for base models), True (the tokenizer's chat template, one
        user turn plus the generation prompt, as RULER does for instruct models), or a callable that wraps
        the task text. The answer prefix always comes last.

    Raises
    ------
    UnknownNameError : an unknown task (ValueError).
    ConfigError : a length too short for the task (the message gives the minimum), too long for cwe's word
        list, a negative index, or ``chat_template=True`` with a tokenizer that has none (ValueError).
    """
    spec = get_task(task)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise ConfigError(f"length must be a positive int (tokens), not {length!r}")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ConfigError(f"index must be an int >= 0, not {index!r}")
    prompt_format = make_prompt_format(tokenizer, chat_template)
    draft = spec.draft(sample_rng(seed, task, index), length)
    budget = length - spec.tokens_to_generate
    counts: dict[int, int] = {}

    def build(num_units: int) -> tuple[str, int, Rendered]:
        rendered = draft.render(num_units)
        prompt, offset = prompt_format.apply(rendered.context + rendered.question, draft.answer_prefix)
        return prompt, offset, rendered

    def count(num_units: int) -> int:
        if num_units not in counts:
            counts[num_units] = count_tokens(tokenizer, build(num_units)[0])
        return counts[num_units]

    if count(draft.min_units) > budget:
        need = count(draft.min_units) + spec.tokens_to_generate
        raise ConfigError(f"length {length} is too short for RULER task {task!r}: it needs at least {need} tokens")
    num_units = fit_units(count, budget, draft.min_units, draft.max_units)
    prompt, offset, rendered = build(num_units)
    num_tokens = count(num_units)
    slack = length - num_tokens - spec.tokens_to_generate
    if slack > length_tolerance(length) and num_units != draft.max_units:
        raise AssertionError(f"RULER {task!r}: the search left {slack} tokens unused at length {length} (our bug)")
    if slack > length_tolerance(length):
        raise ConfigError(
            f"length {length} is too long for RULER task {task!r}: its haystack ({num_units} {draft.unit}s at most) "
            f"fills {num_tokens + spec.tokens_to_generate} tokens"
        )
    return RulerSample(
        task=task,
        index=index,
        seed=seed,
        length=length,
        prompt=prompt,
        context=rendered.context,
        question=rendered.question,
        answer_prefix=draft.answer_prefix,
        answers=draft.answers,
        tokens_to_generate=spec.tokens_to_generate,
        num_tokens=num_tokens,
        needle_spans=tuple((a + offset, b + offset) for a, b in rendered.spans),
        metric=spec.metric,
        num_units=num_units,
        chat_template=prompt_format.wrap is not None,
    )


def make_samples(
    task: str,
    tokenizer: Any,
    length: int,
    num_samples: int,
    seed: int = DEFAULT_SEED,
    *,
    start: int = 0,
    chat_template: bool | Callable[[str], str] = False,
) -> list[RulerSample]:
    """Samples ``start .. start + num_samples - 1`` of ``task`` (each as `make_sample` makes it alone)."""
    return [make_sample(task, tokenizer, length, seed, i, chat_template=chat_template) for i in range(start, start + num_samples)]
