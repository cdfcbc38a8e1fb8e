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
    # The generated module's wrappers (layout.send_weights: the module is its own spec),
    # or the runtime's functions with spec= (case "runtime").
    wrapped = not case.get("runtime")
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
    if case.get("victim") is not None:
        # Every rank enters the transfer together (trainers train first), so the case's
        # short per-wait timeout bounds the transfer alone, never a peer still training.
        dist.barrier()
    if case.get("victim") == rank:
        transfer._fault_point = lambda k: os._exit(0) if k == case["die_at"] else None
    started = time.monotonic()
    try:
        options: dict[str, Any] = {"group": group, "bucket_bytes": case["bucket"]}
        options["timeout"] = case.get("timeout", 120.0)
        with count_collectives() as calls, count_dispatched_collectives() as ops:
            if wrapped:
                # (a plan file that may be damaged goes in as a path: the call then refuses
                # it on every rank, through its validation all_reduce)
                plan = layout.load_transfer_plan(plan_path) if case.get("export") else plan_path
                side = layout.send_weights if role == "trainer" else layout.receive_weights
                stats = side(spec_model, plan, **options)
            else:
                stats = call(spec_model, plan_path, spec=layout, **options)
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
        # Rank 0 stays up a while, as a real job does: the store that survivors check in
        # with lives in its process (the others fail two waits later than it does).
        time.sleep(case.get("linger", 0) if rank == 0 else 0)
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


# ------------------------------------------------------------------------------ interop


def _meet(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """The intersection of two sorted lists of [start, stop) runs."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append([lo, hi])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def standin_moves(
    names: list[str], sender: dict[str, Any], receiver: dict[str, Any]
) -> list[tuple[str, int, int, list[list[list[int]]]]]:
    """A stand-in engine's own M-to-N plan, from both sides' get_sharding declarations
    only: per HF name and engine rank, the box each trainer rank sends (replicas, equal
    boxes: the first holder; each element from one sender)."""
    out = []
    for n in names:
        first: dict[str, int] = {}
        for s in sender[n]["ranks"]:
            if s["count"]:
                first.setdefault(repr(s["box"]), s["rank"])
        for e in receiver[n]["ranks"]:
            if not e["count"]:
                continue
            for s in sender[n]["ranks"]:
                if not s["count"] or first[repr(s["box"])] != s["rank"]:
                    continue
                box = [_meet(a, b) for a, b in zip(s["box"], e["box"], strict=True)]
                if all(box):
                    out.append((n, s["rank"], e["rank"], box))
    return out


def interop_round(rank: int, world: int, folder: str, case: dict[str, Any]) -> dict[str, Any]:
    """A stand-in engine that consumes only ``layout.hf_names``, ``layout.get_sharding`` and
    ``layout.local_view``: the trainer (ranks 0-3) and the engine each declare their layout
    per HF name; every rank computes the same moves from both declarations, and the bytes
    go over batch_isend_irecv straight from the trainer's local views into the engine's.
    Two engines, one after the other: tp 2 on ranks 4-5, then one rank (rank 4, a plain
    model). Each then equals the trainer's full tensors cut by torch into its layout,
    bitwise."""
    torch.set_num_threads(1)
    trainer_mesh, engine_mesh = _meshes()
    export = os.path.join(folder, "export")
    trainer = _trained(trainer_mesh) if rank < T else None
    if trainer is not None:
        full = {n: p.full_tensor().detach().clone() for n, p in trainer.named_parameters()}
        if rank == 0:
            torch.save(full, export + ".tmp")
            os.replace(export + ".tmp", export)
    dist.barrier()  # (the export is written)
    out: dict[str, Any] = {"rank": rank}
    for name, sizes in (("tp2", {"dp_shard": 1, "tp": 2}), ("one", {"dp_shard": 1, "tp": 1})):
        engine: Any = None
        if rank >= T and rank - T < sizes["tp"]:
            engine = _engine(engine_mesh if name == "tp2" else None, torch.float32)
        where: Any = engine_mesh if name == "tp2" else sizes
        out[name] = _standin(rank, trainer, trainer_mesh, engine, where, sizes)
        if engine is not None:
            out[name]["mismatch"] = _compare(
                engine, engine_mesh if name == "tp2" else None, export, torch.float32
            )
            out[name]["owned"] = sum(_local(p).numel() * 4 for p in engine.parameters())
    return out


def _standin(
    rank: int,
    trainer: torch.nn.Module | None,
    trainer_mesh: DeviceMesh,
    engine: torch.nn.Module | None,
    engine_where: Any,
    engine_sizes: dict[str, int],
) -> dict[str, Any]:
    """One stand-in transfer (see :func:`interop_round`) on this rank."""
    names = layout.hf_names({"dp_shard": 2, "tp": 2})
    sender = {n: layout.get_sharding(n, {"dp_shard": 2, "tp": 2}) for n in names}
    receiver = {n: layout.get_sharding(n, engine_sizes, start_rank=T) for n in names}
    moves = standin_moves(names, sender, receiver)
    out: dict[str, Any] = {"moves": len(moves), "sent": 0, "received": 0}
    one = isinstance(engine_where, dict)
    ops, received = [], []
    with count_collectives() as calls:
        for n, s, e, box in moves:
            if rank == s:
                assert trainer is not None
                data = layout.local_view(trainer, n, trainer_mesh).read(box).contiguous()
                ops.append(dist.P2POp(dist.isend, data, T + e))
                out["sent"] += data.numel() * data.element_size()
            elif rank == T + e:
                buf = torch.empty([sum(b - a for a, b in d) for d in box])
                ops.append(dist.P2POp(dist.irecv, buf, s))
                received.append((n, box, buf))
        for w in dist.batch_isend_irecv(ops) if ops else []:
            w.wait()
    for n, box, buf in received:
        view = layout.local_view(engine, n, engine_where, rank=0 if one else None)
        view.write(buf, box)
        out["received"] += buf.numel() * buf.element_size()
    out["calls"] = dict(calls)
    return out
