"""How the generated load planner lands chunks: ``load()``'s staged reads (the chunks as
read are the staged copies, committed only after every read succeeded), plain ``dcp.load``
through a short-lived buffer per read for units cut in runs, and the box commit both use.
One process, world 1 (fused q/k/v and gate/up units are still cut in runs)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from bench import bench_checkpoint as bc
from shardspec.core.layout import Mesh
from shardspec.runtime import checkpoint as ck
from shardspec.runtime import units
from shardspec.runtime.canonical import Unit
from shardspec.runtime.checkpoint import staging

SPEC = bc.bench_spec({})
# One process: DCP says it assumes a single-process save/load; that is the intent here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(seed: int) -> dict[str, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    model = {
        k: torch.randn(p.shape, generator=gen, dtype=getattr(torch, p.dtype))
        for k, p in SPEC.params.items()
    }
    return {"model": model, "extra": {"step": torch.tensor(float(seed))}}


def _mesh() -> bc.FakeMesh:
    return bc._Sim(SPEC, 1, 1, None).mesh(0)


def _lm() -> Mesh:
    return SPEC.layout_mesh(_mesh())


def _equal(a: dict, b: dict) -> list[str]:
    fa, _ = units._flat(a)
    fb, _ = units._flat(b)
    return [k for k in fa if not torch.equal(fa[k], fb[k])]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("ckpt") / "c")
    state = _state(1)
    ck.save(SPEC, state, path, mesh=_mesh())
    return path, state


def test_some_units_are_cut_in_runs(saved: tuple[str, dict]) -> None:
    _, state = saved
    flat, _ = units._flat(state)
    plan, _, _ = ck.canonical_plan(SPEC, _lm(), 0, flat, saving=False)
    assert any(u.runs is not None and len(u.runs[0][1]) > 1 for u in plan.units)


def test_load_helper_stages_the_chunks_as_read(saved: tuple[str, dict]) -> None:
    path, state = saved
    target = _state(2)
    planner = ck.load(SPEC, target, path, mesh=_mesh())
    assert planner.capture
    assert _equal(target, state) == []


def test_plain_dcp_load_through_per_read_buffers(saved: tuple[str, dict]) -> None:
    path, state = saved
    target = _state(3)
    planner = ck.ShardspecLoadPlanner(SPEC, _mesh())
    dcp.load(target, storage_reader=dcp.FileSystemReader(path), planner=planner)
    assert not planner.capture
    # No unit-sized buffers: whole units are read into the live tensors themselves.
    assert all(buf is planner.local[k][1] for k, buf in planner._buffers.items())
    assert _equal(target, state) == []


class _OwnReadData(dcp.FileSystemReader):
    """A reader with its own read_data: no sinks for it, staging buffers instead."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return super().read_data(plan, planner)


def test_other_readers_get_staging_buffers(saved: tuple[str, dict]) -> None:
    path, state = saved
    assert ck.reader_fills_sinks(dcp.FileSystemReader(path))
    assert not ck.reader_fills_sinks(_OwnReadData(path))
    target = _state(4)
    planner = ck.load(SPEC, target, path, mesh=_mesh(), storage_reader=_OwnReadData(path))
    assert not planner.capture
    assert _equal(target, state) == []


class _FailingReader(dcp.FileSystemReader):
    """Fails on the n-th stored chunk it opens (read_data itself is DCP's)."""

    def __init__(self, path: str, n: int) -> None:
        super().__init__(path)
        self.left = n

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self.left -= 1
        if self.left == 0:
            raise OSError("disk read error (injected)")
        return super()._slice_file(file, sinfo)


@pytest.mark.parametrize("n", [1, 7, 20])
def test_a_failed_read_changes_nothing(saved: tuple[str, dict], n: int) -> None:
    path, _ = saved
    target = _state(5)
    before = {k: v.clone() for k, v in units._flat(target)[0].items()}
    reader = _FailingReader(path, n)
    assert ck.reader_fills_sinks(reader)
    with pytest.raises(ck.CheckpointError, match="the model was not changed"):
        ck.load(SPEC, target, path, mesh=_mesh(), storage_reader=reader)
    after = units._flat(target)[0]
    assert [k for k in before if not torch.equal(before[k], after[k])] == []


def test_sink_refuses_anything_but_detach_and_copy() -> None:
    sink = staging._Sink((2, 3), torch.float32)
    assert sink.detach() is sink and sink.size() == (2, 3)
    src = torch.ones(4, 3).narrow(0, 1, 2)
    sink.copy_(src)
    assert sink.source is src
    with pytest.raises(ck.CheckpointError, match="unexpected"):
        sink.add_(1)


def _unit(shape: tuple[int, int], runs: tuple) -> Unit:
    sizes = list(shape)
    for dim, rr in runs:
        sizes[dim] = sum(n for _, n in rr)
    return Unit("k", "k", tuple(sizes), (0, 0), tuple(sizes), runs or None, (0,))


@pytest.mark.parametrize(
    "runs",
    [
        (),
        ((0, ((0, 2), (4, 2))),),
        ((1, ((1, 3),)),),
        ((0, ((0, 1), (3, 2), (6, 2))), (1, ((0, 2), (3, 1)))),
    ],
)
def test_box_commit_equals_whole_commit(runs: tuple) -> None:
    """Committing any boxes that tile the chunk equals committing the whole chunk."""
    local_shape = (8, 5)
    unit = _unit(local_shape, runs)
    chunk = torch.arange(float(unit.sizes[0] * unit.sizes[1])).reshape(unit.sizes)
    whole = torch.full(local_shape, -1.0)
    ck.unit_commit(unit, whole, chunk)
    assert torch.equal(ck.unit_data(unit, whole), chunk)
    for cut0, cut1 in itertools.product(range(1, unit.sizes[0] + 1), range(1, unit.sizes[1] + 1)):
        boxed = torch.full(local_shape, -1.0)
        for o0 in range(0, unit.sizes[0], cut0):
            for o1 in range(0, unit.sizes[1], cut1):
                n0, n1 = min(cut0, unit.sizes[0] - o0), min(cut1, unit.sizes[1] - o1)
                data = chunk[o0 : o0 + n0, o1 : o1 + n1]
                ck.unit_commit_box(unit, boxed, (o0, o1), (n0, n1), data)
        assert torch.equal(boxed, whole), (cut0, cut1)


class _FailsAfterReading(dcp.FileSystemReader):
    """Reads every item (tensors and pickled objects alike), then fails."""

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        super().read_data(plan, planner).wait()
        raise OSError("the storage failed after the last read (injected)")


def test_a_failed_load_leaves_non_tensor_entries_too(tmp_path: Path) -> None:
    """Non-tensor entries (a learning rate in a param group) were set in the state dict as
    they were read, so a load that failed afterwards changed them."""
    path = str(tmp_path / "c")
    state = _state(1)
    state["extra"]["groups"] = [{"lr": 0.1, "betas": (0.9, 0.95)}]  # stored pickled
    ck.save(SPEC, state, path, mesh=_mesh())
    target = _state(6)
    target["extra"]["groups"] = [{"lr": 0.6, "betas": (0.5, 0.5)}]
    before = {k: v.clone() for k, v in units._flat(target)[0].items() if torch.is_tensor(v)}
    with pytest.raises(ck.CheckpointError, match="the model was not changed"):
        ck.load(SPEC, target, path, mesh=_mesh(), storage_reader=_FailsAfterReading(path))
    assert target["extra"]["groups"] == [{"lr": 0.6, "betas": (0.5, 0.5)}]
    after = units._flat(target)[0]
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    # and a load that succeeds sets them
    ck.load(SPEC, target, path, mesh=_mesh())
    assert target["extra"]["groups"] == [{"lr": 0.1, "betas": (0.9, 0.95)}]
