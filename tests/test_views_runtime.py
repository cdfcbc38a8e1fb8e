"""A compiled spec with views, in one process: sizes per view, each parameter's layout on
its view's mesh, placements, and parallelize/verify refusing meshes that are not the spec's
views before the model changes.
The multi-rank proofs (build_mesh against torch, distribute, checkpoints across folds) are
tests/test_views_dist.py."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import pytest
import torch

from shardspec.core.layout import Mesh, Shard, rank_table
from shardspec.core.views import Folded
from shardspec.runtime import SpecError
from shardspec.runtime.spec import MeshViews

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def folded():
    return importlib.import_module("generated.deepseek_moe_folded")


def test_sizes_resolve_every_view(folded) -> None:
    spec = folded.SPEC
    assert spec.views is not None and spec.views.names == ("dense", "expert")
    assert spec.sizes(world=4) == {"fsdp": 2, "tp": 2, "ep": 2, "efsdp": 2}
    assert spec.sizes(world=4, ep=4, tp=1) == {"fsdp": 4, "tp": 1, "ep": 4, "efsdp": 1}
    with pytest.raises(SpecError, match="view 'expert'"):
        spec.sizes(world=4, ep=3)
    with pytest.raises(SpecError, match="unknown mesh axis 'dp_shard'"):
        spec.sizes(world=4, dp_shard=2)


@pytest.mark.parametrize("module", ["generated.deepseek_moe_folded", "generated.llama"])
@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"tp": "2"}, "mesh axis 'tp' must be a whole number of at least 1, not '2'"),
        ({"tp": 0}, "mesh axis 'tp' must be a whole number of at least 1, not 0"),
        ({"tp": True}, "mesh axis 'tp' must be a whole number of at least 1, not True"),
        ({"world": 4.0}, "the world size must be a whole number of at least 1, not 4.0"),
    ],
)
def test_sizes_that_are_not_whole_numbers_are_refused(module, kwargs, said) -> None:
    """build_mesh(tp="2") raised a TypeError from the arithmetic, and ep=0 was reported as
    another view's world not dividing; every size given is checked first, with or
    without views."""
    with pytest.raises(SpecError) as got:
        importlib.import_module(module).SPEC.sizes(**kwargs)
    assert str(got.value) == said


def test_each_parameter_is_laid_out_on_its_view(folded) -> None:
    spec = folded.SPEC
    sizes = spec.sizes(world=4)
    lm = spec.layout_mesh(sizes)
    assert isinstance(lm, Folded)
    assert lm.view("expert") == Mesh(("ep", "efsdp"), (2, 2))
    w1 = spec.layout("layers.0.moe.experts.w1", sizes)
    assert w1.dims[0].axes == ("ep", "efsdp")
    assert spec.mesh_of("layers.0.moe.experts.w1", sizes) == Mesh(("ep", "efsdp"), (2, 2))
    assert spec.abstract_placements("layers.0.moe.experts.w1", sizes) == (Shard(0), Shard(0))
    # expert e of 8 on rank r: ep coordinate r // 2 holds experts 4p..4p+3, efsdp halves them
    table = spec.rank_table("layers.0.moe.experts.w1", sizes)
    assert [t.indices[0] for t in table] == [((0, 2),), ((2, 4),), ((4, 6),), ((6, 8),)]
    assert table == rank_table(w1, Mesh(("ep", "efsdp"), (2, 2)))
    wq = spec.layout("layers.0.attn.wq.weight", sizes)
    assert spec.mesh_of("layers.0.attn.wq.weight", sizes) == Mesh(("fsdp", "tp"), (2, 2))
    assert wq.dims[0].axes == ("tp", "fsdp")
    router = spec.layout("layers.0.moe.router.weight", sizes)
    assert router.dims[0].axes == ("fsdp",)


def test_meshes_by_view_are_checked(folded) -> None:
    spec = folded.SPEC
    good = {"dense": Mesh(("fsdp", "tp"), (2, 2)), "expert": Mesh(("ep", "efsdp"), (2, 2))}
    assert spec.layout_mesh(good).view("dense") == good["dense"]
    with pytest.raises(SpecError, match="pass build_mesh\\(\\)'s views"):
        spec.layout_mesh(Mesh(("fsdp", "tp"), (2, 2)))
    with pytest.raises(SpecError, match="views expert, dense"):
        spec.layout_mesh({"expert": good["expert"], "dense": good["dense"]})
    with pytest.raises(SpecError, match="view 'expert''s mesh has axes"):
        spec.layout_mesh({**good, "expert": Mesh(("efsdp", "ep"), (2, 2))})
    with pytest.raises(SpecError, match="every view factors one world"):
        spec.layout_mesh({**good, "expert": Mesh(("ep", "efsdp"), (4, 2))})


def test_one_mesh_specs_are_unchanged(folded) -> None:
    single = importlib.import_module("generated.deepseek_moe").SPEC
    assert single.views is None
    assert single.layout_mesh({"dp_shard": 2, "ep": 2}) == Mesh(("dp_shard", "ep"), (2, 2))
    assert not isinstance(single.layout_mesh({"dp_shard": 2, "ep": 2}), Folded)


@pytest.mark.parametrize("call", ["parallelize", "verify", "tp_plan", "fsdp_ignored"])
def test_parallelize_and_verify_refuse_bad_views_before_changing_anything(folded, call) -> None:
    """Views are taken (tests/test_ep_train.py trains on them); meshes that are not views of
    the spec are refused with a hint, the model unchanged."""
    from examples.models import moe

    torch.manual_seed(0)
    model = moe.tiny()
    before = {k: v.clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    for mesh, want in (
        (MeshViews({"dense": object(), "expert": object()}), "has no mesh_dim_names"),
        (Mesh(("fsdp", "tp"), (2, 2)), "pass build_mesh\\(\\)'s views"),
    ):
        args = (mesh,) if call == "tp_plan" else (model, mesh)
        with pytest.raises(SpecError, match=want) as err:
            getattr(folded, call)(*args)
        assert "build_mesh()" in str(err.value) + err.value.hint
    after = model.state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


@pytest.mark.parametrize("call", ["parallelize", "verify", "tp_plan"])
def test_views_of_sizes_only_are_refused_with_a_hint(folded, call) -> None:
    """Views given as Mesh objects (arithmetic only) are read, then refused where torch's
    DeviceMeshes are needed; tp_plan of views needs the model (the dense view's modules)."""
    from examples.models import moe

    model = moe.tiny()
    views = {"dense": Mesh(("fsdp", "tp"), (2, 2)), "expert": Mesh(("ep", "efsdp"), (2, 2))}
    args = (views,) if call == "tp_plan" else (model, views)
    want = "pass model= to tp_plan" if call == "tp_plan" else "need torch DeviceMeshes"
    with pytest.raises(SpecError, match=want):
        getattr(folded, call)(*args)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())


def test_checkpoint_tables_read_a_folded_mesh_on_each_layouts_view(folded) -> None:
    """rank_pieces and replica_groups of a Folded mesh are those of the layout's view (what
    export_hf's chunk table reads), for every parameter of the example MoE."""
    from shardspec.core.views import layout_view
    from shardspec.runtime.canonical import rank_pieces, replica_groups

    spec = folded.SPEC
    for sizes in (spec.sizes(world=4), spec.sizes(world=4, ep=4, tp=1)):
        lm = spec.layout_mesh(sizes)
        for fqn in spec.params:
            layout = spec.layout(fqn, lm)
            view = spec.mesh_of(fqn, lm)
            assert layout_view(layout, lm) == view
            assert rank_pieces(layout, lm) == rank_pieces(layout, view)
            assert replica_groups(layout, lm) == replica_groups(layout, view)
    # experts at ep 4: each rank holds 2 whole experts, no replica
    lm = spec.layout_mesh(spec.sizes(world=4, ep=4, tp=1))
    w1 = spec.layout("layers.0.moe.experts.w1", lm)
    groups = replica_groups(w1, lm)
    assert groups == (((0,),), ((1,),), ((2,),), ((3,),))


PIPELINED = """\
manifest "m.json"
mesh dense over 8 ranks { pp: 2  fsdp: *  tp: 2 }
mesh expert { pp: 2  ep: 2  efsdp: * }
fsdp fsdp
fsdp efsdp
param layers.*.experts.w [e, h] {
    shard e over ep
    style expert_parallel
}
param layers.*.attn.weight [o, h] {
    shard o over tp
    style colwise output replicate
}
pipeline pp {
    split layers.{layer}
}
"""


def test_views_with_pipeline_stages(tmp_path: Path) -> None:
    """The pipeline axis, shared by both views, places each parameter on its stage; its
    layout is on its view's mesh, and ranks of the other stage hold none of it."""
    from shardspec.api import compile_specs
    from shardspec.inputs.manifest import dump_manifest

    entries = [
        {"fqn": f"layers.{i}.{n}", "kind": "param", "shape": [8, 8], "dtype": "float32"}
        for i in (0, 1)
        for n in ("experts.w", "attn.weight")
    ]
    (tmp_path / "m.json").write_text(dump_manifest(entries, "t:m", {}), encoding="utf-8")
    (tmp_path / "p.shard").write_text(PIPELINED, encoding="utf-8")
    out = compile_specs([str(tmp_path / "p.shard")], str(tmp_path / "out"))
    assert not out.errors, [d.message for d in out.diagnostics]
    loaded = importlib.util.spec_from_file_location("views_pp", tmp_path / "out" / "p.py")
    assert loaded is not None and loaded.loader is not None
    mod = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(mod)
    spec = mod.SPEC
    sizes = spec.sizes()
    assert sizes == {"pp": 2, "fsdp": 2, "tp": 2, "ep": 2, "efsdp": 2}
    w = spec.layout("layers.1.experts.w", sizes)
    assert (w.stage_axis, w.stages, w.dims[0].axes) == ("pp", (1,), ("ep", "efsdp"))
    table = spec.rank_table("layers.1.experts.w", sizes)
    held = [t.rank for t in table if t.indices[0] and not t.empty]
    assert held == [4, 5, 6, 7]  # stage 1: pp coordinate 1 in both views
    a = spec.layout("layers.0.attn.weight", sizes)
    assert (a.stages, spec.mesh_of("layers.0.attn.weight", sizes).names) == (
        (0,),
        ("pp", "fsdp", "tp"),
    )


def test_the_last_views_are_held_weakly(folded) -> None:
    """last_mesh keeps a MeshViews by weak references to its meshes: the views come back
    while something (a model's DTensors) holds their meshes, and not after."""
    import gc

    class FakeMesh:  # weakly referenceable, as a DeviceMesh is
        pass

    spec = folded.SPEC
    dense, expert = FakeMesh(), FakeMesh()
    spec.last_mesh = MeshViews({"dense": dense, "expert": expert})
    got = spec.last_mesh
    assert isinstance(got, MeshViews) and got["dense"] is dense and got["expert"] is expert
    del got, expert
    gc.collect()
    assert spec.last_mesh is None
    spec.last_mesh = None
