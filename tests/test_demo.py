"""The demo's training story (examples/story.py) on 4 gloo ranks, so the demo cannot rot:
parallelize, train, save, load on another mesh, continue, bitwise against torch."""

from __future__ import annotations

import pytest

from examples.story import train_story
from shardspec.testing import run_ranks


@pytest.mark.dist
def test_demo_training_story(tmp_path) -> None:
    lines = run_ranks(train_story, 4, str(tmp_path), timeout=180)
    text = "\n".join(lines[0])
    assert "verify passed" in text
    assert "losses equal, max parameter delta 0.0" in text
    assert all(not other for other in lines[1:])  # rank 0 reports
