"""Views on 4 gloo ranks, one spawn (scenarios in ``tests/views_scenarios.py``): build_mesh
against torch's own meshes, distribute on each parameter's view, and checkpoints that move
between folds bitwise (issue 21 points 1 and 5, the layout side)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from shardspec.testing import run_ranks
from tests import views_scenarios

WORLD = 4


def _qwen3(folder: Path) -> None:
    """A Qwen3-MoE checkpoint with random weights, saved by transformers (several files)."""
    import transformers

    from examples.models import hf as hfm

    torch.manual_seed(3)
    m = transformers.Qwen3MoeForCausalLM(hfm.qwen3_moe_config())
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.02)
    m.save_pretrained(folder, max_shard_size="100KB")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("views")
    hf_dir = root / "qwen3"
    _qwen3(hf_dir)
    return run_ranks(views_scenarios.run_all, WORLD, str(root), str(hf_dir), timeout=240)


def _tags(results: list[dict[str, Any]], prefix: str) -> dict[str, int]:
    return {t: n for t, n in results[0]["count"].items() if t.startswith(prefix)}


def test_no_scenario_failed(results: list[dict[str, Any]]) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:40])


def test_build_mesh_matches_torchs_meshes(results: list[dict[str, Any]]) -> None:
    tags = _tags(results, "build_mesh ")
    # 3 folds x 2 views, each: names, shape, coordinate, mesh tensor, one group per axis
    assert len(tags) == 6 and all(n == 6 for n in tags.values()), tags


def test_distribute_places_every_parameter_on_its_view(results: list[dict[str, Any]]) -> None:
    tags = _tags(results, "distribute ")
    assert len(tags) == 3 and all(n >= 3 * 30 for n in tags.values()), tags


def test_checkpoints_move_between_folds(results: list[dict[str, Any]]) -> None:
    tags = _tags(results, "load ")
    assert set(tags) == {
        "load fold-a at ep 4, fsdp 4",
        "load fold-a at tp 4",
        "load fold-a at the single view",
        "load fold-ep4 at fold a",
        "load the single view at fold a",
    }
    assert all(n >= 1 + 3 * 30 for n in tags.values()), tags


def test_hf_keys_load_into_the_folded_model(results: list[dict[str, Any]]) -> None:
    """Per-expert HF keys (Qwen3-MoE's, saved by transformers) load into the folded model
    at ep 2 and ep 4: every mapped parameter is the owner's tensor, and each rank reads
    exactly the bytes of the shards it holds (its experts' only)."""
    tags = _tags(results, "load_hf ")
    assert len(tags) == 2 and all(n >= 26 for n in tags.values()), tags


def test_export_hf_from_the_folded_model_writes_the_owners_files(
    results: list[dict[str, Any]],
) -> None:
    """export_hf from the folded model (ep 2 and ep 4) writes transformers' own tensors
    again, bitwise, under their own keys (one per expert)."""
    tags = _tags(results, "export_hf ")
    assert len(tags) == 2 and all(n >= 1 + 40 for n in tags.values()), tags


def test_the_scenarios_cover_the_folds(tmp_path: Path) -> None:
    """The folds differ where the issue asks: ep 2 -> 4, dense tp 2 -> 4, fsdp 2 -> 4."""
    a, b, c = views_scenarios.FOLD_A, views_scenarios.FOLD_EP4, views_scenarios.FOLD_TP4
    assert (a["ep"], b["ep"], c["tp"]) == (2, 4, 4)
