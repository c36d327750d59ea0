"""The raw material of RULER prompts: haystack texts, word lists and random keys and values.

Three haystacks (docs/ruler.md):

* **noise**: `NOISE_UNIT` ("The grass is green. ...") repeated, one unit per line.
* **essay**: real prose. RULER uses Paul Graham's essays, which do not ship here; we use the prose paragraphs
  of Python's own documentation, ``pydoc_data.topics`` (stdlib, present on every machine), with code blocks
  and headings dropped and whitespace collapsed (`essay_words`).
* **needles**: distractor needle sentences (built in `icecache.eval.ruler.niah`).

Word keys are "adjective-noun" pairs from the ``wonderwords`` package's word lists (read from its asset files,
so no wonderwords RNG is involved), numbers have 7 digits, UUIDs are version 4 built from the caller's seeded
RNG (``uuid.uuid4()`` is not seedable). Everything is loaded lazily and cached; nothing happens at import.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Callable, Collection
from functools import cache, lru_cache

NOISE_UNIT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."

NEEDLE_DEPTHS: tuple[int, ...] = tuple(round(100 * i / 39) for i in range(40))
"""The 40 evenly spaced needle depths (percent of the essay's sentences, 0 and 100 included)."""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(\[])")
_HEADING_RULE = re.compile(r"[*=\-~^\"#+]{3,}")


@lru_cache(maxsize=1)
def essay_words() -> tuple[str, ...]:
    """The essay haystack as words: the prose paragraphs of ``pydoc_data.topics``, topics in sorted order.

    A paragraph (blank-line separated) is dropped when it is indented (a code or grammar block) or is a
    heading (its last line is a rule of ``*``, ``=``, ``-``, ...). About 40k words (~55k SmolLM2 tokens);
    longer haystacks repeat it, as RULER repeats its essays.
    """
    from pydoc_data.topics import topics

    words: list[str] = []
    for name in sorted(topics):
        for paragraph in re.split(r"\n\s*\n", topics[name]):
            lines = [line for line in paragraph.split("\n") if line.strip()]
            if not lines or lines[0].startswith(" ") or _HEADING_RULE.fullmatch(lines[-1].strip()):
                continue
            words.extend(paragraph.split())
    return tuple(words)


def essay_sentences(num_words: int) -> list[str]:
    """The first ``num_words`` words of the essay (repeated when longer), split into sentences.

    A sentence ends at ``.``, ``!`` or ``?`` followed by whitespace and an upper-case letter, quote or bracket
    (so "e.g. foo" stays whole). The last sentence may be cut mid-way, as in RULER.
    """
    words = essay_words()
    reps, rest = divmod(num_words, len(words))
    text = " ".join(words * reps + words[:rest])
    return [s for s in _SENTENCE_END.split(text) if s]


@cache
def word_list(name: str) -> tuple[str, ...]:
    """One of wonderwords' word lists (``"adjective"``, ``"noun"``, ``"verb"``, ``"profanity"``), in file order.

    Only lower-case alphabetic single words are kept (no spaces, hyphens or capitals), deduplicated.
    """
    from importlib.resources import files

    raw = files("wonderwords.assets").joinpath(f"{name}list.txt").read_text(encoding="utf-8")
    return tuple(dict.fromkeys(w.strip() for w in raw.splitlines() if w.strip().isalpha() and w.strip().islower()))


@lru_cache(maxsize=1)
def common_vocabulary() -> tuple[str, ...]:
    """Words for the common-words task: wonderwords' nouns, adjectives and verbs, without profanity."""
    banned = set(word_list("profanity"))
    merged = dict.fromkeys(word_list("noun") + word_list("adjective") + word_list("verb"))
    return tuple(w for w in merged if w not in banned)


def random_word_key(rng: random.Random) -> str:
    """An "adjective-noun" key, e.g. ``"quizzical-harbor"``."""
    return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A ``digits``-digit decimal number (no leading zero)."""
    return str(rng.randrange(10 ** (digits - 1), 10**digits))


def random_uuid(rng: random.Random) -> str:
    """A version-4 UUID string from ``rng``'s bits."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_letters(rng: random.Random, num_letters: int, upper: bool = False) -> str:
    """``num_letters`` random ASCII letters (lower case unless ``upper``)."""
    alphabet = string.ascii_uppercase if upper else string.ascii_lowercase
    return "".join(rng.choices(alphabet, k=num_letters))


def distinct_draws(
    draw: Callable[[random.Random], str], rng: random.Random, count: int, avoid: Collection[str] = ()
) -> list[str]:
    """``count`` distinct strings from ``draw(rng)``, none equal to, containing or contained in one of ``avoid``.

    The containment rule keeps every ``avoid`` string findable exactly once: ``"red-apple"`` is not a
    substring of any drawn ``"bored-apple"``. Draws are not checked against each other for containment.
    """
    seen: set[str] = set(avoid)
    out: list[str] = []
    while len(out) < count:
        item = draw(rng)
        if item in seen or any(a in item or item in a for a in avoid):
            continue
        seen.add(item)
        out.append(item)
    return out
