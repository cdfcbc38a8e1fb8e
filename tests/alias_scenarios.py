"""Rank-side scenarios of tests/test_axis_aliases.py: one spec, meshes that call its FSDP
axis as torchtitan's backends do (``dp_shard``: v0.1-v0.2.0 and the ``spmd_types`` backend;
``fsdp``: the ``partial_dtensor`` backend from v0.2.1), on 4 gloo ranks."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from examples.models import llama
from shardspec.runtime.spec import SpecError
from shardspec.runtime.units import CheckpointError

SPELLINGS = ("dp_shard", "fsdp")


def _layout(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _trained(layout: ModuleType, mesh: Any, seed: int) -> tuple[Any, Any]:
    model = llama.tiny()
    llama.init_weights(model, seed)
    layout.parallelize(model, mesh)
    layout.verify(model, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(seed))
    model(tokens[:, :-1]).sum().backward()
    optim.step()
    return model, optim


def _full(model: Any) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def save_and_load(rank: int, world: int, path: str, folder: str) -> dict[str, Any]:
    """Per spelling: parallelize, verify and save on a mesh (spelling, tp); then load each
    checkpoint on the mesh of the other spelling and compare every parameter bitwise with
    the model that saved it, and a model's DTensors' axis names with the mesh's."""
    layout = _layout(path)
    out: dict[str, Any] = {}
    saved: dict[str, dict[str, torch.Tensor]] = {}
    for i, name in enumerate(SPELLINGS):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(name, "tp"))
        model, optim = _trained(layout, mesh, seed=i)
        w13 = model.layers["0"].feed_forward.w13.weight
        out[f"{name}:axes"] = tuple(w13.device_mesh.mesh_dim_names)
        msd, osd = get_state_dict(model, optim)
        layout.save({"model": msd, "optim": osd}, f"{folder}/{name}", mesh=mesh)
        saved[name] = _full(model)
    for i, name in enumerate(SPELLINGS):
        other = SPELLINGS[1 - i]
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=(name, "tp"))
        model, optim = _trained(layout, mesh, seed=7)
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd}
        layout.load(state, f"{folder}/{other}", mesh=mesh)
        set_state_dict(model, optim, model_state_dict=msd, optim_state_dict=osd)
        layout.verify(model, mesh)
        got = _full(model)
        out[f"{other}->{name}"] = sorted(
            k for k in saved[other] if not torch.equal(got[k], saved[other][k])
        )
        out[f"{other}->{name}:keys"] = len(got)
    return out


def unknown_axis(rank: int, world: int, path: str, folder: str) -> dict[str, str]:
    """A mesh whose FSDP axis is called neither by the spec's name nor by its alias: every
    entry point refuses it naming the axis and the spec's axes (save on every rank, in its
    CheckpointError), before the model or the folder changes."""
    layout = _layout(path)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("data", "tp"))
    model = llama.tiny()
    out = {}
    for what, call in (
        ("parallelize", lambda: layout.parallelize(model, mesh)),
        ("verify", lambda: layout.verify(model, mesh)),
        ("save", lambda: layout.save({"model": model.state_dict()}, f"{folder}/x", mesh=mesh)),
    ):
        try:
            call()
            out[what] = "no error"
        except (SpecError, CheckpointError) as e:
            out[what] = str(e)
    return out


def run_all(rank: int, world: int, path: str, folder: str, root: str) -> dict[str, Any]:
    """Both scenarios in one spawn (a spawn of 4 ranks costs seconds): the saves and loads
    under ``folder``, then the refused mesh, whose save would write under ``root``."""
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    return {
        "save_and_load": save_and_load(rank, world, path, folder),
        "unknown_axis": unknown_axis(rank, world, path, root),
    }
