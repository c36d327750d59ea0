"""Evaluation tasks on real or generated long text (nothing is downloaded).

* ``passkey``  -- see `icecache.eval.passkey` (filler text, one 5-digit key, several depths).
* ``needle``   -- RULER-style needle-in-a-haystack over real text (Python's own documentation from
  ``pydoc_data``): ``single`` (one key, one value), ``multikey`` (the queried key among distractor keys),
  ``multivalue`` (one key with several values; all must be recalled).
* ``ppl``      -- perplexity of real text decoded token by token after a long prefix, so the window slides
  and incremental insertion runs.
* ``longgen``  -- hundreds of greedy tokens past a long prompt, compared with full attention.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field
from typing import Any

from icecache.core.texts import real_text

WORDS = (
    "apple anchor badge basket beacon blossom canyon cedar compass copper crystal dolphin ember falcon fern "
    "garnet glacier harbor hazel island jasmine juniper kettle lantern lemon maple marble meadow nectar "
    "oasis olive orchid pebble pepper quartz quill raven ribbon saffron sapphire summit thistle timber "
    "tulip umber velvet violet walnut willow zephyr"
).split()

NEEDLE_INTRO = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n"
)
NEEDLE = " One of the special magic numbers for {key} is: {value}. "
NEEDLE_QUESTION = (
    "\nWhat is the special magic number for {key} mentioned in the provided text? "
    "The special magic number for {key} mentioned in the provided text is"
)
NEEDLE_QUESTION_ALL = (
    "\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
    "The special magic numbers for {key} mentioned in the provided text are"
)


def text_window(tokenizer: Any, num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` consecutive token ids of the real text, starting at a seeded offset."""
    ids = _real_ids(tokenizer)
    if num_tokens > len(ids):
        raise ValueError(f"asked for {num_tokens} tokens; the real text has {len(ids)}")
    start = random.Random(seed).randrange(0, len(ids) - num_tokens + 1)
    return ids[start : start + num_tokens]


_ID_CACHE: dict[int, list[int]] = {}


def _real_ids(tokenizer: Any) -> list[int]:
    key = id(tokenizer)
    if key not in _ID_CACHE:
        _ID_CACHE[key] = tokenizer(real_text(), add_special_tokens=False)["input_ids"]
    return _ID_CACHE[key]


@dataclass(frozen=True)
class NeedleSample:
    prompt: str
    key: str
    values: tuple[str, ...]  # the values the answer must contain
    variant: str
    depths: tuple[float, ...]
    num_tokens: int
    max_new_tokens: int


def make_needle(tokenizer: Any, num_tokens: int, variant: str, seed: int, num_needles: int = 4) -> NeedleSample:
    """A RULER-style needle prompt of about ``num_tokens`` tokens (variant: single, multikey, multivalue)."""
    if variant not in ("single", "multikey", "multivalue"):
        raise ValueError(f"variant must be single, multikey or multivalue, got {variant!r}")
    rng = random.Random(seed)
    keys = rng.sample(WORDS, num_needles)
    vals = [str(rng.randint(1_000_000, 9_999_999)) for _ in range(num_needles)]
    if variant == "single":
        needles = [(keys[0], vals[0])]
    elif variant == "multikey":
        needles = list(zip(keys, vals))
    else:
        needles = [(keys[0], v) for v in vals]
    target = keys[0]
    answer = tuple(v for k, v in needles if k == target)
    question = (NEEDLE_QUESTION_ALL if variant == "multivalue" else NEEDLE_QUESTION).format(key=target)
    texts = [NEEDLE.format(key=k, value=v) for k, v in needles]
    fixed = len(tokenizer(NEEDLE_INTRO + "".join(texts) + question)["input_ids"])
    hay = text_window(tokenizer, max(16, num_tokens - fixed), seed)
    depths = sorted(rng.uniform(0.05, 0.95) for _ in needles)
    order = list(range(len(needles)))
    rng.shuffle(order)
    # split the haystack (in tokens) at the needle depths, on whole tokens
    cuts = [round(d * len(hay)) for d in depths]
    pieces, prev = [], 0
    for c, i in zip(cuts, order):
        pieces.append(tokenizer.decode(hay[prev:c]))
        pieces.append(texts[i])
        prev = c
    pieces.append(tokenizer.decode(hay[prev:]))
    prompt = NEEDLE_INTRO + "".join(pieces) + question
    return NeedleSample(
        prompt=prompt, key=target, values=answer, variant=variant, depths=tuple(depths),
        num_tokens=len(tokenizer(prompt)["input_ids"]), max_new_tokens=12 if variant != "multivalue" else 40,
    )


def needle_score(sample: NeedleSample, completion: str) -> float:
    """RULER string match: the fraction of the expected values present in the completion (single and
    multikey: 1 or 0 on the first number)."""
    found = re.findall(r"\d{7}", completion)
    if sample.variant == "multivalue":
        return sum(v in found for v in sample.values) / len(sample.values)
    return float(bool(found) and found[0] == sample.values[0])


@dataclass(frozen=True)
class TextSample:
    """``context`` token ids to prefill, then ``targets`` to decode (teacher-forced or compared)."""

    context: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)


def make_ppl(tokenizer: Any, num_tokens: int, decode_tokens: int, seed: int) -> TextSample:
    ids = text_window(tokenizer, num_tokens + decode_tokens, seed)
    return TextSample(context=ids[:num_tokens], targets=ids[num_tokens:])


def make_longgen(tokenizer: Any, num_tokens: int, seed: int) -> TextSample:
    """Real text followed by an instruction to continue writing about it."""
    suffix = tokenizer("\n\nNow write a long, detailed explanation of the documentation above:\n", add_special_tokens=False)["input_ids"]
    ids = text_window(tokenizer, num_tokens - len(suffix), seed)
    return TextSample(context=ids + suffix, targets=[])
