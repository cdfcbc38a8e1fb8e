"""The expert-parallel style (shardspec/runtime/expert_parallel.py).

One process: the routing helpers (hypothesis, any routing including empty experts and
skipped slots) and the forward conventions. Four gloo ranks, one spawn: training
scenarios against a single process and the refusals (tests/expert_parallel_scenarios.py).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardspec.runtime.expert_parallel import (
    ExpertParallelError,
    convention_of,
    inverse_permutation,
    local_order,
    sort_routed,
)
from shardspec.testing import run_ranks
from tests import expert_parallel_scenarios

# Checks each scenario must make on every rank (a scenario that checks nothing fails):
# skew 2; output, restored after the call, a deep copy (not under FSDP2), loss, input grad;
# each parameter's grad and each expert tensor's placement; rank 3 receiving nothing on
# ep 4 (under etp: the all-reduces); the collectives and their bytes.
MIN_CHECKS = {
    "example ep4": 2 + 5 + 1 + 2 * 3 + 1 + 1,
    "example ep2": 2 + 5 + 1 + 2 * 3 + 1,
    "example ep2 fsdp": 2 + 4 + 1 + 2 * 3 + 1,
    "qwen3 ep4": 2 + 5 + 1 + 2 * 2 + 1 + 1,
    "example etp": 2 + 5 + 1 + 2 * 3 + 1 + 1,
    "qwen3 etp": 2 + 5 + 1 + 2 * 2 + 1 + 1,
    "grouped ep4": 2 + 5 + 1 + 2 * 3 + 1 + 1,
    "refusals": 7 * 2 + 2 * 2 + 4,
    "any routing": 30 * (3 + 2),
}


@st.composite
def routings(draw: st.DrawFn) -> tuple[torch.Tensor, int]:
    experts = draw(st.integers(1, 9))
    n = draw(st.integers(0, 12))
    k = draw(st.integers(1, experts))
    # Values up to `experts` inclusive: transformers' "skip".
    flat = draw(st.lists(st.integers(0, experts), min_size=n * k, max_size=n * k))
    return torch.tensor(flat, dtype=torch.int64).reshape(n, k), experts


@settings(max_examples=200, deadline=None)
@given(routings())
def test_sort_routed_groups_slots_by_expert(case: tuple[torch.Tensor, int]) -> None:
    index, experts = case
    order, counts = sort_routed(index, experts)
    flat = index.reshape(-1).tolist()
    want = sorted((e, slot) for slot, e in enumerate(flat) if e < experts)
    assert [(flat[s], s) for s in order.tolist()] == want
    assert counts.tolist() == [flat.count(e) for e in range(experts)]


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda ep: st.integers(1, 4).flatmap(
            lambda local: st.lists(st.integers(0, 3), min_size=ep * local, max_size=ep * local).map(
                lambda flat: torch.tensor(flat, dtype=torch.int64).reshape(ep, local)
            )
        )
    )
)
def test_local_order_groups_received_rows_by_local_expert(recv: torch.Tensor) -> None:
    ep, n_local = recv.shape
    # Received rows arrive in (source, expert) blocks; label each with (expert, source, i).
    labels = [(j, s, i) for s in range(ep) for j in range(n_local) for i in range(int(recv[s, j]))]
    perm = local_order(recv)
    assert [labels[p] for p in perm.tolist()] == sorted(labels)
    inv = inverse_permutation(perm)
    rows = torch.arange(len(labels))
    assert torch.equal(rows[perm][inv], rows)


def test_sort_routed_refuses_ids_out_of_range() -> None:
    with pytest.raises(ExpertParallelError, match=r"expert -1, outside \[0, 4\]"):
        sort_routed(torch.tensor([[0, -1]]), 4)
    with pytest.raises(ExpertParallelError, match=r"expert 5, outside"):
        sort_routed(torch.tensor([[5, 1]]), 4)


def test_conventions_from_the_forward_signature() -> None:
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from examples.models import moe

    cfg = Qwen3MoeConfig(hidden_size=8, moe_intermediate_size=4, num_experts=4)
    assert convention_of(Qwen3MoeExperts(cfg)) == "transformers"
    mixtral = MixtralConfig(hidden_size=8, intermediate_size=4, num_local_experts=4)
    assert convention_of(MixtralExperts(mixtral)) == "transformers"
    assert convention_of(moe.Experts(moe.MoEConfig())) == "transformers"
    assert convention_of(expert_parallel_scenarios.GroupedExperts(4, 4, 4)) == "grouped"
    with pytest.raises(ExpertParallelError, match=r"Linear.forward\('input',\) is not .*"):
        convention_of(nn.Linear(2, 2))


@pytest.mark.dist
def test_expert_parallel_on_4_ranks() -> None:
    results = run_ranks(expert_parallel_scenarios.run_all, 4, timeout=240)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:30])
    for rank, (_, counts) in enumerate(results):
        for tag, n in MIN_CHECKS.items():
            assert counts.get(tag, 0) >= n, f"rank {rank}: {tag} made {counts.get(tag)}"
