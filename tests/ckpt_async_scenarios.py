"""Multi-rank scenarios for ``tests/test_ckpt_async.py``: asynchronous saves while training
runs collectives on the default group, on 4 gloo ranks (the example llama spec,
``generated/llama.py``, dp_shard 2 x tp 2, trained with ``parallelize`` and AdamW).

* ``train``: ``layout.save(..., asynchronous=True)`` returns a future; the save's own
  process group carries every collective of the save while training steps (each with an
  all-reduce on the default group) run; the save is held open at its first step until
  three training steps have run, so the two really overlap. The parameters change right
  after the call returns; once the future completes, the checkpoint loads bitwise equal
  to the state at the call. Two saves started back to back complete in order.
* ``dcp``: plain ``dcp.async_save(..., planner=layout.SavePlanner(), process_group=...)``
  (the issue's reproduction: the planner used to all-gather on the default group from
  DCP's thread) while training runs.
* ``fail``: ranks whose state dicts differ in structure: the future raises the
  ``CheckpointError`` on every rank, the previous checkpoint stays and loads bitwise, no
  debris is left; a structure mismatch of a synchronous save on a process group of its own
  fails the same way.
"""

from __future__ import annotations

import os
import tempfile
import threading
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor

from examples.models import llama
from shardspec.runtime import checkpoint as ck
from shardspec.runtime.checkpoint import folders
from shardspec.testing import Checks

VOCAB = 256
LR = 1e-3


def _tokens(step: int, mesh: Any) -> torch.Tensor:
    """This rank's part (over dp_shard) of a global batch of 4 sequences."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (4, 17), generator=gen)
    return tokens.chunk(mesh["dp_shard"].size())[mesh["dp_shard"].get_local_rank()]


def _snapshot(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict, as a local copy (DTensors: the local shard)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(state, dict):
        for k, v in state.items():
            out.update(_snapshot(v, f"{prefix}{k}."))
    elif isinstance(state, list):
        for i, v in enumerate(state):
            out.update(_snapshot(v, f"{prefix}{i}."))
    elif isinstance(state, DTensor):
        out[prefix[:-1]] = state.to_local().detach().clone()
    elif isinstance(state, torch.Tensor):
        out[prefix[:-1]] = state.detach().clone()
    return out


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))


class Trainer:
    """A parallelized tiny llama with AdamW; each step also all-reduces a counter on the
    default group (the collectives an asynchronous save must not mix with)."""

    def __init__(self, layout: Any, mesh: Any, seed: int) -> None:
        torch.manual_seed(seed)
        model = llama.tiny()
        llama.init_weights(model, seed)
        layout.parallelize(model, mesh)
        self.model, self.mesh = model, mesh
        self.optim = torch.optim.AdamW(model.parameters(), lr=LR)
        self.steps = 0

    def step(self, future: Any = None) -> bool:
        """One training step; returns whether ``future`` is done on every rank (decided
        together, so that every rank stops stepping at the same step)."""
        self.optim.zero_grad()
        tokens = _tokens(self.steps, self.mesh)
        logits = self.model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        self.optim.step()
        done = torch.tensor([1 if future is None or future.done() else 0])
        dist.all_reduce(done, op=dist.ReduceOp.MIN)  # the default group
        self.steps += 1
        return bool(done)

    def state(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optim)
        return {"model": msd, "optim": osd}


class _Gate:
    """Holds every asynchronous save at its first step (after the coordinator prepared the
    folder, before DCP's plan exchange) until the training loop opens it."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.reached = threading.Event()

    def __call__(self, point: str) -> None:
        if point == "prepared" and threading.current_thread() is not threading.main_thread():
            self.reached.set()
            self.opened.wait(timeout=120)


def _loads_bitwise(c: Checks, tag: str, layout: Any, mesh: Any, path: str, want: dict) -> None:
    fresh = Trainer(layout, mesh, seed=99)
    fresh.step()  # AdamW state exists
    state = fresh.state()
    layout.load(state, path, mesh=mesh)
    got = _snapshot(state)
    c.check(tag, got.keys() == want.keys(), f"loaded keys {sorted(set(got) ^ set(want))[:4]}")
    bad = _differs(want, got)
    c.check(tag, not bad, f"loaded values differ from the state at the call: {bad[:4]}")


def _no_debris(c: Checks, tag: str, path: str) -> None:
    for debris in (path + ".partial", path + ".old"):
        c.check(tag, not os.path.exists(debris), f"{debris} left behind")
    c.check(tag, os.path.isfile(os.path.join(path, ck.MARKER)), f"{path} not marked complete")


def scenario_train(c: Checks, root: str) -> None:
    import generated.llama as layout

    tag = "train"
    mesh = layout.build_mesh(tp=2)
    trainer = Trainer(layout, mesh, seed=1)
    trainer.step()
    state = trainer.state()
    at_call = _snapshot(state)
    path = os.path.join(root, "async")
    gate = _Gate()
    folders._fault_point = gate
    try:
        future = layout.save(state, path, mesh=mesh, asynchronous=True)
        c.check(tag, hasattr(future, "result") and hasattr(future, "done"), f"{future!r}")
        # The live tensors may change at once: the save copied what it writes.
        trainer.step()
        bad = _differs(at_call, _snapshot(trainer.state()))
        c.check(tag, len(bad) > 10, f"only {len(bad)} tensors changed in a training step")
        c.check(tag, gate.reached.wait(timeout=60), "the save never reached its first step")
        during = 0
        for _ in range(3):  # the save is in flight (held at its first step)
            trainer.step()
            during += not future.done()
        c.check(tag, during == 3, f"{during} of 3 steps ran while the save was pending")
        gate.opened.set()
        while not trainer.step(future) and trainer.steps < 500:
            pass  # training goes on while the save writes
    finally:
        gate.opened.set()
        folders._fault_point = None
    planner = future.result(timeout=120)
    c.check(tag, isinstance(planner, ck.ShardspecSavePlanner), f"result {planner!r}")
    _no_debris(c, tag, path)
    _loads_bitwise(c, tag, layout, mesh, path, at_call)
    # Two saves started back to back (no wait between) complete in order; a synchronous
    # save after them waits for them; each checkpoint is the state at its call.
    first = _snapshot(trainer.state())
    f1 = layout.save(trainer.state(), path, mesh=mesh, asynchronous=True)
    trainer.step()
    second = _snapshot(trainer.state())
    f2 = layout.save(trainer.state(), path + "2", mesh=mesh, asynchronous=True)
    trainer.step()
    third = _snapshot(trainer.state())
    layout.save(trainer.state(), path + "3", mesh=mesh)
    c.check(tag, f1.done() and f2.done(), "a synchronous save did not wait for pending ones")
    f1.result(), f2.result()
    for p, want in ((path, first), (path + "2", second), (path + "3", third)):
        _no_debris(c, tag, p)
        _loads_bitwise(c, tag, layout, mesh, p, want)


def scenario_dcp(c: Checks, root: str) -> None:
    """The issue's reproduction: DCP's own async_save with the generated planner on a gloo
    group of its own, training on the default group meanwhile."""
    import generated.llama as layout

    tag = "dcp"
    mesh = layout.build_mesh(tp=2)
    trainer = Trainer(layout, mesh, seed=2)
    trainer.step()
    state = trainer.state()
    at_call = _snapshot(state)
    group = dist.new_group(backend="gloo")
    path = os.path.join(root, "dcp_async")
    result = dcp.async_save(
        state, checkpoint_id=path, planner=layout.SavePlanner(mesh), process_group=group
    )
    future = getattr(result, "upload_completion", result)  # AsyncSaveResponse or a Future
    steps = 0
    while (not trainer.step(future) or steps < 1) and steps < 500:
        steps += 1
    future.result(timeout=120)
    c.check(tag, steps >= 1, f"{steps} steps")
    dist.barrier()
    _loads_bitwise(c, tag, layout, mesh, path, at_call)
    dist.destroy_process_group(group)


def scenario_fail(c: Checks, root: str) -> None:
    import generated.llama as layout

    tag = "fail"
    mesh = layout.build_mesh(tp=2)
    trainer = Trainer(layout, mesh, seed=3)
    trainer.step()
    path = os.path.join(root, "refused")
    before = _snapshot(trainer.state())
    layout.save(trainer.state(), path, mesh=mesh)
    dist.barrier()
    files = sorted(os.listdir(path))
    trainer.step()
    odd = trainer.state()
    if dist.get_rank() == 1:
        odd["extra"] = {"only_here": torch.zeros(3)}
    group = dist.new_group(backend="gloo")
    for how, run in (
        ("async", lambda: layout.save(odd, path, mesh=mesh, asynchronous=True).result(60)),
        ("sync, own group", lambda: layout.save(odd, path, mesh=mesh, process_group=group)),
    ):
        try:
            run()
        except ck.CheckpointError as e:
            ok = "ranks disagree on the checkpoint's structure" in str(e)
            c.check(tag, ok, f"{how}: refused with {e}")
            c.check(tag, "rank 1 differs from rank 0" in str(e), f"{how}: {e}")
        except Exception as e:
            c.check(tag, False, f"{how}: {type(e).__name__}, not CheckpointError: {e}")
        else:
            c.check(tag, False, f"{how}: a save of mismatched structures succeeded")
        dist.barrier()
        c.check(tag, sorted(os.listdir(path)) == files, f"{how}: the previous files changed")
        _no_debris(c, tag, path)
        _loads_bitwise(c, tag, layout, mesh, path, before)
    # The failed save left nothing that blocks the next one.
    good = trainer.state()
    want = _snapshot(good)
    layout.save(good, path, mesh=mesh, asynchronous=True).result(60)
    _loads_bitwise(c, tag, layout, mesh, path, want)
    dist.destroy_process_group(group)


def run_all(rank: int, world: int) -> tuple[list[str], dict[str, int]]:
    torch.set_num_threads(1)  # 4 ranks on 2 cores
    c = Checks()
    with tempfile.TemporaryDirectory() as tmp:
        root = [tmp]
        dist.broadcast_object_list(root, src=0)
        steps: list[tuple[str, Callable[[], None]]] = [
            ("train", lambda: scenario_train(c, root[0])),
            ("dcp", lambda: scenario_dcp(c, root[0])),
            ("fail", lambda: scenario_fail(c, root[0])),
        ]
        for name, step in steps:
            try:
                step()
            except Exception:
                c.fail.append(f"[{name}] raised:\n{traceback.format_exc()}")
            dist.barrier()
    return c.fail, c.count
