"""Issue 24 point 6, first bullet: transformers' Qwen2 as it is, trained under FSDP2
dp_shard 2 x tp 2, sent to vLLM-style engines at tp 4 (KV heads replicated), tp 2 and one
rank, in one gloo job of 8 ranks (tests/qwen2_transfer_scenarios.py).

Every engine parameter must equal, bitwise, its slice of the trainer's ``export_hf``
tensors in vLLM's layout (tests/vllm_slices.py, vLLM's own weight_loader arithmetic); each
engine rank receives exactly the bytes it owns; the transfer makes no all-gather and no
broadcast (one all_reduce validates, one closes). The engine's own ``load_hf`` of the same
files gives the same tensors, and its ``export_hf`` writes the trainer's files back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardspec.testing import run_ranks
from shardspec.transfer import plan_json, plan_transfer
from tests import qwen2_transfer_scenarios as qs
from tests.transfer_checks import assert_point_to_point

REPO = Path(__file__).resolve().parents[1]
TPS = (4, 2, 1)


@pytest.fixture(scope="module")
def results(tmp_path_factory: Any) -> dict[str, Any]:
    import json

    folder = tmp_path_factory.mktemp("qwen2-transfer")
    plans: dict[int, str] = {}
    owned: dict[int, list[int]] = {}
    for tp in TPS:
        plan = plan_transfer(
            str(REPO / "specs" / "qwen2.shard"), str(REPO / "specs" / f"qwen2_vllm_tp{tp}.shard")
        )
        assert plan.status == 0, plan.diagnostics
        path = folder / f"plan-tp{tp}.json"
        path.write_text(json.dumps(plan_json(plan)))
        plans[tp], owned[tp] = str(path), plan.owned
    ranks = run_ranks(qs.qwen2_rounds, 8, str(folder), plans, timeout=500)
    return {"ranks": ranks, "owned": owned}


@pytest.mark.parametrize("tp", TPS)
def test_engine_equals_vllms_slice_of_the_export(results: dict[str, Any], tp: int) -> None:
    ranks = results["ranks"]
    owned = results["owned"][tp]
    for rank, out in enumerate(ranks):
        v = out["engines"][tp]
        if rank >= qs.T + tp:
            assert v == {}
            continue
        assert_point_to_point(v, rank, rank >= qs.T)
        if rank >= qs.T:
            assert v["load_mismatch"] == [], f"load_hf, rank {rank}: {v['load_mismatch']}"
            assert v["export_mismatch"] == [], f"export_hf, rank {rank}: {v['export_mismatch']}"
    received = [ranks[qs.T + r]["engines"][tp]["stats"].received_bytes for r in range(tp)]
    assert received == owned
    assert sum(ranks[r]["engines"][tp]["stats"].sent_bytes for r in range(qs.T)) == sum(owned)


def test_trainer_exports_over_its_own_group(results: dict[str, Any]) -> None:
    """export_hf's process_group: the trainer's 4 ranks of the 8-rank job export alone
    (the engine ranks take no part), and the files hold, bitwise, the trained model's
    tensors as torch gathers them (``full_tensor()``): the owner's answer the engines are
    compared with is the trainer's own."""
    for rank in range(qs.T):
        assert results["ranks"][rank]["export_vs_torch"] == [], rank
    for rank in range(qs.T, 8):
        assert "export_vs_torch" not in results["ranks"][rank]
