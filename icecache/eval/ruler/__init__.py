"""RULER's synthetic long-context tasks, generated here from their definitions, and their scores.

RULER (Hsieh et al., 2024, arXiv 2404.06654) builds every sample from a seed, a tokenizer and a target
length; the facts used are in ``docs/ruler.md``. No code comes from NVIDIA's repository.

>>> from icecache.eval.ruler import TASKS, make_sample, score_sample
>>> sample = make_sample("niah_single_1", tokenizer, 4096, seed=42, index=0, chat_template=True)  # doctest: +SKIP
>>> score_sample(sample, prediction)                                                             # doctest: +SKIP

Modules: `haystack` (texts, word lists, random keys and values), `text` (assembly with needle spans),
`sample` (the record, prompt format, length search), `niah`, `tracing` (vt), `aggregation` (cwe, fwe),
`tasks` (registry, `make_sample`), `score`. Importing this package does no work: word lists and the essay
text load on first use.
"""

from icecache.eval.ruler.sample import RulerSample, length_tolerance
from icecache.eval.ruler.score import score_sample, string_match_all, string_match_part, task_score
from icecache.eval.ruler.tasks import DEFAULT_SEED, TASK_SPECS, TASKS, get_task, make_sample, make_samples

__all__ = [
    "DEFAULT_SEED",
    "TASKS",
    "TASK_SPECS",
    "RulerSample",
    "get_task",
    "length_tolerance",
    "make_sample",
    "make_samples",
    "score_sample",
    "string_match_all",
    "string_match_part",
    "task_score",
]
