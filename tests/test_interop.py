"""Per-HF-name layout declarations (shardspec/runtime/interop.py): get_sharding's output for
fused (vLLM's QKVParallelLinear), GQA, RoPE-permuted, padded, transposed, stacked-expert
and fused-HF cases against hand-written expectations, and local_view's reads and writes in
HF index order. The multi-rank proof (a stand-in engine that consumes only these calls)
is tests/test_transfer_runtime.py::test_standin_engine_from_get_sharding_and_local_view."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import generated.llama as llama
import generated.phi3 as phi3
from shardspec.runtime import HFMap, MapRule, Param, RuleSpec, Transform
from shardspec.runtime.interop import InteropError, get_sharding, hf_names, local_view
from shardspec.runtime.spec import CompiledSpec, SpecError

PAD = Transform("pad", dim=0, multiple=64, size=1000)


def _engine() -> tuple[CompiledSpec, HFMap]:
    """A vLLM-style tp engine: QKVParallelLinear ([q_r; k_r; v_r] per rank, 4 query heads
    and 2 KV heads of 4, q and k RoPE-permuted), a padded VocabParallelEmbedding (1000
    rows padded to 1024), a RowParallelLinear stored transposed, stacked experts over tp
    as ep, a replicated norm."""
    rules = (
        RuleSpec(
            "qkv_proj.weight",
            ("qkv", "hidden"),
            (("qkv", ("tp",)),),
            (("qkv", (("q", 8), ("k", 4), ("v", 4)), 2),),  # one group per tp rank
        ),
        RuleSpec("embed.weight", ("vocab", "hidden"), (("vocab", ("tp",)),)),
        RuleSpec("o_proj.weight", ("heads", "hidden"), (("heads", ("tp",)),)),
        RuleSpec("experts.w1", ("e", "ffn", "hidden"), (("e", ("tp",)),)),
        RuleSpec("norm.weight", ("hidden",)),
    )
    params = {
        "qkv_proj.weight": Param(0, (32, 8), "bfloat16"),
        "embed.weight": Param(1, (1024, 8), "bfloat16"),
        "o_proj.weight": Param(2, (16, 8), "bfloat16"),
        "experts.w1": Param(3, (4, 6, 8), "bfloat16"),
        "norm.weight": Param(4, (8,), "float32"),
    }
    spec = CompiledSpec(
        name="engine", axes=("tp",), sizes={"tp": 2}, world=2, rules=rules, params=params
    )
    rope = (Transform("rope", 4),)
    hf = HFMap(
        rules=(
            MapRule("q.weight", "qkv_proj.weight.q", None, rope, 1, dtypes=("F32",)),
            MapRule("k.weight", "qkv_proj.weight.k", None, rope, 2, dtypes=("F32",)),
            MapRule("v.weight", "qkv_proj.weight.v", None, (), 3, dtypes=("F32",)),
            MapRule("embed_tokens.weight", "embed.weight", None, (PAD,), 4, dtypes=("F32",)),
            MapRule("o.weight", "o_proj.weight", None, (Transform("transpose"),), 5),
            MapRule("experts.{x}.gate.weight", "experts.w1", "x", (), 6, dtypes=("BF16",)),
            MapRule("norm.weight", "norm.weight", None, (), 7, dtypes=("F32",)),
        ),
        drops=("rotary.inv_freq",),
        ties=(("lm_head.weight", "embed_tokens.weight"),),
    )
    return spec, hf


def _boxes(d: dict) -> list[list[list[list[int]]]]:
    return [r["box"] for r in d["ranks"]]


def test_fused_gqa_rope_component() -> None:
    spec, hf = _engine()
    q = get_sharding(spec, hf, "q.weight", start_rank=4)
    json.dumps(q)  # plain data
    assert q["mesh"] == {"dim_names": ["tp"], "shape": [2], "start_rank": 4}
    assert (q["shape"], q["hf_dtype"], q["dtype"]) == ([16, 8], "float32", "bfloat16")
    assert q["placements"] == ["Shard(0)"]
    assert q["param"] == "qkv_proj.weight" and q["transforms"] == ["rope 4"]
    assert q["dims"][0] == {
        "size": 16,
        "param_dim": 0,
        "param_size": 32,
        "shard": ["tp"],
        "fused": {"component": "q", "components": [["q", 16], ["k", 8], ["v", 8]], "groups": 2},
        "split": None,
        "permuted": True,
        "padded_to": None,
    }
    assert not q["dims"][1]["permuted"] and q["dims"][1]["fused"] is None
    assert _boxes(q) == [[[[0, 8]], [[0, 8]]], [[[8, 16]], [[0, 8]]]]
    k = get_sharding(spec, hf, "k.weight")  # one KV head per rank
    assert _boxes(k) == [[[[0, 4]], [[0, 8]]], [[[4, 8]], [[0, 8]]]]
    assert k["placements"] == ["Shard(0)"] and k["dims"][0]["fused"]["component"] == "k"
    assert [r["count"] for r in k["ranks"]] == [32, 32]


def test_padded_vocabulary() -> None:
    """1000 HF rows padded to 1024 over tp 2: 512 real rows, then 488 and the padding;
    torch's Shard(0) of the HF tensor would cut 500/500, so no placements."""
    spec, hf = _engine()
    e = get_sharding(spec, hf, "embed_tokens.weight")
    assert e["shape"] == [1000, 8] and e["placements"] is None
    assert e["dims"][0]["padded_to"] == 1024 and e["dims"][0]["param_size"] == 1024
    assert _boxes(e) == [[[[0, 512]], [[0, 8]]], [[[512, 1000]], [[0, 8]]]]
    tied = get_sharding(spec, hf, "lm_head.weight")
    assert tied["tied_to"] == "embed_tokens.weight" and _boxes(tied) == _boxes(e)


def test_transposed_row_parallel() -> None:
    """HF o [8, 16] stored as the model's [16, 8] sharded on its dim 0: HF dim 1 over tp."""
    spec, hf = _engine()
    o = get_sharding(spec, hf, "o.weight")
    assert o["shape"] == [8, 16] and o["placements"] == ["Shard(1)"]
    assert [d["param_dim"] for d in o["dims"]] == [1, 0]
    assert o["dims"][1]["shard"] == ["tp"] and o["hf_dtype"] is None
    assert _boxes(o) == [[[[0, 8]], [[0, 8]]], [[[0, 8]], [[8, 16]]]]


def test_stacked_expert_and_replicated_norm() -> None:
    spec, hf = _engine()
    x = get_sharding(spec, hf, "experts.3.gate.weight")
    assert x["param"] == "experts.w1" and x["stack_index"] == 3 and x["placements"] is None
    assert _boxes(x) == [[[], []], [[[0, 6]], [[0, 8]]]]
    assert [d["param_dim"] for d in x["dims"]] == [1, 2]
    n = get_sharding(spec, hf, "norm.weight")
    assert n["placements"] == ["Replicate()"] and _boxes(n) == [[[[0, 8]]], [[[0, 8]]]]


def test_fused_hf_tensor_split_over_components() -> None:
    """phi3's HF gate_up_proj holds gate then up; the model's fused w13 is split over tp:
    rank r holds gate_r and up_r, two runs of the HF rows."""
    g = get_sharding(phi3.SPEC, phi3.HF, "model.layers.0.mlp.gate_up_proj.weight", {"tp": 2})
    assert g["dims"][0]["split"] == {"components": ["gate", "up"], "groups": 1}
    assert g["placements"] is None
    assert [r["box"][0] for r in g["ranks"]][:2] == [[[0, 48], [96, 144]], [[48, 96], [144, 192]]]


def test_llama_fsdp_inside_a_component() -> None:
    """llama's wqkv at dp_shard 2 x tp 2: FSDP splits each tp rank's [q; k; v] rows, so q
    lies on the dp_shard-0 ranks only: no placements describe it, the boxes do."""
    key = "model.layers.1.self_attn.q_proj.weight"
    q = get_sharding(llama.SPEC, llama.HF, key, {"dp_shard": 2, "tp": 2})
    assert q["mesh"]["shape"] == [2, 2] and q["placements"] is None
    assert [r["box"][0] for r in q["ranks"]] == [[[0, 32]], [[32, 64]], [], []]
    assert get_sharding(llama.SPEC, llama.HF, key, {"tp": 2})["mesh"]["shape"] == [4, 2]
    at_tp = get_sharding(
        llama.SPEC,
        llama.HF,
        "model.layers.1.self_attn.q_proj.weight",
        {
            "dp_shard": 1,
            "tp": 2,
        },
    )
    assert at_tp["placements"] == ["Replicate()", "Shard(0)"]


def test_unknown_and_dropped_names() -> None:
    spec, hf = _engine()
    with pytest.raises(InteropError, match="is dropped by"):
        get_sharding(spec, hf, "rotary.inv_freq")
    with pytest.raises(InteropError, match="is no tensor of"):
        get_sharding(spec, hf, "nope.weight")
    assert hf_names(spec, hf)[:3] == [
        "embed_tokens.weight",
        "experts.0.gate.weight",
        "experts.1.gate.weight",
    ]


def _ids(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_local_view_reads_in_hf_order_through_rope() -> None:
    """Rank 1 of the engine: local qkv rows [q_1 (8); k_1 (4); v_1 (4)]. RoPE 4: HF rows
    [0, 1, 2, 3] of a head are the model's interleaved rows [0, 2, 1, 3]."""
    spec, hf = _engine()
    local = _ids((16, 8))
    state = {"qkv_proj.weight": local}
    q = local_view(spec, hf, state, "q.weight", {"tp": 2}, rank=1)
    assert q.box == [[[8, 16]], [[0, 8]]] and q.tensor is None  # permuted: no view
    assert torch.equal(q.read(), local[[0, 2, 1, 3, 4, 6, 5, 7]])
    k = local_view(spec, hf, state, "k.weight", {"tp": 2}, rank=1)
    assert torch.equal(k.read(), local[[8, 10, 9, 11]])
    v = local_view(spec, hf, state, "v.weight", {"tp": 2}, rank=1)
    assert v.tensor is not None and v.tensor.data_ptr() == local[12].data_ptr()
    assert torch.equal(v.tensor, local[12:16])
    sub = [[[13, 14]], [[2, 4]]]  # HF row 13: head 3's row 1 -> its interleaved row 2
    assert torch.equal(q.read(sub), local[6:7, 2:4])
    q.write(torch.full((1, 2), -1.0), sub)
    assert (local[6, 2:4] == -1).all() and (local[6, :2] >= 0).all()
    with pytest.raises(InteropError, match="not held on this rank"):
        q.read([[[0, 1]], [[0, 8]]])


def test_local_view_transpose_pad_and_stack() -> None:
    spec, hf = _engine()
    o_local, e_local, x_local = _ids((8, 8)), _ids((512, 8)), _ids((2, 6, 8))
    state = {"o_proj.weight": o_local, "embed.weight": e_local, "experts.w1": x_local}
    o = local_view(spec, hf, state, "o.weight", {"tp": 2}, rank=1)
    assert o.tensor is not None and torch.equal(o.tensor, o_local.t())
    e = local_view(spec, hf, state, "embed_tokens.weight", {"tp": 2}, rank=1)
    assert e.shape == (488, 8) and torch.equal(e.tensor, e_local[:488])  # padding left out
    x = local_view(spec, hf, state, "experts.3.gate.weight", {"tp": 2}, rank=1)
    assert x.fixed == ((0, 1),) and torch.equal(x.tensor, x_local[1])
    none = local_view(spec, hf, state, "experts.3.gate.weight", {"tp": 2}, rank=0)
    assert none.box == [[], []] and none.tensor is None
    with pytest.raises(InteropError, match="which rank"):
        local_view(spec, hf, state, "o.weight", {"tp": 2})
    with pytest.raises(InteropError, match=r"has no 'norm\.weight'"):
        local_view(spec, hf, state, "norm.weight", {"tp": 2}, rank=0)


@pytest.mark.parametrize("which", ["llama", "moe"])
def test_local_view_reads_what_the_owner_holds(which: str, tmp_path: Path) -> None:
    """One rank: every HF name's local view, read from the example model's state (built
    from transformers' own checkpoint by the model's own converter, examples/models/hf.py),
    equals the checkpoint's tensor bitwise: RoPE rows, fused q/k/v and gate/up, stacked
    experts, read back in HF order."""
    import transformers

    import generated.deepseek_moe as deepseek_moe
    from examples.models import hf as hfm
    from examples.models import llama as llama_model
    from examples.models import moe
    from tests.hf_scenarios import hf_state

    torch.manual_seed(0)
    if which == "llama":
        layout, sizes = llama, {"dp_shard": 1, "tp": 1}
        owner = transformers.LlamaForCausalLM(hfm.llama_config(tied=False))
        owner.save_pretrained(tmp_path)
        hf = hf_state(str(tmp_path))
        state = hfm.llama_from_hf(hf, llama_model.LlamaConfig())
    else:
        layout, sizes = deepseek_moe, {"dp_shard": 1, "ep": 1}
        owner = transformers.Qwen3MoeForCausalLM(hfm.qwen3_moe_config(tied=False))
        owner.save_pretrained(tmp_path)  # (per-expert keys, as checkpoints hold them)
        hf = hf_state(str(tmp_path))
        state = hfm.moe_from_hf(hf, moe.MoEConfig())
    names = [n for n in hf_names(layout.SPEC, layout.HF, sizes) if n in hf]
    assert len(names) == len(hf) - (1 if "model.rotary_emb.inv_freq" in hf else 0)
    for name in names:
        view = local_view(layout.SPEC, layout.HF, state, name, sizes)
        got = view.read()
        assert got.shape == hf[name].shape and torch.equal(got, hf[name]), name
        assert view.box == [[[0, n]] for n in hf[name].shape], name
        if view.tensor is not None:
            assert torch.equal(view.tensor, hf[name]), name


def test_pipeline_stages_and_views() -> None:
    """The pipelined MoE with two views at 8 ranks: layer 1 is stage 1's (ranks 4-7).
    Its q rows: tp splits them, FSDP then splits each tp half (FSDP over TP: torch's
    _StridedShard on fsdp); an expert lies in the expert view, on one ep half of stage 1."""
    import generated.deepseek_moe_pp_folded as pp

    q = get_sharding(pp.SPEC, pp.HF, "model.layers.1.self_attn.q_proj.weight")
    assert q["mesh"]["dim_names"] == ["pp", "fsdp", "tp"] and q["mesh"]["shape"] == [2, 2, 2]
    assert q["placement_dims"] == ["fsdp", "tp"]
    assert q["placements"] == ["_StridedShard(0, sf=2)", "Shard(0)"]
    assert [r["box"][0] for r in q["ranks"]] == [
        [],
        [],
        [],
        [],
        [[0, 16]],
        [[32, 48]],
        [[16, 32]],
        [[48, 64]],
    ]
    x = get_sharding(pp.SPEC, pp.HF, "model.layers.0.mlp.experts.5.down_proj.weight")
    assert x["mesh"]["dim_names"] == ["pp", "ep", "efsdp"] and x["stack_index"] == 5
    assert [r["rank"] for r in x["ranks"] if r["count"]] == [2]  # ep 1, efsdp 1 of stage 0
    sizes = {"pp": 2, "tp": 2, "ep": 2}
    local = _ids((16, 64))  # rank 5: stage 1, fsdp 0, tp 1
    view = local_view(pp.SPEC, pp.HF, {q["param"]: local}, q["hf_name"], sizes, rank=5)
    assert view.box == [[[32, 48]], [[0, 64]]] and torch.equal(view.read(), local)
    other = local_view(pp.SPEC, pp.HF, {}, q["hf_name"], sizes, rank=1)  # stage 0's model
    assert other.box == [[], []] and other.tensor is None


@pytest.mark.parametrize("engine_world, engine_tp", [(1, 1), (2, 2), (4, 2)])
def test_boxes_give_each_engine_rank_what_the_planner_says_it_owns(
    engine_world: int, engine_tp: int
) -> None:
    """The stand-in's moves from get_sharding alone (llama dp_shard 2 x tp 2 -> one rank,
    tp 2, dp_shard 2 x tp 2)
    give every engine rank as many elements as the planner (``shardspec transfer``) says it
    owns, and every element of a box exactly once (the trainer's boxes tile each HF tensor
    once per replica)."""
    from shardspec.transfer import plan_json, plan_transfer
    from tests.transfer_scenarios import standin_moves

    spec = "specs/llama.shard"
    plan = plan_json(plan_transfer(spec, spec, {"tp": 2}, {"tp": engine_tp}, 4, engine_world))
    names = hf_names(llama.SPEC, llama.HF, {"dp_shard": 2, "tp": 2})
    sender = {n: get_sharding(llama.SPEC, llama.HF, n, {"dp_shard": 2, "tp": 2}) for n in names}
    engine = {"dp_shard": engine_world // engine_tp, "tp": engine_tp}
    receiver = {n: get_sharding(llama.SPEC, llama.HF, n, engine, start_rank=4) for n in names}
    got = [0] * engine_world
    for _, _, e, box in standin_moves(names, sender, receiver):
        n = 1
        for runs_ in box:
            n *= sum(b - a for a, b in runs_)
        got[e] += n * 4
    assert got == plan["totals"]["owned"]
    assert [
        sum(receiver[n]["ranks"][r]["count"] * 4 for n in names) for r in range(engine_world)
    ] == got


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    name=st.one_of(
        st.text(max_size=40),
        st.sampled_from(["model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]).map(
            lambda s: s.replace("0", "7")
        ),
        st.sampled_from(["model.layers.1.mlp.up_proj.weight", "model.rotary_emb.inv_freq"]),
    ),
    sizes=st.dictionaries(
        st.sampled_from(["dp_shard", "tp", "pp", ""]), st.integers(-2, 9), max_size=2
    ),
)
def test_fuzz_get_sharding_names_and_meshes(name: str, sizes: dict[str, int]) -> None:
    """Any name and any mesh sizes: a declaration or a SpecError (InteropError), never
    another exception."""
    try:
        d = get_sharding(llama.SPEC, llama.HF, name, sizes)
    except SpecError:
        return
    json.dumps(d)
    total = sum(r["count"] for r in d["ranks"])
    assert total >= 1


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    box=st.one_of(
        st.none(),
        st.integers(),
        st.lists(
            st.lists(
                st.one_of(st.lists(st.integers(-3, 20), max_size=3), st.text(max_size=2)),
                max_size=2,
            ),
            max_size=3,
        ),
    )
)
def test_fuzz_local_view_boxes(box: object) -> None:
    """Any box: the elements read (and written back), or an InteropError."""
    spec, hf = _engine()
    local = _ids((16, 8))
    view = local_view(spec, hf, {"qkv_proj.weight": local}, "q.weight", {"tp": 2}, rank=1)
    try:
        got = view.read(box)  # type: ignore[arg-type]
    except InteropError:
        return
    view.write(got, box)  # type: ignore[arg-type]
    assert torch.equal(local, _ids((16, 8)))
