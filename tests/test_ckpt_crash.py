"""A rank killed (``os._exit``) at each step of ``save`` (scenarios in
``tests/ckpt_crash_scenarios.py``): one spawn of 3 gloo ranks per kill point, then one
spawn that loads, recovers and saves every crashed path.

After each crash: every survivor raised a CheckpointError (never the backend's error)
naming the dead rank where it can be known, and the folders on disk are what the protocol
says; then the path holds the previous or the new checkpoint, bitwise, once the next load
or save has recovered it (and said so)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import ckpt_crash_scenarios as cs

# What each crash leaves: states of (path, path.partial, path.old).
LEFT = {
    "before-writes": ("complete", "saving", "missing"),
    "during-writes": ("complete", "saving", "missing"),
    "before-marker": ("complete", "saving", "missing"),
    "other-after-writes": ("complete", "missing", "missing"),
    "after-marker": ("complete", "complete", "missing"),
    "between-renames": ("missing", "complete", "complete"),
}
VERIFIED = {
    "before-writes": 9,
    "during-writes": 9,
    "before-marker": 9,
    "other-after-writes": 9,
    "after-marker": 10,
    "between-renames": 10,
    "restore-old": 3,
}


@pytest.mark.dist
def test_a_rank_killed_at_each_step_of_save(tmp_path: Path) -> None:
    problems = []
    for case, (_, victim, _) in cs.CASES.items():
        results = cs.run_with_victim(cs.crash, cs.WORLD, str(tmp_path), case)
        survivors = sorted(r for r in range(cs.WORLD) if r != victim)
        if sorted(results) != survivors:
            problems.append(f"{case}: results from ranks {sorted(results)}")
            continue
        for r, (status, value) in results.items():
            if status != "ok":
                problems.append(f"{case}: rank {r} failed:\n{value}")
                continue
            kind, msg = value["error"] or ("none", "no error raised")
            if kind != "CheckpointError":
                problems.append(f"{case}: rank {r} raised {kind}: {msg}")
                continue
            # Rank 0 hosts the job's store here, so its death leaves it unnamed, but said.
            name = f"rank(s) [{victim}] stopped" if victim else "usually rank 0"
            if name not in msg or "saving " not in msg:
                problems.append(f"{case}: rank {r}'s error lacks {name!r}: {msg}")
        path = os.path.join(tmp_path, case, "ckpt")
        left = tuple(cs.folder_state(p) for p in (path, path + ".partial", path + ".old"))
        if left != LEFT[case]:
            problems.append(f"{case}: left {left}, expected {LEFT[case]}")
    assert not problems, "\n".join(problems)
    results = cs.run_with_victim(cs.verify, cs.WORLD, str(tmp_path))
    assert sorted(results) == list(range(cs.WORLD))
    for r, (status, value) in results.items():
        assert status == "ok", value
        fails, counts = value
        assert not fails, f"rank {r}:\n" + "\n".join(fails)
        assert counts == VERIFIED, f"rank {r} checked {counts}"
