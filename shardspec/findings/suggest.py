"""Suggestions for hints ("did you mean ...?"): the name most like one that was mistyped.

One measure of likeness (difflib's ratio) and one threshold, shared by the parser's hints
(keywords), the checks' hints (axes, dimensions, styles) and the coverage check's (parameter
names, which it compares segment by segment).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

CUTOFF = 0.6
"""How alike (:func:`likeness`) a name must be to be suggested."""


def likeness(a: str, b: str) -> float:
    """How alike ``a`` and ``b`` are, from 0 (nothing in common) to 1 (equal): difflib's
    ratio, with ``a`` and ``b`` in that order (the ratio is not always symmetric)."""
    return difflib.SequenceMatcher(a=a, b=b).ratio()


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice most like ``word`` (at least :data:`CUTOFF` alike), ``None`` if none is."""
    close = closest_few(word, choices, n=1)
    return close[0] if close else None


def closest_few(word: str, choices: Sequence[str], n: int = 3, cutoff: float = CUTOFF) -> list[str]:
    """Up to ``n`` choices most like ``word``, best first (at least ``cutoff`` alike): for a
    hint that offers several (explain's unknown parameter names)."""
    return difflib.get_close_matches(word, choices, n=n, cutoff=cutoff)


def did_you_mean(word: str, choices: Sequence[str], listed_as: str = "declared") -> str:
    """A hint for an unknown ``word``: the closest of ``choices``, if one is close, and all of
    them (``did you mean 'tp'? declared: dp, tp``)."""
    guess = closest(word, choices)
    listed = ", ".join(choices) if choices else "(none)"
    if guess is not None:
        return f"did you mean {guess!r}? {listed_as}: {listed}"
    return f"{listed_as}: {listed}"
