"""A rank killed (``os._exit``) at each step of ``save`` (scenarios in
``tests/ckpt_crash_scenarios.py``), on 3 gloo ranks: one round of
``tests/kill_harness.py`` per kill point, all in one spawn, then a round that loads,
recovers and saves every crashed path.

After each crash: every survivor raised a CheckpointError (never the backend's error)
naming the dead rank where it can be known, well within a bound far under the process
group's timeout (no survivor waits out the timeout for another that gave up), and the
folders on disk are what the protocol says; then the path holds the previous or the new
checkpoint, bitwise, once the next load or save has recovered it (and said so)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from tests import ckpt_crash_scenarios as cs
from tests.kill_harness import run_rounds, survivor_problems, verify_problems

# What each crash leaves: states of (path, path.partial, path.old).
LEFT = {
    "before-writes": ("complete", "saving", "missing"),
    "during-writes": ("complete", "saving", "missing"),
    "before-marker": ("complete", "saving", "missing"),
    "other-after-writes": ("complete", "missing", "missing"),
    "async-after-writes": ("complete", "missing", "missing"),
    "after-marker": ("complete", "complete", "missing"),
    "between-renames": ("missing", "complete", "complete"),
}
VERIFIED = {
    "before-writes": 9,
    "during-writes": 9,
    "before-marker": 9,
    "other-after-writes": 9,
    "async-after-writes": 9,
    "after-marker": 10,
    "between-renames": 10,
    "restore-old": 3,
}
PG_TIMEOUT = 120.0  # the default process group's
BOUND = 30.0  # a survivor's save, from its call to its error


def _setup() -> None:
    import generated.llama  # noqa: F401  (imported once, in the host)


@pytest.mark.dist
def test_a_rank_killed_at_each_step_of_save(tmp_path: Path) -> None:
    root = str(tmp_path)
    rounds = [(case, cs.crash, (root, case)) for case in cs.CASES]
    rounds.append(("verify", cs.verify, (root,)))
    after = functools.partial(_left, root)
    results = run_rounds(
        cs.WORLD, rounds, after=after, setup=_setup, timeout=240, pg_timeout=PG_TIMEOUT
    )
    victims = {case: victim for case, (_, victim, _) in cs.CASES.items()}
    problems = survivor_problems(
        results,
        victims,
        cs.WORLD,
        error="CheckpointError",
        bound=BOUND,
        check=lambda case, msg: None if "saving " in msg else "not a save's error",
    )
    problems += [
        f"{case}: left {results[case]['after']}, expected {LEFT[case]}"
        for case in cs.CASES
        if results[case]["after"] != LEFT[case]
    ]
    problems += verify_problems(results, cs.WORLD, VERIFIED)
    assert not problems, "\n".join(problems)


def _left(root: str, name: str) -> tuple[str, str, str] | None:
    return cs.left(root, name) if os.path.isdir(os.path.join(root, name)) else None
