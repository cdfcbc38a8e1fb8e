"""Persistent buffers as storage units, in one process: what explain shows of a buffer, the
layout the runtime gives one (whole on every rank, a rule's local shard, never a shard at
run time), and the canonical units a state dict's buffers become on every rank; with
pipeline stages, the stage each buffer lives on, its units under global names, what
``split_stage`` keeps, and a stage model holding another stage's buffer refused.

The multi-rank proof on transformers' own DeepSeek-V3 (load_hf, export_hf, logits, DCP) is
``tests/test_hf_buffers.py`` (and, per pipeline stage, ``tests/test_pipeline_buffers.py``);
the lint side is ``tests/checks/SS086.py`` (dropped model state), ``SS087.py`` (sharded
buffers), ``SS041.py`` (a rule for a buffer) and ``SS092.py`` (a buffer on two stages).
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest
import torch

from shardspec import cli
from shardspec.core.layout import Mesh, RuleSpec
from shardspec.core.stages import PipelineSpec
from shardspec.runtime import Buffer, CompiledSpec, Param
from shardspec.runtime.spec import SpecError
from shardspec.runtime.units import canonical_plan, clear_plan_cache

REPO = Path(__file__).resolve().parents[1]
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _explain(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["explain", *args])
    return rc, out.getvalue() + err.getvalue()


def test_explain_shows_a_buffers_placement_by_its_rule() -> None:
    rc, text = _explain(str(REPO / "specs" / "deepseek_v3.shard"), BIAS)
    assert rc == 0, text
    assert f"{BIAS}  [4] float32  (persistent buffer)" in text
    assert "wins  " in text and "param model.layers.*.mlp.gate.e_score_correction_bias" in text
    assert "a plain tensor, not a DTensor: every rank holds the whole tensor" in text
    assert "     3  (1,1)     [4]            [0]             0:4" in text
    assert f"{BIAS} [4] <- {BIAS} [4]" in text  # where the hf block reads it


def test_explain_shows_a_buffer_no_rule_matches(tmp_path: Path) -> None:
    text = (REPO / "specs" / "deepseek_v3.shard").read_text(encoding="utf-8")
    rule = "param model.layers.*.mlp.gate.e_score_correction_bias [experts] replicate\n"
    assert rule in text
    (tmp_path / "v3.shard").write_text(text.replace(rule, ""), encoding="utf-8")
    for name in ("deepseek_v3.manifest.json", "deepseek_v3.hf.json"):
        (tmp_path / name).write_bytes((REPO / "specs" / name).read_bytes())
    rc, out = _explain(str(tmp_path / "v3.shard"), BIAS)
    assert rc == 0, out
    assert "matched by no rule: whole on every rank, as buffers are by default" in out
    assert "SS040" not in out
    assert "global dims: dim0=4" in out
    assert "     0  (0,0)     [4]            [0]             0:4" in out
    assert f"{BIAS} [4] <- {BIAS} [4]" in out


RULES = (
    RuleSpec(pattern="w", dims=("a", "b"), shard=(("a", ("dp",)),)),
    # a Megatron-style per-EP-rank buffer: the module holds its experts' entries
    RuleSpec(pattern="router.bias", dims=("e",), shard=(("e", ("ep",)),), local=("ep",)),
    # the fsdp default on a buffer (lint refuses it: SS087)
    RuleSpec(pattern="bad.cache", dims=("a",), shard=(("a", ("dp",)),)),
)


def _spec(*, manifest: bool = True, pipeline: PipelineSpec | None = None) -> CompiledSpec:
    params = {"w": Param(0, (4, 6), "float32")}
    if pipeline is not None:
        params["v"] = Param(0, (4, 6), "float32")  # (a parameter on the second stage)
    return CompiledSpec(
        name="buffers",
        axes=("dp", "ep"),
        sizes={"dp": None, "ep": 2},
        world=4,
        rules=RULES,
        params=params if manifest else None,
        buffers=("rope.cache", "router.bias", "bad.cache") if manifest else (),
        fsdp="dp",
        pipeline=pipeline,
    )


MESH = Mesh(("dp", "ep"), (2, 2))


def test_a_buffer_no_rule_matches_is_whole_on_every_rank() -> None:
    layout = _spec().layout("rope.cache", MESH, (16, 8))
    assert [d.size for d in layout.dims] == [16, 8]
    assert all(not d.axes for d in layout.dims)


def test_a_rule_may_hold_a_buffer_as_a_local_shard() -> None:
    layout = _spec().layout("router.bias", MESH, (3,))  # 3 experts per EP rank
    assert [d.size for d in layout.dims] == [6] and layout.local == frozenset({"ep"})


def test_a_rule_that_shards_a_buffer_at_run_time_is_refused() -> None:
    with pytest.raises(SpecError, match="shards it over dp") as e:
        _spec().layout("bad.cache", MESH, (4,))
    assert e.value.code == "SS087"


def test_a_buffer_needs_its_tensors_shape() -> None:
    with pytest.raises(SpecError, match="pass the tensor's shape"):
        _spec().layout("rope.cache", MESH)


def _flat() -> dict[str, torch.Tensor]:
    return {
        "w": torch.zeros(2, 6),  # (dp=S(0)): rows of this rank
        "rope.cache": torch.zeros(16, 8),
        "router.bias": torch.zeros(3),
        "step": torch.zeros(()),
    }


def test_buffers_become_storage_units_on_every_rank() -> None:
    """A whole buffer is one unit that every rank holds (one writes it); a local buffer is
    its EP rank's rows of the global tensor; a tensor of no model entry stays DCP's."""
    clear_plan_cache()
    spec = _spec()
    flat = _flat()
    del flat["w"]  # (a buffer-only state dict: the parameter's layout is not the point)
    seen = {}
    for rank in range(MESH.world):
        plan, rest, local = canonical_plan(spec, MESH, rank, flat)
        assert set(rest) == {"step"}
        units = {u.key: u for u in plan.units}
        assert set(units) == {"rope.cache", "router.bias"}
        assert units["rope.cache"].shape == (16, 8)
        assert units["rope.cache"].replicas == (0, 1, 2, 3)
        bias = units["router.bias"]
        assert bias.shape == (6,) and bias.sizes == (3,)
        seen[rank] = bias.offsets
        assert local["router.bias"][1] is flat["router.bias"]  # the live buffer, in place
        writer = plan.writer_of("rope.cache", (0, 0), units["rope.cache"].replicas)
        assert writer in range(4)
    assert seen == {0: (0,), 1: (3,), 2: (0,), 3: (3,)}  # the ep coordinate's rows


def test_without_a_manifest_a_buffer_is_matched_by_name() -> None:
    clear_plan_cache()
    plan, rest, _ = canonical_plan(_spec(manifest=False), MESH, 0, _flat())
    # No manifest lists buffers: the rules decide by name, as for parameters.
    assert {u.key for u in plan.units} == {"w", "router.bias"}
    assert set(rest) == {"rope.cache", "step"}


# --------------------------------------------------------------- pipeline stages
#
# A pipeline stage holds its modules' buffers: a router's bias lives with its layer, the
# head's scale on the last stage, a model-level `freqs` (no pattern covers it) on every
# stage, stored once.

PP_MESH = Mesh(("pp", "dp"), (2, 2))


def _pp_spec(*, local_names: bool = False) -> CompiledSpec:
    pipeline = PipelineSpec(
        axis="pp",
        first=("emb",),
        split="layers.{l}",
        last=("head", "rope"),
        local_names=local_names,
    )
    return CompiledSpec(
        name="pp_buffers",
        axes=("pp", "dp"),
        sizes={"pp": 2, "dp": None},
        world=4,
        rules=(RuleSpec(pattern="**", dims=(), any_rank=True),),  # replicated
        params={
            "emb.weight": Param(0, (8, 4), "float32"),
            "head.weight": Param(0, (8, 4), "float32"),
            "layers.0.w.weight": Param(0, (4, 4), "float32"),
            "layers.1.w.weight": Param(0, (4, 4), "float32"),
        },
        buffers={
            "freqs": Buffer(None, (16, 2), "float32"),
            "head.scale": Buffer(None, (), "float32"),
            "layers.0.router.bias": Buffer(None, (4,), "float32"),
            "layers.1.router.bias": Buffer(None, (4,), "float32"),
            "rope.cache": Buffer(None, (4,), "float32"),  # a module holding buffers only
        },
        pipeline=pipeline,
    )


def test_a_pipeline_places_buffers_on_their_modules_stage() -> None:
    sp = _pp_spec().stage_plan(PP_MESH)
    assert sp is not None
    assert sp.buffer_stages == {
        "freqs": (0, 1),
        "head.scale": (1,),
        "layers.0.router.bias": (0,),
        "layers.1.router.bias": (1,),
        "rope.cache": (1,),
    }
    held = ["freqs", "head.scale", "head.weight", "layers.1.router.bias", "layers.1.w.weight"]
    assert sp.stored_of(1) == [*held, "rope.cache"]
    layout = _pp_spec().layout("layers.1.router.bias", PP_MESH)  # the manifest's shape
    assert (layout.stage_axis, layout.stages, [d.size for d in layout.dims]) == ("pp", (1,), [4])


def _units(spec: CompiledSpec, rank: int, flat: dict[str, torch.Tensor]) -> dict:
    plan, rest, _ = canonical_plan(spec, PP_MESH, rank, flat)
    assert not rest, rest
    return {u.key: (u, plan) for u in plan.units}


@pytest.mark.parametrize("local_names", [False, True])
def test_pipeline_buffers_are_units_under_global_names(local_names: bool) -> None:
    """Each stage's buffers are storage units under their global names (a stage model that
    numbers its layers from 0 included); the one every stage holds is written by stage 0."""
    clear_plan_cache()
    spec = _pp_spec(local_names=local_names)
    first = {
        "emb.weight": torch.zeros(8, 4),
        "layers.0.w.weight": torch.zeros(4, 4),
        "layers.0.router.bias": torch.zeros(4),
        "freqs": torch.zeros(16, 2),
    }
    layer = "layers.0" if local_names else "layers.1"  # the last stage's model's name
    last = {
        "head.weight": torch.zeros(8, 4),
        "head.scale": torch.zeros(()),
        f"{layer}.w.weight": torch.zeros(4, 4),
        f"{layer}.router.bias": torch.zeros(4),
        "freqs": torch.zeros(16, 2),
    }
    stage0, stage1 = _units(spec, 0, first), _units(spec, 2, last)  # rank 2: pp=1, dp=0
    assert {"layers.0.router.bias", "freqs"} <= set(stage0)
    assert {"layers.1.router.bias", "head.scale", "freqs"} <= set(stage1)
    unit, plan = stage0["freqs"]
    assert unit.replicas == (0, 1, 2, 3)  # every stage holds it ...
    assert plan.writer_of("freqs", (0, 0), unit.replicas) in (0, 1)  # ... stage 0 writes it
    assert "layers.1.router.bias" in plan.foreign and "head.scale" in plan.foreign
    unit, plan = stage1["layers.1.router.bias"]
    assert unit.replicas == (2, 3) and unit.shape == (4,)
    assert "layers.0.router.bias" in plan.foreign and "freqs" not in plan.foreign


class _StubMesh:
    """What split_stage asks of a DeviceMesh: axis names, sizes, this rank's coordinate."""

    mesh_dim_names = ("pp", "dp")
    shape = (2, 2)

    def __init__(self, coord: tuple[int, int]) -> None:
        self.coord = coord

    def get_coordinate(self) -> tuple[int, int]:
        return self.coord


def _whole_model() -> torch.nn.Module:
    def holder(**tensors: torch.Tensor) -> torch.nn.Module:
        m = torch.nn.Module()
        for name, t in tensors.items():
            if name.startswith("p_"):
                m.register_parameter(name[2:], torch.nn.Parameter(t))
            else:
                m.register_buffer(name, t)
        return m

    model = torch.nn.Module()
    model.emb = holder(p_weight=torch.zeros(8, 4))
    model.layers = torch.nn.ModuleDict(
        {
            str(i): torch.nn.ModuleDict(
                {"w": holder(p_weight=torch.zeros(4, 4)), "router": holder(bias=torch.zeros(4))}
            )
            for i in range(2)
        }
    )
    model.head = holder(p_weight=torch.zeros(8, 4), scale=torch.zeros(()))
    model.rope = holder(cache=torch.zeros(4))
    model.register_buffer("freqs", torch.zeros(16, 2))
    return model


def test_split_stage_drops_other_stages_buffers_with_their_modules() -> None:
    from shardspec.runtime.pipeline import split_stage

    spec = _pp_spec()
    first = split_stage(spec, _whole_model(), _StubMesh((0, 0)))
    assert sorted(n for n, _ in first.named_buffers()) == ["freqs", "layers.0.router.bias"]
    assert first.rope is None and first.head is None  # `rope` holds buffers only
    last = split_stage(spec, _whole_model(), _StubMesh((1, 1)))
    assert sorted(n for n, _ in last.named_buffers()) == [
        "freqs",
        "head.scale",
        "layers.1.router.bias",
        "rope.cache",
    ]
    assert last.emb is None


def test_a_stage_model_holding_another_stages_buffer_is_refused() -> None:
    clear_plan_cache()
    from shardspec.runtime.units import CheckpointError

    flat = {"layers.1.w.weight": torch.zeros(4, 4), "layers.0.router.bias": torch.zeros(4)}
    with pytest.raises(CheckpointError, match="places on stage 0") as e:
        canonical_plan(_pp_spec(), PP_MESH, 2, flat)
    assert "holds the persistent buffer layers.0.router.bias" in str(e.value)
    assert "split_stage" in str(e.value)


# --------------------------------------------------------------- DCP, on gloo ranks
#
# A module with every kind of buffer: whole ones (BatchNorm's running statistics and its
# int64 scalar step counter), and a Megatron-style one that each dp rank builds with its own
# rows (`local dp`). Saved on 2 ranks, loaded on 2 and on 1 (a reshard: the one rank's
# module holds every row).

DCP_RULES = (
    RuleSpec(pattern="lin.weight", dims=("out", "in"), shard=(("out", ("dp",)),)),
    RuleSpec(pattern="bn.*", dims=(), any_rank=True),
    RuleSpec(pattern="stat", dims=("e",), shard=(("e", ("dp",)),), local=("dp",)),
)
DCP_BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked", "stat")


def _dcp_spec() -> CompiledSpec:
    return CompiledSpec(
        name="dcp_buffers",
        axes=("dp",),
        sizes={"dp": None},
        world=None,
        rules=DCP_RULES,
        params={
            "lin.weight": Param(0, (4, 4), "float32"),
            "bn.weight": Param(1, (4,), "float32"),
            "bn.bias": Param(1, (4,), "float32"),
        },
        buffers=DCP_BUFFERS,
        fsdp="dp",
    )


def _dcp_model(rows: int) -> torch.nn.Module:
    m = torch.nn.Module()
    m.lin = torch.nn.Linear(4, 4, bias=False)
    m.bn = torch.nn.BatchNorm1d(4)
    m.register_buffer("stat", torch.zeros(rows))
    return m


def _dcp_ranks(rank: int, world: int, root: str) -> dict[str, list[float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardspec.runtime import checkpoint
    from shardspec.runtime.dtensor import distribute

    spec = _dcp_spec()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    rows = 4 // world
    model = _dcp_model(rows)
    distribute(spec, model, mesh)
    path = f"{root}/ckpt"
    if world == 2:
        with torch.no_grad():
            model.bn.running_mean.copy_(torch.arange(4.0) + 1)
            model.bn.running_var.copy_(torch.arange(4.0) + 10)
            model.bn.num_batches_tracked.fill_(7)
            model.stat.copy_(torch.arange(rows) + 100.0 + rows * rank)  # global rows
        checkpoint.save(spec, model.state_dict(), path, mesh=mesh)
    fresh = _dcp_model(rows)
    distribute(spec, fresh, mesh)
    checkpoint.load(spec, fresh.state_dict(), path, mesh=mesh)
    return {k: v.tolist() for k, v in fresh.named_buffers()}


def test_dcp_keeps_buffers_and_reshards_a_local_one(tmp_path: Path) -> None:
    from shardspec.testing import run_ranks

    two = run_ranks(_dcp_ranks, 2, str(tmp_path), timeout=300)
    (one,) = run_ranks(_dcp_ranks, 1, str(tmp_path), timeout=300)
    whole = {
        "bn.running_mean": [1.0, 2.0, 3.0, 4.0],
        "bn.running_var": [10.0, 11.0, 12.0, 13.0],
        "bn.num_batches_tracked": 7,
    }
    assert two[0] == {**whole, "stat": [100.0, 101.0]}
    assert two[1] == {**whole, "stat": [102.0, 103.0]}
    assert one == {**whole, "stat": [100.0, 101.0, 102.0, 103.0]}


def test_explain_shows_a_pipeline_buffers_stage(tmp_path: Path) -> None:
    import json

    entries = [
        {"fqn": f"layers.{i}.weight", "kind": "param", "shape": [8, 8], "dtype": "float32"}
        for i in range(2)
    ]
    entries.append({"fqn": "rope.cache", "kind": "buffer", "shape": [4], "dtype": "float32"})
    entries.append({"fqn": "layers.1.bias", "kind": "buffer", "shape": [8], "dtype": "float32"})
    doc = {"format": "shardspec-manifest/2", "entries": entries}
    (tmp_path / "m.json").write_text(json.dumps(doc), encoding="utf-8")
    (tmp_path / "pp.shard").write_text(
        'manifest "m.json"\nmesh over 4 ranks { pp: 2  dp_shard: * }\nfsdp dp_shard\n'
        "param layers.*.weight [out, in] {}\npipeline pp { split layers.{layer} }\n",
        encoding="utf-8",
    )
    rc, out = _explain(str(tmp_path / "pp.shard"), "rope.cache")
    assert rc == 0, out
    assert "rope.cache  [4] float32  (persistent buffer)" in out
    assert "every rank of its pipeline stage holds the whole tensor" in out
    assert "pipeline stage: every one of the 2 on pp (no first, last or split pattern" in out
    rc, out = _explain(str(tmp_path / "pp.shard"), "layers.1.bias")
    assert rc == 0, out
    assert "pipeline stage: 1 of 2 on pp (layer 1 of split layers.{layer})" in out
    assert "ranks 0, 1 (other stages) hold none of it" in out


def test_a_buffer_named_without_its_shape_is_refused_where_a_stage_needs_it() -> None:
    """Other stages' buffers come from the manifest's table: a spec built by hand that
    names a buffer without its shape says so (load_hf/export_hf of a stage), as an HFError."""
    from shardspec.runtime.hf import HFError
    from shardspec.runtime.hf.common import manifest_entry

    spec = CompiledSpec(
        name="named",
        axes=("pp",),
        sizes={"pp": 2},
        world=2,
        rules=(RuleSpec(pattern="**", dims=(), any_rank=True),),
        params={"a.w": Param(0, (2,), "float32"), "b.w": Param(0, (2,), "float32")},
        buffers=("a.cache",),
        pipeline=PipelineSpec(axis="pp", first=("a",), last=("b",)),
    )
    assert manifest_entry(spec, "a.w") == ((2,), "float32")
    with pytest.raises(HFError, match=r"names buffer 'a\.cache' without its shape"):
        manifest_entry(spec, "a.cache")
