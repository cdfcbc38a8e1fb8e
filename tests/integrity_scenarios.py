"""Checksums and the trust boundary on gloo ranks (for ``tests/test_integrity.py``):
``generated/llama.py``'s ``save`` and ``load`` (checksums written and verified by
default, ``verify=False``, ``trusted=False``) and its planners with DCP's own reader, on a
dp_shard x tp mesh.

Each check appends a failure instead of raising (so no rank is left waiting in a
collective) and counts what it checked."""

from __future__ import annotations

import os
import pickle
import shutil
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

from examples.models import llama
from shardspec.runtime import checkpoint as ck
from shardspec.runtime.checkpoint.integrity import ChecksumReader
from shardspec.runtime.checkpoint.trust import SafeChecksumReader
from shardspec.testing import Checks

EXPECTED = {"round-trip": 4, "plain-dcp": 1, "corrupt": 5, "skip": 1, "safe": 4}


def _model(mod: Any, mesh: Any, seed: int) -> torch.nn.Module:
    model = llama.tiny()
    llama.init_weights(model, seed)
    mod.distribute(model, mesh)
    return model


def _state(model: torch.nn.Module, step: float) -> dict[str, Any]:
    return {
        "model": model.state_dict(),
        "extra": {"step": torch.tensor(step), "groups": [{"lr": step / 10}]},
    }


def _locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _error(fn: Any) -> str | None:
    """The CheckpointError message ``fn`` raised; None if it raised none (another
    exception is re-raised: a scenario failure with its traceback)."""
    try:
        fn()
    except ck.CheckpointError as e:
        return str(e)
    return None


def run_all(rank: int, world: int, root: str) -> tuple[list[str], dict[str, int]]:
    import generated.llama as mod

    checks = Checks()
    mesh = mod.build_mesh(tp=2)
    path, bad = f"{root}/good", f"{root}/bad"
    try:
        source = _model(mod, mesh, 1)
        saved = _locals(source)
        mod.save(_state(source, 7.0), path, mesh=mesh)  # the default: with checksums
        with open(os.path.join(path, ".metadata"), "rb") as f:
            infos = list(pickle.load(f).storage_data.values())
        unsummed = [i for i in infos if not str(getattr(i, "checksum", "")).startswith("rowsum64:")]
        checks.check("round-trip", infos and not unsummed, f"{len(unsummed)} items unsummed")

        # Loads bitwise (verified by default), staging kept; the same with the reader named.
        target = _model(mod, mesh, 2)
        state = _state(target, 0.0)
        planner = mod.load(state, path, mesh=mesh)
        checks.check("round-trip", not _differ(saved, _locals(target)), "values differ")
        reader = ChecksumReader(path)
        planner = ck.load(mod.SPEC, _state(target, 0.0), path, mesh=mesh, storage_reader=reader)
        checks.check("round-trip", reader.verified > 0 and planner.capture, "nothing verified")
        checks.check(
            "round-trip",
            float(state["extra"]["step"]) == 7.0 and state["extra"]["groups"] == [{"lr": 0.7}],
            f"pickled entries came back as {state['extra']}",
        )

        # DCP's own reader reads the same checkpoint.
        target = _model(mod, mesh, 3)
        dcp.load(
            _state(target, 0.0),
            storage_reader=dcp.FileSystemReader(path),
            planner=mod.LoadPlanner(mesh),
        )
        checks.check("plain-dcp", not _differ(saved, _locals(target)), "plain dcp.load differs")

        # One flipped byte in rank 1's file: every rank fails, naming it; no model changes.
        if rank == 0:
            shutil.copytree(path, bad)
            with open(os.path.join(bad, ".metadata"), "rb") as f:
                md = pickle.load(f)
            victim = max(
                (kv for kv in md.storage_data.items() if kv[1].relative_path == "__1_0.distcp"),
                key=lambda kv: kv[1].length,
            )
            index, info = victim
            with open(os.path.join(bad, info.relative_path), "r+b") as f:
                f.seek(info.offset + info.length // 2)
                byte = f.read(1)[0]
                f.seek(info.offset + info.length // 2)
                f.write(bytes([byte ^ 0x10]))
            names = [index.fqn, list(index.offset)]
        else:
            names = [None, None]
        dist.broadcast_object_list(names, src=0)
        target = _model(mod, mesh, 4)
        before = _locals(target)
        msg = _error(lambda: mod.load(_state(target, 0.0), bad, mesh=mesh))
        checks.check("corrupt", msg is not None, "a flipped byte loaded without an error")
        msg = msg or ""
        checks.check("corrupt", "the model was not changed" in msg, msg)
        checks.check("corrupt", "checksum mismatch" in msg and "__1_0.distcp" in msg, msg)
        checks.check(
            "corrupt", repr(names[0]) in msg and f"chunk at offsets {names[1]}" in msg, msg
        )
        checks.check("corrupt", not _differ(before, _locals(target)), "the model changed")

        # verify=False: no error (the flipped value is loaded where it lies).
        msg = _error(lambda: mod.load(_state(target, 0.0), bad, mesh=mesh, verify=False))
        checks.check("skip", msg is None, f"verify=False still failed: {msg}")

        # The trust boundary and the checksums together, by keyword and by reader.
        target = _model(mod, mesh, 5)
        mod.load(_state(target, 0.0), path, mesh=mesh, trusted=False)
        checks.check("safe", not _differ(saved, _locals(target)), "trusted=False differs")
        target = _model(mod, mesh, 6)
        msg = _error(lambda: mod.load(_state(target, 0.0), bad, mesh=mesh, trusted=False))
        checks.check("safe", "checksum mismatch" in (msg or ""), f"trusted=False: {msg}")
        target = _model(mod, mesh, 5)
        reader = SafeChecksumReader(path)
        planner = ck.load(mod.SPEC, _state(target, 0.0), path, mesh=mesh, storage_reader=reader)
        checks.check("safe", not _differ(saved, _locals(target)), "SafeChecksumReader differs")
        checks.check("safe", reader.verified > 0 and planner.capture, "nothing verified")
    except Exception:
        checks.fail.append(f"raised:\n{traceback.format_exc()}")
    dist.barrier()
    return checks.fail, dict(checks.count)
