"""Multi-rank scenarios for ``tests/test_views_dist.py``: a spec with views
(specs/deepseek_moe_folded.shard, the example MoE with a dense and an expert view) on gloo
CPU ranks, run by :func:`shardspec.testing.run_ranks` in one spawn.

* ``build_mesh`` against torch: each view's DeviceMesh has the view's axes and sizes, rank r
  sits at r's row-major coordinate in every view, and each axis's process group holds the
  ranks of ``init_device_mesh``'s mesh of that shape.
* ``distribute`` at a fold: every parameter a DTensor on its view's DeviceMesh, bitwise the
  single-process model's, each rank's local shard at the compiler's global indices.
* Checkpoints across folds: saved at dense (fsdp 2, tp 2) x expert (ep 2, efsdp 2), loaded
  at expert ep 4 with dense fsdp 4, at dense tp 4, and into the single-view spec
  (specs/deepseek_moe.shard: dp_shard 2 x ep 2); saved at ep 4 and from the single-view
  spec and loaded back at the first fold. Each load starts from other values and must give
  the saved model bitwise.

Scenarios record failures (:class:`shardspec.testing.Checks`) rather than raise, so one
rank's failed check never leaves the others waiting in a collective.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from examples.models import moe
from shardspec.core.layout import Mesh
from shardspec.runtime.dtensor import take
from shardspec.testing import Checks
from tests.hf_scenarios import hf_state

SEED, OTHER = 1234, 77
FOLDED = "generated.deepseek_moe_folded"
SINGLE = "generated.deepseek_moe"
# Folds of 4 ranks, as build_mesh overrides: dense (fsdp, tp) x expert (ep, efsdp).
FOLD_A = {"tp": 2, "ep": 2}  # fsdp 2, efsdp 2
FOLD_EP4 = {"tp": 1, "ep": 4}  # fsdp 4, efsdp 1
FOLD_TP4 = {"tp": 4, "ep": 2}  # fsdp 1, efsdp 2


def _model(seed: int) -> nn.Module:
    model = moe.tiny()
    moe.init_weights(model, seed)
    return model


def _reference() -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _model(SEED).named_parameters()}


def check_build_mesh(checks: Checks, rank: int) -> None:
    """Each view's DeviceMesh against the one torch builds for its shape."""
    mod = importlib.import_module(FOLDED)
    for fold in (FOLD_A, FOLD_EP4, FOLD_TP4):
        views = mod.build_mesh(**fold)
        check_views_are_torchs(checks, f"build_mesh {fold}", mod, views, fold, rank)
        checks.check("views coordinate", views.get_coordinate() is not None, "no coordinate")


def check_views_are_torchs(
    checks: Checks, tag: str, mod: Any, views: Any, fold: dict[str, int], rank: int
) -> None:
    """Every view of ``views`` (``mod.build_mesh(**fold)``'s) against ``init_device_mesh``'s
    mesh of its shape: names, shape, this rank's coordinate, ranks and each axis's group."""
    sizes = mod.SPEC.sizes(world=dist.get_world_size(), **fold)
    for view, axes in mod.VIEWS.items():
        dm = views[view]
        shape = tuple(sizes[a] for a in axes)
        vtag = f"{tag} {view}"
        checks.check(vtag, tuple(dm.mesh_dim_names) == axes, f"names {dm.mesh_dim_names}")
        checks.check(vtag, tuple(dm.shape) == shape, f"shape {tuple(dm.shape)} != {shape}")
        want = Mesh(axes, shape).coord_of(rank)
        got = tuple(dm.get_coordinate() or ())
        checks.check(vtag, got == want, f"coordinate {got} != {want}")
        torch_mesh = init_device_mesh("cpu", shape, mesh_dim_names=axes)
        checks.check(vtag, torch.equal(dm.mesh, torch_mesh.mesh), f"{dm.mesh}")
        for a in axes:
            got = dist.get_process_group_ranks(dm.get_group(a))
            expect = dist.get_process_group_ranks(torch_mesh.get_group(a))
            checks.check(vtag, got == expect, f"axis {a}: ranks {got} != {expect}")


def _distributed(mod: Any, fold: dict[str, int] | None, seed: int) -> tuple[nn.Module, Any]:
    views = mod.build_mesh(**(fold or {}))
    model = _model(seed)
    mod.distribute(model, views)
    return model, views


def compare(
    checks: Checks, tag: str, mod: Any, model: nn.Module, views: Any, ref: dict[str, torch.Tensor]
) -> None:
    """Every parameter: a DTensor on its view's DeviceMesh, whose local shard is the
    reference at the compiler's indices, and whose full tensor is the reference, bitwise."""
    spec = mod.SPEC
    for fqn, p in model.named_parameters():
        if not isinstance(p, DTensor):
            checks.check(tag, False, f"{fqn}: not a DTensor")
            continue
        vmesh = spec.mesh_of(fqn, views)
        checks.check(
            tag,
            set(p.device_mesh.mesh_dim_names or ()) <= set(vmesh.names),
            f"{fqn}: on {p.device_mesh.mesh_dim_names}, not view {vmesh.names}",
        )
        shard = spec.rank_table(fqn, views)[dist.get_rank()]
        want = take(ref[fqn], shard.indices)
        local = p.to_local()
        checks.check(
            tag,
            local.shape == want.shape and torch.equal(local, want),
            f"{fqn}: local shard differs",
        )
        full = p.full_tensor()
        checks.check(tag, torch.equal(full, ref[fqn]), f"{fqn}: full tensor differs")


def check_distribute(checks: Checks, ref: dict[str, torch.Tensor]) -> None:
    mod = importlib.import_module(FOLDED)
    for fold in (FOLD_A, FOLD_EP4, FOLD_TP4):
        model, views = _distributed(mod, fold, SEED)
        compare(checks, f"distribute {fold}", mod, model, views, ref)
        w1 = model.get_parameter("layers.0.moe.experts.w1")
        checks.check(
            f"distribute {fold}",
            tuple(w1.device_mesh.mesh_dim_names) == ("ep", "efsdp"),
            f"experts on {w1.device_mesh.mesh_dim_names}",
        )


def _save(mod: Any, fold: dict[str, int] | None, path: str) -> None:
    model, views = _distributed(mod, fold, SEED)
    mod.save({"model": model.state_dict()}, path, mesh=views)


def _load_and_compare(
    checks: Checks, tag: str, mod: Any, fold: dict[str, int] | None, path: str, ref: dict
) -> None:
    model, views = _distributed(mod, fold, OTHER)
    first = next(iter(model.named_parameters()))
    checks.check(tag, not torch.equal(first[1].full_tensor(), ref[first[0]]), "starts equal")
    mod.load({"model": model.state_dict()}, path, mesh=views)
    compare(checks, tag, mod, model, views, ref)


def check_checkpoints(checks: Checks, root: str, ref: dict[str, torch.Tensor]) -> None:
    folded = importlib.import_module(FOLDED)
    single = importlib.import_module(SINGLE)
    a = os.path.join(root, "fold-a")
    _save(folded, FOLD_A, a)
    _load_and_compare(checks, "load fold-a at ep 4, fsdp 4", folded, FOLD_EP4, a, ref)
    _load_and_compare(checks, "load fold-a at tp 4", folded, FOLD_TP4, a, ref)
    _load_and_compare(checks, "load fold-a at the single view", single, None, a, ref)
    b = os.path.join(root, "fold-ep4")
    _save(folded, FOLD_EP4, b)
    _load_and_compare(checks, "load fold-ep4 at fold a", folded, FOLD_A, b, ref)
    c = os.path.join(root, "single")
    _save(single, None, c)
    _load_and_compare(checks, "load the single view at fold a", folded, FOLD_A, c, ref)


def check_load_hf(checks: Checks, root: str, hf_dir: str) -> None:
    """Qwen3-MoE's per-expert HF keys load into the folded model at two folds: every
    parameter the hf block maps equals the model's owner's tensor (transformers' own
    weights, stacked by hand), on its view's DeviceMesh; export_hf writes transformers'
    own files again, bitwise."""
    hf, owner = hf_and_owner(hf_dir)
    mod = importlib.import_module(FOLDED)
    for fold in (FOLD_A, FOLD_EP4):
        model, views = _distributed(mod, fold, OTHER)
        out = os.path.join(root, f"export-{fold['ep']}")
        check_hf_round_trip(checks, f"at {fold}", mod, model, views, hf_dir, hf, owner, out)


def hf_and_owner(hf_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The HF checkpoint's tensors, and the example MoE's parameters from them (the
    owner's weights, stacked by hand)."""
    from examples.models import hf as hfm

    hf = hf_state(hf_dir)
    return hf, {k: v.float() for k, v in hfm.moe_from_hf(hf, moe.MoEConfig()).items()}


def check_hf_round_trip(
    checks: Checks,
    where: str,
    mod: Any,
    model: nn.Module,
    views: Any,
    hf_dir: str,
    hf: dict[str, torch.Tensor],
    owner: dict[str, torch.Tensor],
    out: str,
) -> None:
    """load_hf into ``model`` (distributed on ``views``): every mapped parameter it holds is
    the owner's tensor, and this rank reads exactly its shards' bytes; then export_hf
    writes the checkpoint's own tensors again, bitwise."""
    tag = f"load_hf {where}"
    report = mod.load_hf(model, hf_dir, mesh=views)
    mapped = {k: p for k, p in model.named_parameters() if not k.startswith("hc_head.")}
    # each rank reads its own shards' bytes only: its experts' among them
    local = sum(p.to_local().numel() * p.element_size() for p in mapped.values())
    checks.check(tag, report.bytes_read == local, f"read {report.bytes_read} bytes, holds {local}")
    checks.check(tag, set(mapped) <= set(owner), f"unmapped {sorted(set(mapped) - set(owner))}")
    for fqn, p in mapped.items():
        checks.check(
            tag, torch.equal(p.full_tensor(), owner[fqn]), f"{fqn}: not the owner's tensor"
        )
    mod.export_hf(model, out, mesh=views)
    dist.barrier()
    got = hf_state(out)
    tag = f"export_hf {where}"
    checks.check(tag, set(got) == set(hf), f"keys differ: {sorted(set(got) ^ set(hf))[:4]}")
    for key in sorted(set(got) & set(hf)):
        checks.check(tag, torch.equal(got[key], hf[key]), f"{key} differs from the original")


def run_all(rank: int, world: int, root: str, hf_dir: str) -> dict[str, Any]:
    """Every scenario on this rank: failures and the checks made per tag."""
    checks = Checks()
    ref = _reference()
    check_build_mesh(checks, rank)
    check_distribute(checks, ref)
    check_checkpoints(checks, root, ref)
    check_load_hf(checks, root, hf_dir)
    return {"fail": checks.fail, "count": checks.count}
