"""RULER's aggregation tasks: common-words extraction (cwe) and frequent-words extraction (fwe).

* **cwe**: a numbered list ``1. word 2. word ...`` of shuffled words; `NUM_COMMON` common words appear
  `COMMON_FREQ` times each, every other word `UNCOMMON_FREQ` times. The answer is the common words; the number
  of uncommon words is searched to fit the length. One solved example is prepended (our choice of size, which
  RULER's definition leaves open: `NUM_COMMON` words x `EXAMPLE_COMMON_FREQ` and `EXAMPLE_NUM_UNCOMMON` words x 1, drawn
  apart from the task's words).
* **fwe**: a vocabulary of ``max(5, length // 50)`` random 6-letter coded words; the word of rank ``k`` appears
  ``floor(N k^-alpha / zeta(alpha))`` times (alpha = 2), shuffled, and the rank-1 word is replaced by ``...``
  as noise. The answer is the words of ranks 2-4; ``N`` is searched to fit.
"""

from __future__ import annotations

import math
import random
from functools import partial

from icecache.eval.ruler.haystack import common_vocabulary, distinct_draws, random_letters
from icecache.eval.ruler.sample import Draft, Rendered
from icecache.eval.ruler.text import TextBuilder

CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
    "above list?"
)
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
CWE_TOKENS_TO_GENERATE = 120
NUM_COMMON = 10
COMMON_FREQ = 30
UNCOMMON_FREQ = 3
EXAMPLE_COMMON_FREQ = 3
EXAMPLE_NUM_UNCOMMON = 10

FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_TOKENS_TO_GENERATE = 50
ZIPF_ALPHA = 2.0
ZETA_OF_ALPHA = math.pi**2 / 6  # zeta(2)
CODED_WORD_LETTERS = 6
TOKENS_PER_VOCABULARY_WORD = 50
NOISE_WORD = "..."


def _numbered(builder: TextBuilder, words: list[str], marked: frozenset[str] = frozenset()) -> None:
    """Append ``1. w1 2. w2 ...``, marking the words (not their numbers) that are in ``marked``."""
    for i, word in enumerate(words, 1):
        builder.add(f"{' ' if i > 1 else ''}{i}. ")
        builder.add(word, marked=word in marked)


def draft_cwe(rng: random.Random, length: int) -> Draft:
    """Draw the words and the solved example of one cwe sample; ``render(n)`` uses ``n`` uncommon words."""
    vocabulary = list(common_vocabulary())
    rng.shuffle(vocabulary)
    num_example = NUM_COMMON + EXAMPLE_NUM_UNCOMMON
    example_common = vocabulary[:NUM_COMMON]
    example_words = example_common * EXAMPLE_COMMON_FREQ + vocabulary[NUM_COMMON:num_example]
    common = vocabulary[num_example : num_example + NUM_COMMON]
    pool = vocabulary[num_example + NUM_COMMON :]
    rng.shuffle(example_words)
    example_list = TextBuilder()
    _numbered(example_list, example_words)
    example = CWE_TEMPLATE.format(context=example_list.text()) + CWE_ANSWER_PREFIX + " " + " ".join(example_common)
    head, question = CWE_TEMPLATE.split("{context}")
    render_seed = rng.getrandbits(64)
    marked = frozenset(common)

    def render(num_units: int) -> Rendered:
        words = common * COMMON_FREQ + pool[:num_units] * UNCOMMON_FREQ
        random.Random(render_seed).shuffle(words)
        text = TextBuilder()
        text.add(example + "\n\n" + head)
        _numbered(text, words, marked)
        return Rendered(context=text.text(), question=question, spans=tuple(text.spans))

    return Draft(tuple(common), CWE_ANSWER_PREFIX, render, min_units=1, max_units=len(pool), unit="uncommon word")


def zipf_counts(num_words: int, vocabulary_size: int, alpha: float = ZIPF_ALPHA) -> list[int]:
    """``floor(num_words * k^-alpha / zeta(alpha))`` for ranks ``k = 1 .. vocabulary_size`` (alpha = 2 only)."""
    if alpha != 2.0:
        raise AssertionError("zipf_counts: only alpha = 2 (RULER's value) has its zeta constant here")
    return [math.floor(num_words * k**-alpha / ZETA_OF_ALPHA) for k in range(1, vocabulary_size + 1)]


def fwe_min_words() -> int:
    """The smallest ``N`` from which ranks 2 > 3 > 4 > 5 always have strictly decreasing counts.

    ``floor(x) - floor(y) >= 1`` once ``x - y >= 1``; the closest pair is ranks 4 and 5.
    """
    return math.ceil(ZETA_OF_ALPHA / (4**-ZIPF_ALPHA - 5**-ZIPF_ALPHA))


def draft_fwe(rng: random.Random, length: int) -> Draft:
    """Draw the coded vocabulary of one fwe sample; ``render(n)`` lays out ``n`` Zipf-distributed words."""
    vocabulary_size = max(5, length // TOKENS_PER_VOCABULARY_WORD)
    draw = partial(random_letters, num_letters=CODED_WORD_LETTERS)
    vocabulary = distinct_draws(draw, rng, vocabulary_size)
    answers = tuple(vocabulary[1:4])
    head, question = FWE_TEMPLATE.split("{context}")
    render_seed = rng.getrandbits(64)
    marked = frozenset(answers)

    def render(num_units: int) -> Rendered:
        counts = zipf_counts(num_units, vocabulary_size)
        words = [w for w, c in zip(vocabulary, counts) for _ in range(c)]
        random.Random(render_seed).shuffle(words)
        text = TextBuilder()
        text.add(head)
        text.add_joined([(NOISE_WORD if w == vocabulary[0] else w, w in marked) for w in words], " ")
        return Rendered(context=text.text(), question=question, spans=tuple(text.spans))

    return Draft(answers, FWE_ANSWER_PREFIX, render, min_units=fwe_min_words(), unit="coded word")
