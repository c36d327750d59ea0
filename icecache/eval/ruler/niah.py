"""RULER's eight needle-in-a-haystack (retrieval) tasks.

| task            | haystack | key   | value  | keys / values / queried |
|-----------------|----------|-------|--------|-------------------------|
| niah_single_1   | noise    | word  | number | 1 / 1 / 1               |
| niah_single_2   | essay    | word  | number | 1 / 1 / 1               |
| niah_single_3   | essay    | word  | UUID   | 1 / 1 / 1               |
| niah_multikey_1 | essay    | word  | number | 4 / 1 / 1 (3 distractor needles) |
| niah_multikey_2 | needles  | word  | number | 1 / 1 / 1 (the haystack is distractor needles) |
| niah_multikey_3 | needles  | UUID  | UUID   | 1 / 1 / 1               |
| niah_multivalue | essay    | word  | number | 1 / 4 / 1 (all 4 values wanted) |
| niah_multiquery | essay    | word  | number | 4 / 1 / 4 (all 4 queried) |

Needles go between noise lines (or distractor lines) at random gaps, or between essay sentences at depths drawn
without replacement from `NEEDLE_DEPTHS`. With one value and one query the template is put in the singular.
Every key differs from, and is no substring of, every other key; every value is distinct, so each answer value
appears exactly once in the prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

from icecache.eval.ruler.haystack import (
    NEEDLE_DEPTHS,
    NOISE_UNIT,
    distinct_draws,
    essay_sentences,
    random_number,
    random_uuid,
    random_word_key,
)
from icecache.eval.ruler.sample import Draft, Rendered
from icecache.eval.ruler.text import TextBuilder, weave

NEEDLE = "One of the special magic {kind} for {key} is: {value}."

TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX = " The special magic {kind} for {query} mentioned in the provided text are"

TEMPLATE_SINGULAR = (
    "A special magic {kind} is hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What is the special magic {kind} for {query} mentioned in the provided text?"
)
ANSWER_PREFIX_SINGULAR = " The special magic {kind} for {query} mentioned in the provided text is"

TOKENS_TO_GENERATE = 128

Haystack = Literal["noise", "essay", "needles"]
Kind = Literal["words", "numbers", "uuids"]


@dataclass(frozen=True)
class NiahConfig:
    """One NIAH variant. ``num_keys`` counts needles with distinct keys (the first ``num_queries`` are asked)."""

    haystack: Haystack
    key_kind: Kind
    value_kind: Kind
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1

    @property
    def singular(self) -> bool:
        """One value asked for: RULER's template in the singular."""
        return self.num_values * self.num_queries == 1


NIAH_TASKS: dict[str, NiahConfig] = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_keys=4),
    "niah_multikey_2": NiahConfig("needles", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needles", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_values=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_keys=4, num_queries=4),
}

_DRAW = {"words": random_word_key, "numbers": random_number, "uuids": random_uuid}
_UNIT = {"noise": "noise line", "essay": "essay word", "needles": "distractor needle"}


def join_keys(keys: list[str]) -> str:
    """``"a"``, ``"a, and b"``, ``"a, b, and c"``: the query for several keys."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _draw_one_by_one(kind: Kind, rng: random.Random, count: int) -> list[str]:
    """``count`` items, each distinct from and no substring of the previous ones."""
    items: list[str] = []
    for _ in range(count):
        items += distinct_draws(_DRAW[kind], rng, 1, avoid=items)
    return items


def draft_niah(config: NiahConfig, rng: random.Random, length: int) -> Draft:
    """Draw the keys, values and needle order of one NIAH sample; the haystack is laid out by ``render``."""
    keys = _draw_one_by_one(config.key_kind, rng, config.num_keys)
    values = _draw_one_by_one(config.value_kind, rng, config.num_keys * config.num_values)
    values_of = {k: values[i * config.num_values : (i + 1) * config.num_values] for i, k in enumerate(keys)}
    needles = [NEEDLE.format(kind=config.value_kind, key=k, value=v) for k in keys for v in values_of[k]]
    rng.shuffle(needles)
    queried = keys[: config.num_queries]
    answers = tuple(v for k in queried for v in values_of[k])
    kind = config.value_kind[:-1] if config.singular else config.value_kind
    template = TEMPLATE_SINGULAR if config.singular else TEMPLATE
    head, tail = template.split("{context}")
    intro = head.format(kind=kind)
    question = tail.format(kind=kind, query=join_keys(queried))
    answer_prefix = (ANSWER_PREFIX_SINGULAR if config.singular else ANSWER_PREFIX).format(kind=kind, query=join_keys(queried))
    render_seed = rng.getrandbits(64)

    def render(num_units: int) -> Rendered:
        r = random.Random(render_seed)
        if config.haystack == "essay":
            base = essay_sentences(num_units)
            depths = r.sample(NEEDLE_DEPTHS, len(needles))
            gaps = sorted(int(len(base) * d / 100) for d in depths)
            sep = " "
        else:
            if config.haystack == "noise":
                base = [NOISE_UNIT] * num_units
            else:
                other_keys = distinct_draws(_DRAW[config.key_kind], r, num_units, avoid=keys)
                other_values = distinct_draws(_DRAW[config.value_kind], r, num_units, avoid=values)
                base = [NEEDLE.format(kind=config.value_kind, key=k, value=v) for k, v in zip(other_keys, other_values)]
            gaps = sorted(r.sample(range(num_units + 1), len(needles)))
            sep = "\n"
        text = TextBuilder()
        text.add(intro)
        text.add_joined(weave(base, list(zip(gaps, needles))), sep)
        return Rendered(context=text.text(), question=question, spans=tuple(text.spans))

    min_units = len(needles) if config.haystack == "noise" else 1
    return Draft(answers, answer_prefix, render, min_units=min_units, unit=_UNIT[config.haystack])
