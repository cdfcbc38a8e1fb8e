"""``shardspec explain SPEC FQN``: which rule places a parameter, why it wins, and every
rank's local shape and global offset. :mod:`.facts` computes it as typed values,
:mod:`.render` writes them as text."""

from __future__ import annotations

from shardspec.explain.facts import Explanation, Refusal, explain_facts
from shardspec.explain.render import render_text

__all__ = ["Explanation", "Refusal", "explain_facts", "render_text"]
