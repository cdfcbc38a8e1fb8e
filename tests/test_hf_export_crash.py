"""A rank killed (``os._exit``) at each step of export_hf (scenarios in
``tests/hf_export_crash_scenarios.py``), on 3 gloo ranks: one round of
``tests/kill_harness.py`` per kill point, all in one spawn, then a round that exports over
every crashed path.

After each crash: every survivor raised an ``HFError`` (never the backend's error) that
names the dead rank where it can be known and says what ``path`` holds (never "unchanged"
once rank 0 may have renamed it), within a bound well under the process group's timeout;
the folders on disk are what the protocol says; and the next export_hf finishes or undoes
what was left, says so on every rank, and writes its export bitwise, with no debris.
The same steps in one process, around users' folders, are tests/test_hf_export_folders.py.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests import hf_export_crash_scenarios as xs
from tests.kill_harness import run_rounds, survivor_problems, verify_problems

# What each crash leaves: states of (path, path.partial, path.replaced).
LEFT = {
    "prepared": ("complete", "missing", "missing"),
    "exchange-writer": ("complete", "missing", "missing"),
    "exchange-sender": ("complete", "missing", "missing"),
    "exchange-rank0": ("complete", "saving", "missing"),
    "exchanged": ("complete", "missing", "missing"),
    "writing": ("complete", "missing", "missing"),
    "written-rank0": ("complete", "saving", "missing"),
    "written-other": ("complete", "missing", "missing"),
    "marked": ("complete", "complete", "missing"),
    "renamed-old": ("missing", "complete", "complete"),
    "renamed-new": ("complete", "missing", "complete"),
}
# Before rank 0 finishes, path is unchanged; after, the error must say what it may hold.
UNCHANGED = {
    "prepared",
    "exchange-writer",
    "exchange-sender",
    "exchange-rank0",
    "exchanged",
    "writing",
}
PG_TIMEOUT = 120.0
BOUND = 30.0  # a survivor's export, from its call to its error (as save's)


def _setup() -> None:
    import generated.llama  # noqa: F401  (imported once, in the host)


@pytest.mark.dist
def test_a_rank_killed_at_each_step_of_export_hf(tmp_path: Path) -> None:
    root = str(tmp_path)
    rounds = [(case, xs.crash, (root, case)) for case in xs.CASES]
    rounds.append(("verify", xs.verify, (root,)))
    results = run_rounds(
        xs.WORLD,
        rounds,
        after=functools.partial(xs.left, root),
        setup=_setup,
        timeout=240,
        pg_timeout=PG_TIMEOUT,
    )
    victims = {case: victim for case, (_, victim, _) in xs.CASES.items()}
    problems = survivor_problems(
        results, victims, xs.WORLD, error="HFError", bound=BOUND, check=_says_what_path_holds
    )
    problems += [
        f"{case}: left {results[case]['after']}, expected {LEFT[case]}"
        for case in xs.CASES
        if results[case]["after"] != LEFT[case]
    ]
    counts = {case: 6 for case in xs.CASES} | {"groups": 9, "process_group": 4, "config": 2}
    problems += verify_problems(results, xs.WORLD, counts)
    assert not problems, "\n".join(problems)


def _says_what_path_holds(case: str, msg: str) -> str | None:
    """Before rank 0 finishes, ``path`` is unchanged; after, the error says what it may
    hold (a rank 0 killed between its renames left it missing: never "unchanged")."""
    if not msg.startswith("export to "):
        return "not an export's error"
    if ("is unchanged" in msg) != (case in UNCHANGED):
        return "misstates what the path holds"
    return None
