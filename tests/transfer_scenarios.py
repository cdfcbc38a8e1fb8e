"""Multi-rank scenarios of tests/test_transfer_runtime.py: one group of six gloo ranks,
the trainer on ranks 0-3 (specs/llama.shard at dp_shard 2 x tp 2, trained 2 AdamW steps),
the engine on ranks 4-5 (the same model at tp 2) or on rank 4 alone (a plain one-rank
model, in a group of ranks 0-4).

The owner's answer: the trainer's full tensors (torch's ``full_tensor()``, gathered on the
trainer ranks before the transfer, outside the counted block), loaded into a fresh model
that torch cuts into the engine's layout (``parallelize``): what the transfer wrote must
equal it bitwise (and, for a bf16 engine, equal it cast with torch's ``.to(bfloat16)``).
(``export_hf`` + ``load_hf`` would be the HF-level answer, but export_hf makes collectives
on the default group, which here holds the engine ranks too.)
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

import generated.llama as layout
from examples.models.llama import tiny
from shardspec.runtime import transfer
from tests.hf_scenarios import count_collectives, count_dispatched_collectives

T = 4  # trainer ranks


def _meshes() -> tuple[DeviceMesh, DeviceMesh]:
    """Every rank builds both meshes (torch makes their groups with every rank)."""
    names = ("dp_shard", "tp")
    trainer = DeviceMesh("cpu", torch.arange(T).reshape(2, 2), mesh_dim_names=names)
    engine = DeviceMesh("cpu", torch.arange(T, T + 2).reshape(1, 2), mesh_dim_names=names)
    return trainer, engine


def _trained(mesh: DeviceMesh) -> torch.nn.Module:
    """The tiny llama, parallelized by the spec on ``mesh`` and trained 2 AdamW steps."""
    torch.manual_seed(0)
    model = tiny()
    layout.parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1 + mesh.get_coordinate()[0])  # type: ignore[index]
    for _ in range(2):
        tokens = torch.randint(0, 256, (2, 8), generator=gen)
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _engine(mesh: DeviceMesh | None, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(123)  # other values than the trainer's
    model = tiny().to(dtype)
    if mesh is not None:
        layout.parallelize(model, mesh)
    return model


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}


def transfer_round(rank: int, world: int, folder: str, case: dict[str, Any]) -> dict[str, Any]:
    """One transfer case on this rank; returns what the test checks.

    ``case``: ``plan`` (path), ``engine`` ("tp2" or "one"), ``dtype``, ``bucket`` and,
    optionally, ``plan_on`` (per rank: another plan path), ``victim`` (a trainer rank
    that dies before round ``die_at``), ``timeout``."""
    torch.set_num_threads(1)
    trainer_mesh, engine_mesh = _meshes()
    one = case["engine"] == "one"
    group = dist.new_group(list(range(T + 1))) if one else None
    export = os.path.join(folder, "export")
    out: dict[str, Any] = {"rank": rank}
    dtype = getattr(torch, case.get("dtype", "float32"))
    plan_path = case.get("plan_on", {}).get(rank, case["plan"])
    if one and rank == T + 1:
        return out  # not in the transfer group
    if rank < T:
        model = _trained(trainer_mesh)
        role, call, spec_model = "trainer", transfer.send_weights, model
        if case.get("export"):  # the owner's tensors, gathered by torch (trainer ranks only)
            full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
            if rank == 0:
                torch.save(full, export + ".tmp")
                os.replace(export + ".tmp", export)
    else:
        model = _engine(None if one else engine_mesh, dtype)
        role, call, spec_model = "engine", transfer.receive_weights, model
    before = _state(model)
    if case.get("victim") == rank:
        transfer._fault_point = lambda k: os._exit(0) if k == case["die_at"] else None
    started = time.monotonic()
    try:
        with count_collectives() as calls, count_dispatched_collectives() as ops:
            stats = call(
                spec_model,
                plan_path,
                spec=layout,
                group=group,
                bucket_bytes=case["bucket"],
                timeout=case.get("timeout", 120.0),
            )
        out["stats"] = stats
        out["calls"], out["ops"] = dict(calls), dict(ops)
        out["error"] = None
    except transfer.TransferError as e:
        out["error"] = str(e)
    except Exception:
        out["error"] = "UNEXPECTED " + traceback.format_exc()
    out["seconds"] = time.monotonic() - started
    out["role"] = role
    after = _state(model)
    out["changed"] = sorted(n for n in before if not torch.equal(before[n], after[n]))
    out["stale"] = transfer.weights_stale(model)
    if case.get("victim") is not None or out["error"] is not None:
        # A survivor stays up a while, as a real job does: the store that survivors check
        # in with lives in rank 0's process.
        time.sleep(case.get("linger", 0))
        return out
    if case.get("export") and rank >= T:  # (the closing check waited for the export)
        out["mismatch"] = _compare(model, None if one else engine_mesh, export, dtype)
    return out


def _compare(
    model: torch.nn.Module, mesh: DeviceMesh | None, export: str, dtype: torch.dtype
) -> list[str]:
    """Parameters that differ, bitwise, from the trainer's full tensors cut into this
    engine's layout by torch (``parallelize``: DTensor's distribute_tensor), cast with
    torch for a narrower engine dtype."""
    torch.manual_seed(7)
    ref = tiny()
    ref.load_state_dict(torch.load(export, weights_only=True))
    if mesh is not None:
        layout.parallelize(ref, mesh)
    want = {n: t.to(dtype) for n, t in _state(ref).items()}
    got = _state(model)
    bad = [n for n in want if got[n].dtype != dtype or not torch.equal(got[n], want[n])]
    if not want:
        bad.append("(no parameters compared)")
    return bad
