"""RULER's variable-tracking task (vt, multi-hop tracing).

One chain of 4 hops, ``VAR ABCDE = 12345``, ``VAR FGHIJ = VAR ABCDE``, ... (5 variables, 5-letter upper-case
names, a 5-digit value), its lines inserted in order at random gaps of the noise haystack. The answer is all 5
names. One short solved example of the same task (3-letter names, value 12345, `EXAMPLE_NOISE_LINES` noise
lines) is prepended, as RULER does.
"""

from __future__ import annotations

import random
from functools import partial

from icecache.eval.ruler.haystack import NOISE_UNIT, distinct_draws, random_letters, random_number
from icecache.eval.ruler.sample import Draft, Rendered
from icecache.eval.ruler.text import TextBuilder, weave

TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
ANSWER_PREFIX = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are assigned "
    "the value {query}, they are: "
)

TOKENS_TO_GENERATE = 30
NUM_HOPS = 4
NAME_LETTERS = 5
VALUE_DIGITS = 5
EXAMPLE_NAME_LETTERS = 3
EXAMPLE_VALUE = "12345"
EXAMPLE_NOISE_LINES = 5


def make_chain(names: list[str], value: str) -> list[str]:
    """``["VAR A = value", "VAR B = VAR A", ...]``: each name after the first takes the previous one."""
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in zip(names, names[1:])]


def _chain_text(base: list[str], chain: list[str], r: random.Random) -> TextBuilder:
    """``base`` lines joined by newlines, the chain lines inserted in order at distinct random gaps."""
    gaps = sorted(r.sample(range(len(base) + 1), len(chain)))
    text = TextBuilder()
    text.add_joined(weave(base, list(zip(gaps, chain))), "\n")
    return text


def solved_example(rng: random.Random) -> str:
    """The in-context example: the task on a short noise haystack, with its answer after the answer prefix."""
    names = distinct_draws(partial(random_letters, num_letters=EXAMPLE_NAME_LETTERS, upper=True), rng, NUM_HOPS + 1)
    context = _chain_text([NOISE_UNIT] * EXAMPLE_NOISE_LINES, make_chain(names, EXAMPLE_VALUE), rng).text()
    prompt = TEMPLATE.format(context=context, query=EXAMPLE_VALUE)
    return prompt + ANSWER_PREFIX.format(num_v=len(names), query=EXAMPLE_VALUE) + " ".join(names)


def draft_vt(rng: random.Random, length: int) -> Draft:
    """Draw the chain and the solved example of one vt sample; ``render(n)`` uses ``n`` noise lines."""
    names = distinct_draws(partial(random_letters, num_letters=NAME_LETTERS, upper=True), rng, NUM_HOPS + 1)
    value = distinct_draws(partial(random_number, digits=VALUE_DIGITS), rng, 1, avoid=[EXAMPLE_VALUE])[0]
    chain = make_chain(names, value)
    example = solved_example(rng)
    head, tail = TEMPLATE.split("{context}")
    question = tail.format(query=value)
    answer_prefix = ANSWER_PREFIX.format(num_v=len(names), query=value)
    render_seed = rng.getrandbits(64)

    def render(num_units: int) -> Rendered:
        lines = _chain_text([NOISE_UNIT] * num_units, chain, random.Random(render_seed))
        offset = len(example) + 2 + len(head)
        spans = tuple((a + offset, b + offset) for a, b in lines.spans)
        return Rendered(context=example + "\n\n" + head + lines.text(), question=question, spans=spans)

    return Draft(tuple(names), answer_prefix, render, min_units=len(chain), unit="noise line")
