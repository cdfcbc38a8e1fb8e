"""Expert parallelism under sequence parallelism, ep borrowing the dense view's tp ranks
(torchtitan's layout; issue 21 point 3's "TP (and sequence parallelism)" with experts):
parallelize trains the example MoE and transformers' Qwen3-MoE against one process,
verify accepts a trainer's own and names its mismatches, parallelize refuses what it does
not apply before the model changes. Four gloo ranks, one spawn
(tests/ep_sp_scenarios.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardspec.testing import run_ranks
from tests import ep_sp_scenarios, ep_train_scenarios
from tests.ep_sp_specs import compile_all

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    gen = tmp_path_factory.mktemp("ep_sp")
    compile_all(Path(gen))
    return run_ranks(ep_sp_scenarios.run_all, 4, str(gen), timeout=600)


def _counts(results: list[dict[str, Any]], prefix: str) -> dict[str, int]:
    return {t: n for t, n in results[0]["count"].items() if t.startswith(prefix)}


def test_no_scenario_failed(results: list[dict[str, Any]]) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:40])


def test_training_against_one_process(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "train sp ")
    # the example MoE and transformers' Qwen3-MoE at each fold
    assert len(tags) == 2 * len(ep_sp_scenarios.FOLDS), tags
    # per run: experts styled (2), a gradient and a parameter per tensor (over 20 each),
    # the losses, the skew
    assert all(n >= 2 + 2 * 20 + ep_train_scenarios.STEPS + 2 for n in tags.values()), tags


def test_each_rank_routes_its_own_tokens(results: list[dict[str, Any]]) -> None:
    assert _counts(results, "sp local tokens") == {"sp local tokens": 2}


def test_verify_accepts_a_trainers_own_and_names_mismatches(
    results: list[dict[str, Any]],
) -> None:
    assert set(_counts(results, "verify sp")) == {
        "verify sp by hand",
        "verify sp no local tokens",
        "verify sp ep pairs other ranks",
    }


def test_refusals_leave_the_model_unchanged(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "refuse sp ")
    assert len(tags) == 3 and all(n == 2 for n in tags.values()), tags


def test_checkpoints_move_between_the_sp_fold_and_others(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "ckpt sp ")
    # per destination: the fresh model differs, then every parameter (over 20) bitwise
    assert set(tags) == {"ckpt sp into ep outermost", "ckpt sp back at ep 4"}, tags
    assert all(n >= 1 + 20 for n in tags.values()), tags
