"""Pipeline stages on a folded spec (issue 21 point 5's "with pp 2" fold): the runtime's
pipeline helpers take build_mesh()'s views wherever they take a mesh. One process here
(the stage arithmetic over views, without process groups); 4 gloo ranks in one spawn in
``tests/views_pipeline_scenarios.py``."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.models import moe
from shardspec.cli import main as shardspec_main
from shardspec.runtime.spec import MeshViews
from shardspec.testing import run_ranks
from tests import views_pipeline_scenarios as vps
from tests import views_scenarios as vs

MANIFEST = vps.SPECS / "deepseek_moe.manifest.json"


def _cli(*args: str) -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = shardspec_main(list(args))
    assert code == 0, out.getvalue()


def compile_specs(root: Path) -> tuple[str, str]:
    """The pipelined folded spec, and its variant for the tied MoE (its manifest built by
    ``shardspec manifest`` from :func:`vps.tied_moe`): the two generated modules' paths."""
    (root / "moe_pp_folded.shard").write_text(vps.spec_text(str(MANIFEST)), encoding="utf-8")
    tied_manifest = root / "tied.manifest.json"
    _cli("manifest", "tests.views_pipeline_scenarios:tied_moe", "-o", str(tied_manifest))
    (root / "moe_pp_folded_tied.shard").write_text(
        vps.spec_text(str(tied_manifest), tied=True), encoding="utf-8"
    )
    _cli("compile", str(root / "moe_pp_folded.shard"), "-o", str(root))
    _cli("compile", str(root / "moe_pp_folded_tied.shard"), "-o", str(root))
    return str(root / "moe_pp_folded.py"), str(root / "moe_pp_folded_tied.py")


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    return compile_specs(tmp_path_factory.mktemp("pp_views_spec"))


class FakeMesh:
    """What the stage functions read of a DeviceMesh: names, shape, this rank's coordinate
    (no process group: one process)."""

    def __init__(self, names: tuple[str, ...], shape: tuple[int, ...], coord: list[int]):
        self.mesh_dim_names = names
        self.shape = shape
        self.coord = coord

    def get_coordinate(self) -> list[int]:
        return self.coord

    def get_group(self, axis: str) -> tuple[tuple[str, ...], str]:
        return (self.mesh_dim_names, axis)  # a stand-in naming the mesh and axis


def _views(rank: int, tied: bool = False) -> MeshViews:
    """The views of a 4-rank world at dense (pp 2, fsdp 2; the tied spec's with tp 1),
    expert (pp 2, ep 2, efsdp 1)."""
    tp = ("tp",) if tied else ()
    return MeshViews(
        {
            "dense": FakeMesh(
                ("pp", "fsdp", *tp), (2, 2, *(1,) * len(tp)), [rank // 2, rank % 2, *(0,) * len(tp)]
            ),
            "expert": FakeMesh(("pp", "ep", "efsdp"), (2, 2, 1), [rank // 2, rank % 2, 0]),
        }
    )


@pytest.mark.parametrize("as_dict", [False, True], ids=["MeshViews", "dict"])
@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_split_stage_takes_the_views(modules: tuple[str, str], rank: int, as_dict: bool) -> None:
    """The stage is the shared pp axis's coordinate; split_stage cuts the whole model to it,
    keeping the reference's tensors; the stage tables answer for the views, and
    pipeline_group is the first view's (it raised on the views before: they are no
    DeviceMesh). A plain mapping view -> DeviceMesh serves as build_mesh()'s MeshViews."""
    mod = vps.load_module(modules[0])
    views: Any = dict(_views(rank)) if as_dict else _views(rank)
    stage = rank // 2
    assert mod.stage_of(views) == stage and mod.num_stages(views) == 2
    assert mod.pipeline_group(views) == (("pp", "fsdp"), "pp")  # the first view's pp group
    model = moe.tiny()
    moe.init_weights(model, vs.SEED)
    ref = {k: v.detach().clone() for k, v in model.named_parameters()}
    mod.split_stage(model, views)
    kept = {k: v for k, v in model.named_parameters()}
    assert sorted(kept) == sorted(mod.stage_params(views))
    assert f"layers.{stage}.moe.experts.w1" in kept
    assert f"layers.{1 - stage}.attn.wq.weight" not in kept
    assert ("embed.weight" in kept) == (stage == 0) and ("head.weight" in kept) == (stage == 1)
    assert all(torch.equal(v, ref[k]) for k, v in kept.items())


def test_the_tied_spec_ties_across_the_stages(modules: tuple[str, str]) -> None:
    """The tied variant places the tie's alias on the last stage: split_stage keeps the
    embedding on stage 0 and the head's copy on stage 1 (the tie helpers' groups)."""
    mod = vps.load_module(modules[1])
    for rank, want in ((0, "embed.weight"), (3, "head.weight")):
        model = vps.tied_moe()
        mod.split_stage(model, _views(rank, tied=True))
        assert want in dict(model.named_parameters())


def test_a_mesh_for_one_view_is_refused(modules: tuple[str, str]) -> None:
    """A single DeviceMesh for a folded spec is refused by name, as elsewhere."""
    from shardspec.runtime.spec import SpecError

    mod = vps.load_module(modules[0])
    with pytest.raises(SpecError, match="has views"):
        mod.stage_of(_views(0)["dense"])


# ----------------------------------------------------------------------- 4 gloo ranks

WORLD = 4


@pytest.fixture(scope="module")
def results(modules: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    from tests.test_views_dist import _qwen3

    root = tmp_path_factory.mktemp("pp_views")
    hf_dir = root / "qwen3"
    _qwen3(hf_dir)
    return run_ranks(vps.run_all, WORLD, str(root), str(hf_dir), *modules, timeout=240)


@pytest.mark.dist
def test_no_scenario_failed(results: list[dict[str, Any]]) -> None:
    fails = [f"rank {r}: {f}" for r, res in enumerate(results) for f in res["fail"]]
    assert not fails, "\n".join(fails[:40])


# Checks each scenario must make on every rank (a scenario that checks nothing fails).
MIN_CHECKS = {
    "groups": 3 + 1,
    "groups views dense": 4 + 2,  # names, shape, coordinate, ranks; each axis's group
    "groups views expert": 4 + 3,
    "stages": 2 + 5,
    "split": 2 + 3 * 13,  # names, experts' mesh, then 3 per parameter of a stage (13 on stage 0)
    "load pp 2 at ep 2 x efsdp 2, tp 2": 1 + 3 * 30,
    "load pp 2 at ep 4": 1 + 3 * 30,
    "load ep 2 x efsdp 2, tp 2 at pp 2": 1 + 3 * 13,
    "ties": 2,
    "load_hf at pp 2": 2 + 13,  # bytes read, names, then each mapped parameter held
    "export_hf at pp 2": 1 + 40,
    "groups, no single own axis": 3,
    "groups, no single own axis views dense": 4 + 3,
    "groups, no single own axis views expert": 4 + 3,
}


@pytest.mark.dist
def test_every_scenario_checked(results: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(results):
        for tag, least in MIN_CHECKS.items():
            got = res["count"].get(tag, 0)
            assert got >= least, f"rank {rank}: {tag} made {got} checks"
