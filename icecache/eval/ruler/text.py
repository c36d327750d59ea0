"""Assembling prompt text while remembering where the needles went (character spans)."""

from __future__ import annotations

from collections.abc import Sequence

Span = tuple[int, int]


class TextBuilder:
    """Concatenates pieces of text and records the ``[start, end)`` character span of each marked piece.

    Examples
    --------
    >>> b = TextBuilder()
    >>> b.add("haystack ")
    >>> b.add("needle", marked=True)
    >>> b.text(), b.spans
    ('haystack needle', [(9, 15)])
    """

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._num_chars = 0
        self.spans: list[Span] = []

    def add(self, piece: str, marked: bool = False) -> None:
        """Append ``piece``; remember its span when ``marked``."""
        if marked:
            self.spans.append((self._num_chars, self._num_chars + len(piece)))
        self._parts.append(piece)
        self._num_chars += len(piece)

    def add_joined(self, pieces: Sequence[tuple[str, bool]], sep: str) -> None:
        """Append ``(text, marked)`` pieces joined by ``sep`` (separators are never marked)."""
        for i, (piece, marked) in enumerate(pieces):
            if i:
                self.add(sep)
            self.add(piece, marked)

    def text(self) -> str:
        """Everything added so far."""
        return "".join(self._parts)


def weave(base: Sequence[str], inserts: Sequence[tuple[int, str]]) -> list[tuple[str, bool]]:
    """``base`` items (unmarked) with ``inserts`` (marked) placed before ``base[gap]``.

    Parameters
    ----------
    base : the haystack units, in order.
    inserts : ``(gap, text)`` pairs, ``0 <= gap <= len(base)``; ``gap == len(base)`` appends at the end.
        Inserts at the same gap keep their order in ``inserts``.

    Returns
    -------
    ``(text, marked)`` pieces for `TextBuilder.add_joined`.
    """
    by_gap: dict[int, list[str]] = {}
    for gap, text in inserts:
        if not 0 <= gap <= len(base):
            raise AssertionError(f"insert gap {gap} outside 0..{len(base)} (a bug in the task builder)")
        by_gap.setdefault(gap, []).append(text)
    pieces: list[tuple[str, bool]] = []
    for gap in range(len(base) + 1):
        pieces.extend((text, True) for text in by_gap.get(gap, ()))
        if gap < len(base):
            pieces.append((base[gap], False))
    return pieces
