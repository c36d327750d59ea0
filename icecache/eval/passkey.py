"""Passkey retrieval prompts (the filler-text protocol of Mohtashami & Jaggi 2023, used by Quest and IceCache).

A random 5-digit key is hidden at a chosen depth inside repeated filler sentences; the model must complete
"The pass key is" with it. Prompts are plain text (no chat template): the small embedded model retrieves
keys as a completion task, not as a chat turn.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\nWhat is the pass key? The pass key is"


@dataclass(frozen=True)
class PasskeySample:
    prompt: str
    answer: str
    depth: float
    num_tokens: int


def make_passkey(tokenizer: Any, num_tokens: int, depth: float, seed: int = 0) -> PasskeySample:
    """A passkey prompt of about ``num_tokens`` tokens with the key at relative ``depth`` in [0, 1]."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = str(random.Random(seed).randint(10000, 99999))
    fixed = len(tokenizer(INTRO + NEEDLE.format(key=key) + QUESTION)["input_ids"])
    per_filler = len(tokenizer(FILLER * 10)["input_ids"]) / 10
    n_fill = max(0, round((num_tokens - fixed) / per_filler))
    before = round(n_fill * depth)
    prompt = INTRO + FILLER * before + NEEDLE.format(key=key) + FILLER * (n_fill - before) + QUESTION
    return PasskeySample(prompt=prompt, answer=key, depth=depth, num_tokens=len(tokenizer(prompt)["input_ids"]))


def passkey_correct(sample: PasskeySample, completion: str) -> bool:
    """True when the first number in the completion is the key."""
    digits = "".join(ch if ch.isdigit() else " " for ch in completion).split()
    return bool(digits) and digits[0] == sample.answer
