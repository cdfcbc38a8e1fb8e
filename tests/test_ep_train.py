"""parallelize and verify on a spec with views, trained with all-to-all token dispatch
(issue 21 points 3, 4, the training half of 5, and 6's training proofs).

Four gloo ranks, one spawn (tests/ep_train_scenarios.py): the example MoE and
transformers' Qwen3-MoE trained at expert ep 4 (dense fsdp 4) and at ep 2 x efsdp 2 with
dense tp 2 x fsdp 2 against a single process, routing skewed so that some experts get no
token; checkpoints saved at one fold, loaded at others and trained on; load_hf into a
parallelized folded model; verify of a trainer's own folded parallelization, accepted and
refused with each mismatch named; refusals that leave the model unchanged.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardspec.testing import run_ranks
from tests import ep_train_scenarios
from tests.test_views_dist import _qwen3 as qwen3_checkpoint

WORLD = 4


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("ep_train")
    hf_dir = root / "qwen3"
    qwen3_checkpoint(hf_dir)
    return run_ranks(ep_train_scenarios.run_all, WORLD, str(root), str(hf_dir), timeout=600)


def _counts(results: list[dict[str, Any]], prefix: str) -> dict[str, int]:
    return {t: n for t, n in results[0]["count"].items() if t.startswith(prefix)}


pytestmark = pytest.mark.dist


def test_no_scenario_failed(results: list[dict[str, Any]]) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:40])


def test_training_against_one_process(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "train ")
    # example MoE and Qwen3-MoE at two folds each; per run: experts styled, a gradient and a
    # parameter per tensor, STEPS losses, the skew
    assert len(tags) == 4, tags
    assert all(n >= 2 * 20 + ep_train_scenarios.STEPS + 2 for n in tags.values()), tags


def test_checkpoints_move_between_folds_and_training_goes_on(
    results: list[dict[str, Any]],
) -> None:
    tags = _counts(results, "ckpt ")
    assert set(tags) == {"ckpt fold a", "ckpt at ep 4", "ckpt at the single view"}, tags
    # loaded bitwise, losses, parameters: one of each per tensor at least
    assert tags["ckpt at ep 4"] >= 2 * 30 and tags["ckpt at the single view"] >= 2 * 30, tags


def test_load_hf_into_a_parallelized_folded_model(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "load_hf parallelized")
    assert len(tags) == 2 and all(n >= 25 for n in tags.values()), tags


def test_verify_accepts_a_trainers_own_fold_and_names_mismatches(
    results: list[dict[str, Any]],
) -> None:
    tags = _counts(results, "verify ")
    assert set(tags) == {
        "verify by hand",
        "verify experts on efsdp",
        "verify no dispatch",
        "verify dense fsdp on expert",
    }, tags


def test_refusals_leave_the_model_unchanged(results: list[dict[str, Any]]) -> None:
    tags = _counts(results, "refuse ")
    assert len(tags) == 2 and all(n == 2 for n in tags.values()), tags
