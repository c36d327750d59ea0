"""RULER's scores: per-sample string matching, and a task's score as the mean x 100.

The prediction is post-processed by stripping surrounding whitespace only (RULER's rule), then each
reference is looked for as a case-insensitive substring:

* `string_match_all`: the fraction of references found (every synthetic task);
* `string_match_part`: 1.0 when any reference is found (RULER's QA tasks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from icecache.core.errors import ConfigError


def _found(prediction: str, references: Sequence[str]) -> list[bool]:
    if isinstance(references, str) or not references:
        raise ConfigError("references must be a non-empty sequence of strings (not one string)")
    text = prediction.strip().lower()
    return [ref.lower() in text for ref in references]


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of ``references`` found in ``prediction`` (case-insensitive substrings), in [0, 1]."""
    found = _found(prediction, references)
    return sum(found) / len(found)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 when at least one of ``references`` is found in ``prediction`` (case-insensitive), else 0.0."""
    return 1.0 if any(_found(prediction, references)) else 0.0


METRICS = {"all": string_match_all, "part": string_match_part}


def score_sample(sample: Any, prediction: str) -> float:
    """Score ``prediction`` against a `RulerSample`'s answers with the sample's metric, in [0, 1]."""
    return METRICS[sample.metric](prediction, sample.answers)


def task_score(sample_scores: Sequence[float]) -> float:
    """A task's score: the mean of its per-sample scores x 100 (RULER's convention)."""
    if not sample_scores:
        raise ConfigError("task_score needs at least one sample score")
    return 100.0 * sum(sample_scores) / len(sample_scores)
