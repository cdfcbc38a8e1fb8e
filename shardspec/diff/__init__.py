"""``shardspec diff OLD NEW``: a spec change by its effect. :mod:`.facts` computes how the
mesh and each parameter's layout change, whether a checkpoint saved under OLD loads under
NEW, and how the hf mapping changes; :mod:`.render` writes them as text or JSON."""

from __future__ import annotations

from shardspec.diff.facts import Refusal, SpecDiff, Status, diff_specs
from shardspec.diff.render import render_json_diff, render_refusal, render_text

__all__ = [
    "Refusal",
    "SpecDiff",
    "Status",
    "diff_specs",
    "render_json_diff",
    "render_refusal",
    "render_text",
]
