"""Training through a pipeline fold of a spec with views, and checkpoints between the
pipelined and the unpipelined folds with training going on (issue 21 point 5's "with pp 2
... and continue training").

Four gloo ranks, one spawn (tests/views_pp_train_scenarios.py): the example MoE through
specs/deepseek_moe_pp_folded.shard, cut into 2 stages by ``split_stage``, each stage
parallelized by ``parallelize`` (tensor parallelism, all-to-all expert dispatch, FSDP2 per
view) and trained through torch.distributed.pipelining against one process; saved at pp 2
and loaded at pp 1 (specs/deepseek_moe_folded.shard) and at pp 2, saved at pp 1 and loaded
at pp 2, each load bitwise and each continuation checked.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from shardspec.runtime.spec import MeshViews
from shardspec.testing import run_ranks
from tests import views_pp_train_scenarios as scenarios
from tests.test_views_pipeline import FakeMesh

WORLD = 4


def _views(rank: int) -> MeshViews:
    """The spec's views of 4 ranks at PP_EP as one process sees them (no process group):
    dense (pp 2, fsdp 2, tp 1), expert (pp 2, ep 2, efsdp 1)."""
    coord = [rank // 2, rank % 2, 0]
    return MeshViews(
        {
            "dense": FakeMesh(("pp", "fsdp", "tp"), (2, 2, 1), coord),
            "expert": FakeMesh(("pp", "ep", "efsdp"), (2, 2, 1), coord),
        }
    )


def test_the_stages_forwards_chain_to_the_whole_models() -> None:
    """The example MoE cut by split_stage runs as stages: stage 0 (embedding, layer 0)
    maps tokens to hidden states, stage 1 (layer 1, hc_head, norm, head) maps them to the
    whole model's logits, bitwise. Before, the forward called the embedding and the norm
    that split_stage had set to None."""
    layout = importlib.import_module(scenarios.PIPELINED)
    whole = scenarios.ets.example()
    tokens = scenarios.ets.batch(0)
    want = whole(tokens)
    stages = []
    for rank in (0, 2):
        stage = scenarios.ets.example()
        layout.split_stage(stage, _views(rank))
        stages.append(stage)
    assert stages[0].norm is None and stages[1].embed is None
    hidden = stages[0](tokens)
    assert hidden.shape == (*tokens.shape, whole.config.dim)
    assert torch.equal(stages[1](hidden), want)


def test_a_tied_last_stage_without_a_head_is_refused() -> None:
    """A tied model (``tie_embeddings``: no head module) whose last stage lost its
    embedding has no weight for its logits: the forward says so, not a TypeError on None."""
    from examples.models import moe

    model = moe.tiny(tie_embeddings=True)
    model.embed = None
    with pytest.raises(RuntimeError, match="a tied last pipeline stage without the embedding"):
        model(torch.zeros(1, 4, model.config.dim))


def test_the_pipeline_axis_is_no_tensor_parallel_axis() -> None:
    """parallelize takes its tensor-parallel axis from the view's model-parallel axes, the
    one of size > 1 where no parameter is cut: at tp 1 that was pp, and the q/k norms'
    sequence-parallel style then ran over the pipeline axis (their DTensors spanned
    (fsdp, pp), and parallelize refused its own result)."""
    from shardspec.runtime.parallel import tp_axes

    layout = importlib.import_module(scenarios.PIPELINED)
    assert tp_axes(layout.SPEC, "dense") == ("tp",)
    assert tp_axes(layout.SPEC, "expert") == ("ep",)
    single = importlib.import_module("generated.llama_pp")
    assert tp_axes(single.SPEC) == ("tp",)


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(scenarios.run_all, WORLD, timeout=300)


def _counts(results: list[dict[str, Any]], rank: int, prefix: str) -> dict[str, int]:
    return {t: n for t, n in results[rank]["count"].items() if t.startswith(prefix)}


@pytest.mark.dist
def test_no_scenario_failed(results: list[dict[str, Any]]) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:40])


def _stage_params(rank: int) -> int:
    """Parameters a rank's stage holds: the embedding and layer 0's 12 on stage 0; layer
    1's, the hyper-connection head's 3, the norm and the head on stage 1 (30 in all)."""
    return 13 if rank < WORLD // 2 else 17


@pytest.mark.dist
def test_pipelined_training_against_one_process(results: list[dict[str, Any]]) -> None:
    """Both folds on every rank: the stage's contents and its expert-parallel module, a
    gradient and a parameter per tensor of the stage and that every one has a gradient,
    and the losses on the last stage (their count and one per step) or none elsewhere."""
    for rank in range(WORLD):
        tags = _counts(results, rank, "train ")
        assert set(tags) == {
            "train skew",
            f"train gpipe {scenarios.PP_EP}",
            f"train 1f1b {scenarios.PP_TP}",
        }, tags
        losses = scenarios.ets.STEPS + 1 if rank >= WORLD // 2 else 1
        least = 2 + 2 * _stage_params(rank) + 1 + losses
        assert all(n >= least for t, n in tags.items() if t != "train skew"), (rank, tags)


@pytest.mark.dist
def test_checkpoints_move_between_pp_folds_and_training_goes_on(
    results: list[dict[str, Any]],
) -> None:
    """Every load checks each parameter the rank holds and its 3 AdamW tensors, bitwise
    (the whole model's 30 at pp 1, the stage's at pp 2), then the continuation: losses
    and every parameter."""
    for rank in range(WORLD):
        tags = _counts(results, rank, "ckpt ")
        loads = {"ckpt pp 2 -> pp 1", "ckpt pp 2 -> pp 2", "ckpt pp 1 -> pp 2"}
        assert set(tags) == {"ckpt pp 2 saved", "ckpt pp 1 saved", *loads}, tags
        n = _stage_params(rank)
        assert tags["ckpt pp 2 -> pp 1"] >= 1 + 4 * 30 + 3 + 30, (rank, tags)
        assert tags["ckpt pp 2 -> pp 2"] >= 1 + 4 * n + 1 + n, (rank, tags)
        assert tags["ckpt pp 1 -> pp 2"] >= 1 + 4 * n + 1 + n, (rank, tags)
