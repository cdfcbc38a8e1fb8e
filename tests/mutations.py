"""Hypothesis strategies shared by the fuzz tests: a text with a few pieces put in at
random places, over what was there."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


@st.composite
def mutated(draw: st.DrawFn, text: str, pieces: Sequence[str], edits: int = 4, cut: int = 6) -> str:
    """``text`` after 1 to ``edits`` edits, each one of ``pieces`` written over up to
    ``cut`` characters at a random place."""
    for _ in range(draw(st.integers(1, edits))):
        at = draw(st.integers(0, len(text)))
        gone = draw(st.integers(0, cut))
        text = text[:at] + draw(st.sampled_from(list(pieces))) + text[at + gone :]
    return text
