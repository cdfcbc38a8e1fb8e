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

MAX_COMPARED = 200
"""Names longer than this are not compared (nobody mistypes a name that long, and difflib's
cost grows with the product of the lengths): they are suggested for nothing, and get no
suggestion."""


def likeness(a: str, b: str) -> float:
    """How alike ``a`` and ``b`` are, from 0 (nothing in common) to 1 (equal): difflib's
    ratio, with ``a`` and ``b`` in that order (the ratio is not always symmetric); 0 when
    either is longer than :data:`MAX_COMPARED`, or when their lengths alone rule out
    :data:`CUTOFF` (then the exact ratio is below it too, and is not worked out)."""
    return ratio(a, b) if _may_reach(len(a), len(b), CUTOFF) else 0.0


def ratio(a: str, b: str) -> float:
    """difflib's ratio of ``a`` and ``b`` (0 to 1), to rank names by how alike they are
    with no cutoff; 0 when either is longer than :data:`MAX_COMPARED`."""
    if max(len(a), len(b)) > MAX_COMPARED:
        return 0.0
    return difflib.SequenceMatcher(a=a, b=b).ratio()


def _may_reach(la: int, lb: int, cutoff: float) -> bool:
    """Whether two names of lengths ``la`` and ``lb`` can be ``cutoff`` alike: the ratio is
    at most ``2 * min / (la + lb)``."""
    return la + lb == 0 or 2 * min(la, lb) >= cutoff * (la + lb)


def closest(word: str, choices: Sequence[str]) -> str | None:
    """The choice most like ``word`` (at least :data:`CUTOFF` alike), ``None`` if none is."""
    close = closest_few(word, choices, n=1)
    return close[0] if close else None


def closest_few(word: str, choices: Sequence[str], n: int = 3, cutoff: float = CUTOFF) -> list[str]:
    """Up to ``n`` choices most like ``word``, best first (at least ``cutoff`` alike): for a
    hint that offers several (explain's unknown parameter names). Names longer than
    :data:`MAX_COMPARED` take no part."""
    if len(word) > MAX_COMPARED:
        return []
    near = [c for c in choices if len(c) <= MAX_COMPARED and _may_reach(len(word), len(c), cutoff)]
    return difflib.get_close_matches(word, near, n=n, cutoff=cutoff)


def did_you_mean(word: str, choices: Sequence[str], listed_as: str = "declared") -> str:
    """A hint for an unknown ``word``: the closest of ``choices``, if one is close, and all of
    them (``did you mean 'tp'? declared: dp, tp``)."""
    guess = closest(word, choices)
    listed = ", ".join(choices) if choices else "(none)"
    if guess is not None:
        return f"did you mean {guess!r}? {listed_as}: {listed}"
    return f"{listed_as}: {listed}"
