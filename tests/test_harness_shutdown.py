"""Issue 8: the rank harness's teardown leaves no gloo thread behind, so ranks exit cleanly.

Gloo threads outlived ``destroy_process_group()`` because meshes stayed referenced (DTensor's
caches, ``CompiledSpec.last_mesh``, ``torch.distributed.nn.functional``'s defaults) and then
aborted a rank now and then during interpreter shutdown. One spawn of 4 ranks: each builds
a 2-D mesh, runs DTensor ops and keeps the references a trainer would; the harness's
teardown (which the ranks run through a hook) must then leave no gloo or TCPStore thread,
and every rank must exit with code 0 (``start_processes`` raises otherwise).
"""

from __future__ import annotations

import gc
import weakref

import pytest

from shardspec import testing
from shardspec.runtime.spec import CompiledSpec
from shardspec.testing import dist_threads, run_ranks

# Module level, as in a generated module: lives as long as the process.
SPEC = CompiledSpec(name="t", axes=("dp", "tp"), sizes={}, world=None, rules=(), params=None)


def _checked_release(report: dict) -> None:
    """The harness's teardown, plus what it must achieve, recorded for the parent."""
    report["threads_before_teardown"] = dist_threads()
    testing.release_distributed()
    report["mesh_alive_after_teardown"] = SPEC.last_mesh is not None
    report["threads_after_teardown"] = dist_threads()
    gc.collect()


def _ranks(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    # Pinned the world group when first imported after init_process_group (as
    # torch._dynamo does); the harness imports it first.
    import torch.distributed.nn.functional
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    report: dict = {}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    SPEC.last_mesh = mesh
    report["last_mesh_is_mesh"] = SPEC.last_mesh is mesh
    full = torch.arange(64.0).reshape(8, 8)
    d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    e = (d * 2 + 1).redistribute(mesh, [Replicate(), Shard(0)])
    report["full_ok"] = bool(torch.equal(e.full_tensor(), full * 2 + 1))
    tp = mesh["tp"]
    t = distribute_tensor(full, tp, [Shard(0)])
    report["matmul_ok"] = bool(torch.allclose((t @ t.T).full_tensor(), full @ full.T))
    s = (d.sum(dim=0) + 0).redistribute(mesh, [Replicate(), Replicate()])
    report["sum_ok"] = bool(torch.equal(s.to_local(), full.sum(dim=0)))
    dist.barrier()
    report["threads_in_use"] = dist_threads()

    # The spec and DTensor's caches still refer to the mesh; the trainer's locals go.
    wmesh = weakref.ref(mesh)
    del mesh, tp, d, e, t, s
    gc.collect()
    report["mesh_cached_before_teardown"] = wmesh() is not None
    # Run the teardown here (the harness repeats it after this returns: a no-op by then),
    # so this rank can see its effect and report it.
    _checked_release(report)
    report["last_mesh_after_teardown"] = SPEC.last_mesh
    return report


@pytest.mark.dist
def test_rank_harness_leaves_no_gloo_threads() -> None:
    # start_processes raises ProcessExitedException for any rank that does not exit with 0
    # (a SIGABRT at shutdown included), so returning at all means every rank exited cleanly.
    # Spawned ranks: each runs interpreter shutdown (a forked rank leaves with os._exit).
    reports = run_ranks(_ranks, 4, timeout=120, start_method="spawn")
    assert len(reports) == 4
    for rank, r in enumerate(reports):
        assert r["last_mesh_is_mesh"], rank
        assert r["full_ok"] and r["matmul_ok"] and r["sum_ok"], (rank, r)
        # The check below is only meaningful if gloo threads ran and something cached the
        # mesh past the trainer's own references.
        assert any("gloo" in n for n in r["threads_in_use"]), (rank, r["threads_in_use"])
        assert r["mesh_cached_before_teardown"], rank
        assert any("gloo" in n for n in r["threads_before_teardown"]), rank
        assert r["threads_after_teardown"] == [], (rank, r["threads_after_teardown"])
        assert not r["mesh_alive_after_teardown"], rank
        assert r["last_mesh_after_teardown"] is None, rank


def _leaky(rank: int, world: int) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    LEAK.append(init_device_mesh("cpu", (world,)))  # a global the harness cannot release
    dist.barrier()
    return "done"


LEAK: list = []


@pytest.mark.dist
def test_rank_harness_reports_a_leaked_mesh() -> None:
    # A mesh kept in a global keeps its gloo threads: the harness names them as the rank's
    # failure (deterministically) instead of letting the rank crash at exit now and then.
    with pytest.raises(RuntimeError, match=r"thread\(s\) still running.*gloo") as info:
        run_ranks(_leaky, 2, timeout=60)
    assert "rank 0:" in str(info.value) and "rank 1:" in str(info.value)


def _rank_settings(rank: int, world: int) -> tuple[int, int]:
    import torch

    return torch.get_num_threads(), gc.get_freeze_count()


@pytest.mark.dist
def test_forked_ranks_run_one_thread_and_leave_the_preload_to_no_collection() -> None:
    # Ranks outnumber cores in the tests: each rank's OpenMP team spun on cores its peers
    # held, and every full collection walked the ~360k objects the fork server imported.
    for threads, frozen in run_ranks(_rank_settings, 2, timeout=60, start_method="forkserver"):
        assert threads == 1
        assert frozen > 100_000  # torch and transformers' modules, as the fork server had them
