"""Long real text that ships with Python (nothing is downloaded): the corpora of the benchmarks and tasks.

`real_text` is Python's own documentation (``pydoc_data.topics``, about 113k tokens for SmolLM2's tokenizer);
`long_text_ids` continues it, when more tokens are needed, with the standard library's ``*.py`` sources in
name order. A leaf module: it imports no torch; a tokenizer is passed in.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = ["real_text", "stdlib_sources", "long_text_ids", "stdlib_text_ids", "TEXTS"]

#: the corpora a benchmark can read its prompt from (``--text``): prose, or code
TEXTS = ("docs", "stdlib")


@lru_cache(maxsize=1)
def real_text() -> str:
    """Python's own documentation topics (``pydoc_data.topics``), concatenated in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def stdlib_sources() -> Iterator[str]:
    """The text of every ``*.py`` file of the standard library's top folder, in name order (unreadable ones
    skipped)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    for f in sorted(lib.glob("*.py")):
        try:
            yield f.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue


def long_text_ids(tokenizer: Any, min_tokens: int) -> list[int]:
    """Token ids (at least ``min_tokens`` when the texts suffice) of `real_text` (with the tokenizer's special
    tokens), followed by ``"\\n\\n" + source`` of `stdlib_sources` (without them) until ``min_tokens`` is reached."""
    ids = list(tokenizer(real_text())["input_ids"])
    if len(ids) < min_tokens:
        for text in stdlib_sources():
            if len(ids) >= min_tokens:
                break
            ids += tokenizer("\n\n" + text, add_special_tokens=False)["input_ids"]
    return ids


def stdlib_text_ids(tokenizer: Any, min_tokens: int) -> list[int]:
    """Token ids (at least ``min_tokens`` when the sources suffice) of the standard library's ``*.py`` sources in
    name order, joined by blank lines (the tokenizer's special tokens first): a second corpus, code rather
    than prose, for checks that should not rest on one text."""
    ids = list(tokenizer("", add_special_tokens=True)["input_ids"])
    for text in stdlib_sources():
        if len(ids) >= min_tokens:
            break
        ids += tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"]
    return ids
