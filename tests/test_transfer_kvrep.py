"""KV heads replicated past the KV-head count (vLLM's ``QKVParallelLinear`` at tp > KV
heads: ``heads k 16 replicated``), in the layout arithmetic, the transfer plan and lint.

The plan is executed on element-id tensors (tests/test_transfer_plan.py's ``execute``
machinery: the trainer's side and the moves); what each engine rank must hold is cut from the HF id
tensors by tests/vllm_slices.py, written from vLLM's weight_loader arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.core.layout import (
    Fusion,
    LayoutError,
    Mesh,
    RuleSpec,
    build_layout,
    head_cut,
    local_indices,
    module_shape,
)
from shardspec.transfer import plan_json, plan_transfer
from tests import vllm_slices
from tests.test_transfer_plan import _ids, _locals, apply_moves

REPO = Path(__file__).resolve().parents[1]
QWEN2 = str(REPO / "specs" / "qwen2.shard")


def _engine(tp: int) -> str:
    return str(REPO / "specs" / f"qwen2_vllm_tp{tp}.shard")


# ------------------------------------------------------------------------- the layout


def _qkv_rule(heads: int, kv: int, head_dim: int) -> RuleSpec:
    return RuleSpec(
        pattern="qkv",
        dims=("qkv", "hidden"),
        shard=(("qkv", ("tp",)),),
        fuse=(("qkv", (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)), 1),),
        local=("tp",),
        replicated_heads=(("qkv", "k", head_dim), ("qkv", "v", head_dim)),
    )


@settings(max_examples=200, deadline=None)
@given(
    kv=st.sampled_from([1, 2, 4, 8]),
    per=st.integers(1, 4),
    tp_exp=st.integers(0, 4),
    head_dim=st.sampled_from([1, 2, 4]),
)
def test_each_rank_holds_what_vllm_gives_it(kv: int, per: int, tp_exp: int, head_dim: int) -> None:
    """Every rank's rows of the fused dimension are, in order, vLLM's [q_r; k_r; v_r]
    (tests/vllm_slices.py on an id vector), and the module's shape is their count."""
    tp = 2**tp_exp
    heads = kv * per * tp  # tp divides the query heads, as vLLM requires
    if not (kv % tp == 0 or tp % kv == 0):
        return
    rule = _qkv_rule(heads, kv, head_dim)
    q, k, v = heads * head_dim, kv * head_dim, kv * head_dim
    rows = (heads // tp + 2 * max(1, kv // tp)) * head_dim
    layout = build_layout(rule, (rows, 3), {"tp": tp})
    mesh = Mesh(("tp",), (tp,))
    assert layout.shape == (q + k + v, 3)
    assert module_shape(layout, mesh) == (rows, 3)
    ids = torch.arange(q + k + v)
    for r in range(tp):
        held = local_indices(layout, mesh, (r,))[0]
        got = torch.tensor([i for a, b in held for i in range(a, b)])
        want = vllm_slices.qkv_rank(
            ids[:q],
            ids[q : q + k],
            ids[q + k :],
            tp=tp,
            rank=r,
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
        )
        assert torch.equal(got, want), (r, got, want)
    # whole heads everywhere: no cut (SS034 stays quiet)
    assert head_cut(layout.dims[0], ("tp",), {"tp": tp}, {None: head_dim}) is None


def test_without_replicated_the_heads_would_be_cut() -> None:
    """The same tp 4 over 2 KV heads without `replicated`: torch.chunk cuts each head."""
    rule = _qkv_rule(4, 2, 16)
    plain = RuleSpec(
        pattern=rule.pattern, dims=rule.dims, shard=rule.shard, fuse=rule.fuse, local=()
    )
    layout = build_layout(plain, (128, 8), {"tp": 4})
    assert head_cut(layout.dims[0], ("tp",), {"tp": 4}, {None: 16}) is not None


def test_module_of_another_tp_is_refused() -> None:
    with pytest.raises(LayoutError, match="each of the 4 ranks of tp holds 48"):
        build_layout(_qkv_rule(4, 2, 16), (64, 8), {"tp": 4})
    with pytest.raises(LayoutError, match="need one shard axis"):
        build_layout(
            RuleSpec(
                pattern="qkv",
                dims=("qkv", "hidden"),
                shard=(("qkv", ("tp", "dp")),),
                fuse=(("qkv", (("q", 64), ("k", 32), ("v", 32)), 1),),
                local=("tp", "dp"),
                replicated_heads=(("qkv", "k", 16),),
            ),
            (24, 8),
            {"tp": 2, "dp": 2},
        )
    assert Fusion((("k", 32),), 1, (("k", 16),)).replicated == (("k", 16),)


# --------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_qwen2_to_vllm_engine_every_element_once(tp: int) -> None:
    """specs/qwen2.shard (dp_shard 2 x tp 2) to the vLLM-style engine at tp 1, 2 and 4 (KV
    heads replicated at 4): executed on id tensors, every engine rank holds exactly
    vLLM's slice of every HF tensor, each element written once; each rank receives its
    own bytes (replicated KV heads on every rank that holds them), no more."""
    plan = plan_transfer(QWEN2, _engine(tp))
    assert plan.status == 0, plan.diagnostics
    assert plan.trainer is not None and plan.engine is not None
    doc = json.loads(json.dumps(plan_json(plan)))
    ids = _ids(plan.trainer)
    cfg = {"heads": 4, "kv_heads": 2, "head_dim": 16}
    want = {r: vllm_slices.engine_rank(ids, tp=tp, rank=r, **cfg) for r in range(tp)}
    got, times, received = apply_moves(doc, _locals(plan.trainer, ids), want)
    owned = [0] * tp
    for r in range(tp):
        assert set(got[r]) == set(want[r])
        for name, t in want[r].items():
            real = t >= 0
            assert torch.equal(times[r][name], real.long()), (r, name)
            assert torch.equal(got[r][name], t), (r, name)
            owned[r] += int(real.sum()) * 4
    assert received == plan.received == plan.owned == owned
    assert plan.wire_bytes == sum(owned)
    if tp == 4:  # ranks 0 and 1 hold KV head 0, ranks 2 and 3 KV head 1: each its copy
        k = "model.layers.0.self_attn.qkv_proj.weight"
        assert torch.equal(got[0][k][16:], got[1][k][16:])
        assert torch.equal(got[2][k][16:], got[3][k][16:])
        assert not torch.equal(got[0][k][16:], got[2][k][16:])


def test_engine_at_a_tp_that_does_not_fit_is_refused() -> None:
    """The tp 4 engine spec checked at tp 3 (neither a divisor nor a multiple of the 2 KV
    heads, nor the tp its modules were built with): findings at the engine's lines, no
    plan."""
    plan = plan_transfer(QWEN2, _engine(4), None, {"tp": 3}, None, 3)
    assert plan.status == 1 and plan.tensors == []
    codes = {d.code for d in plan.diagnostics if d.is_error}
    assert {"SS013", "SS051"} <= codes, codes
    assert all(d.span.file.endswith("qwen2_vllm_tp4.shard") for d in plan.diagnostics)
