"""Multi-rank scenarios for ``tests/test_ckpt_crash.py``: a rank killed (``os._exit``) at
each step of ``save``'s protocol, on 3 gloo ranks, then what the next load or save of the
path finds and recovers.

:func:`crash` runs in one round of ``tests/kill_harness.py`` per kill point: every rank
saves checkpoint A (the model at seed 1), then starts saving B (seed 2) on the default
checkpoint group, and the victim dies at the chosen step (one case in an asynchronous
save's background thread). The default process group's timeout is long (the harness's
``pg_timeout``): each survivor returns the error it got and how long its save took, which
must be well under that timeout. :func:`verify` runs once, in a last round, over every
crashed case: the path holds A or B and loads bitwise (recovering and reporting where a
step was left half done), ``<path>.partial`` is refused unless marked complete, and a new
save of the path succeeds.
"""

from __future__ import annotations

import os
import shutil
import traceback
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from examples.models import llama
from shardspec.runtime import checkpoint as ck
from shardspec.runtime.checkpoint import folders
from shardspec.testing import Checks
from tests.kill_harness import victim_run, wait_for_survivors

WORLD = 3
# (kill point, victim rank, what the path holds afterwards: "A" the previous checkpoint,
# "B" the new one; "B?" the new one once the next load or save has recovered it).
CASES: dict[str, tuple[str, int, str]] = {
    "before-writes": ("prepared", 1, "A"),  # the folder prepared, no data written
    "during-writes": ("writing", 2, "A"),  # a rank dies after writing part of its data
    "before-marker": ("written", 0, "A"),  # every byte and .metadata written, not marked
    "other-after-writes": ("written", 2, "B"),  # rank 0 completes the save without rank 2
    "async-after-writes": ("written", 1, "B"),  # the same, in an asynchronous save
    "after-marker": ("marked", 0, "B?"),  # marked complete, not moved into place
    "between-renames": ("renamed-old", 0, "B?"),  # path moved to path.old, not replaced
}


def _model(layout: Any, mesh: Any, seed: int) -> torch.nn.Module:
    model = llama.tiny()
    llama.init_weights(model, seed)
    layout.distribute(model, mesh)
    return model


def _locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }


class _DiesWriting(ck.ShardspecSavePlanner):
    """Kills this rank after it has resolved its first chunks (part of its data written)."""

    victim = False
    served = 0

    def resolve_data(self, write_item):
        self.served += 1
        if self.victim and self.served > 3:
            os._exit(0)
        return super().resolve_data(write_item)


def crash(rank: int, world: int, root: str, case: str) -> dict[str, Any]:
    """Save A, then die at ``case``'s step of saving B (the victim); survivors report their
    error and how long their save took."""
    import generated.llama as layout

    torch.set_num_threads(1)
    point, victim, _ = CASES[case]
    path = os.path.join(root, case, "ckpt")
    mesh = layout.build_mesh(tp=1)
    layout.save({"model": _model(layout, mesh, 1).state_dict()}, path, mesh=mesh)
    planner = _DiesWriting(layout.SPEC, mesh)
    planner.victim = rank == victim and point == "writing"
    state = {"model": _model(layout, mesh, 2).state_dict()}
    asynchronous = case.startswith("async")

    def call() -> None:
        result = ck.save(
            layout.SPEC, state, path, mesh=mesh, planner=planner, asynchronous=asynchronous
        )
        if asynchronous:
            result.result(timeout=300)

    out = victim_run(call, ck.CheckpointError, victim=rank == victim, point=point)
    # Every survivor stays until all have their answer: rank 0 hosts the job's store, which
    # a survivor still blocked in a collective reads once it fails (under torchrun, the
    # store lives in the agent and outlives the ranks).
    wait_for_survivors(os.path.join(root, case), rank, world, victim)
    return out


def folder_state(path: str) -> str:
    return folders._folder_state(path)


def verify(rank: int, world: int, root: str) -> tuple[list[str], dict[str, int]]:
    """After every crash: load each case's path (recovering it), check it holds A or B
    bitwise, that an unfinished ``.partial`` is refused, and that a new save succeeds."""
    import generated.llama as layout

    torch.set_num_threads(1)
    c = Checks()
    mesh = layout.build_mesh(tp=1)
    want = {"A": _locals(_model(layout, mesh, 1)), "B": _locals(_model(layout, mesh, 2))}
    for case, (_, _, holds) in CASES.items():
        try:
            _verify_case(c, layout, mesh, rank, root, case, holds, want)
        except Exception:
            c.fail.append(f"[{case}] raised:\n{traceback.format_exc()}")
        dist.barrier()
    try:
        _verify_restore_old(c, layout, mesh, rank, root, want)
    except Exception:
        c.fail.append(f"[restore-old] raised:\n{traceback.format_exc()}")
    dist.barrier()
    return c.fail, c.count


def _load(layout: Any, mesh: Any, path: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    target = _model(layout, mesh, 9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner = layout.load({"model": target.state_dict()}, path, mesh=mesh)
    said = [str(w.message) for w in caught if issubclass(w.category, ck.CheckpointRecoveryWarning)]
    if said != planner.recovered:
        raise AssertionError(f"warned {said}, planner.recovered {planner.recovered}")
    return _locals(target), said


def _verify_case(
    c: Checks,
    layout: Any,
    mesh: Any,
    rank: int,
    root: str,
    case: str,
    holds: str,
    want: dict[str, dict[str, torch.Tensor]],
) -> None:
    path = os.path.join(root, case, "ckpt")
    tmp = path + ".partial"
    unfinished = folder_state(tmp) == "saving"
    if unfinished:  # never loaded as a checkpoint, whatever it holds
        try:
            layout.load({"model": _model(layout, mesh, 9).state_dict()}, tmp, mesh=mesh)
        except ck.CheckpointError as e:
            c.check(case, "unfinished save" in str(e), f"refused {tmp} with: {e}")
        else:
            c.check(case, False, f"loaded the unfinished save {tmp}")
    got, said = _load(layout, mesh, path)
    expect = want[holds.rstrip("?")]
    bad = [k for k in expect if not torch.equal(expect[k], got[k])]
    c.check(case, not bad, f"{path} does not hold {holds}: {bad[:3]}")
    recovered = holds.endswith("?")
    c.check(case, bool(said) == recovered, f"recovery reported {said}")
    if recovered:
        c.check(case, any("moved it to" in s for s in said), f"reported {said}")
    for debris in (path + ".old",) + (() if unfinished else (tmp,)):
        c.check(case, not os.path.exists(debris), f"{debris} is left after the load")
    # A new save of the path succeeds (removing an unfinished save, reported) and loads.
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        planner = layout.save({"model": _model(layout, mesh, 2).state_dict()}, path, mesh=mesh)
    said = [str(w.message) for w in caught if issubclass(w.category, ck.CheckpointRecoveryWarning)]
    c.check(case, said == planner.recovered, f"warned {said} vs {planner.recovered}")
    c.check(case, bool(said) == unfinished, f"the save reported {said}")
    for debris in (tmp, path + ".old"):
        c.check(case, not os.path.exists(debris), f"{debris} is left after a new save")
    got, said = _load(layout, mesh, path)
    bad = [k for k in want["B"] if not torch.equal(want["B"][k], got[k])]
    c.check(case, not bad and not said, f"after a new save: {bad[:3]}, {said}")


def _verify_restore_old(
    c: Checks, layout: Any, mesh: Any, rank: int, root: str, want: dict
) -> None:
    """``path`` missing and ``path.old`` a checkpoint a save set aside (no ``.partial``),
    as a save stopped between its renames before its new checkpoint was complete leaves
    it: a load restores it (and says so)."""
    tag = "restore-old"
    path = os.path.join(root, "restore", "ckpt")
    if rank == 0:
        os.makedirs(os.path.dirname(path))
        shutil.copytree(os.path.join(root, "before-writes", "ckpt"), path)
        folders.CHECKPOINT._set_aside(path, path + ".old")  # what the save's step does
    dist.barrier()
    got, said = _load(layout, mesh, path)
    c.check(tag, any("restored it to" in s for s in said), f"reported {said}")
    c.check(tag, os.path.isdir(path) and not os.path.exists(path + ".old"), "not restored")
    bad = [k for k in want["B"] if not torch.equal(want["B"][k], got[k])]
    c.check(tag, not bad, f"restored checkpoint differs: {bad[:3]}")


def left(root: str, case: str) -> tuple[str, str, str]:
    """What a crash left: the states of (path, path.partial, path.old)."""
    path = os.path.join(root, case, "ckpt")
    return tuple(folder_state(p) for p in (path, path + ".partial", path + ".old"))  # type: ignore[return-value]
