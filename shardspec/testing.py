"""Helpers to run a function on N local torch.distributed ranks (gloo, CPU).

Used by the demo and the multi-rank tests: one spawn runs many scenarios, since a process
start costs seconds.

Each rank tears torch.distributed down completely before it exits (issue 8): gloo runs
background threads (``pt_gloo_runloop``, ``gloo_tcp_loop``) that are joined only when their
ProcessGroup is destroyed, and ``destroy_process_group()`` alone does not destroy a group
that something still references. A DeviceMesh holds its groups, and DTensor's caches hold
meshes, so the groups used to outlive the teardown and be destroyed during interpreter
shutdown instead, where a gloo thread could abort the rank (``terminate called without an
active exception``, then SIGABRT). :func:`release_distributed` drops those references;
the harness then checks that no such thread is left, and reports a rank that still has
one as failed (naming the threads) instead of letting it crash at exit, now and then.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

# Background threads of torch.distributed that must be gone once every process group is
# destroyed (gloo's worker and TCP loop threads, the TCPStore server's event loop).
DIST_THREAD_MARKERS = ("gloo", "tcpstore")


class Checks:
    """What a multi-rank scenario found: failures (``[tag] message``) and the number of
    checks made per tag, so a test can require a minimum (a scenario that checks nothing
    fails)."""

    def __init__(self) -> None:
        self.fail: list[str] = []
        self.count: dict[str, int] = {}

    def check(self, tag: str, ok: bool, msg: str) -> None:
        self.count[tag] = self.count.get(tag, 0) + 1
        if not ok:
            self.fail.append(f"[{tag}] {msg}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dist_threads() -> list[str]:
    """Names of this process's live torch.distributed background threads (Linux: read
    from ``/proc/self/task``; elsewhere always empty)."""
    names = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if any(m in name for m in DIST_THREAD_MARKERS):
            names.append(name)
    return sorted(names)


def _cache_clear(owner: object, name: str) -> None:
    fn = getattr(owner, name, None)
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()


def clear_dtensor_caches() -> None:
    """Empty DTensor's caches of sharding and redistribution decisions.

    Their keys and values hold DTensorSpecs, hence DeviceMeshes, hence (through each mesh's
    process-group registry) ProcessGroups: while they are filled, no mesh used by a DTensor
    op is ever freed. Private torch names, so each is looked up and skipped where absent
    (checked on torch 2.13; older releases lack some of them).
    """
    import sys

    import torch

    if "torch.distributed.tensor" not in sys.modules:  # never used: nothing cached
        return
    from torch.distributed.tensor import DTensor

    # The Python sharding-propagation caches (thread-local LRU caches: this thread's)...
    propagator = getattr(getattr(DTensor, "_op_dispatcher", None), "sharding_propagator", None)
    for name in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        _cache_clear(propagator, name)
    # ... and the C++ dispatch fast path's cache of the same decisions.
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear_native is not None:
        clear_native()
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    _cache_clear(redistribute, "_gen_transform_infos")
    # Planners are cached under a weak reference to their mesh, but hold it strongly.
    clear_planners = getattr(redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
    collective_utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    _cache_clear(getattr(collective_utils, "MeshTopoInfo", None), "build_from_mesh")


def release_distributed() -> None:
    """Destroy every process group and drop what keeps their gloo threads alive.

    ``destroy_process_group()`` unregisters the groups and shuts their backends down, but
    a gloo group's threads are joined only when the group object itself is freed: this
    empties DTensor's caches (:func:`clear_dtensor_caches`), so that meshes the caller no
    longer holds are freed with their groups, and collects reference cycles.
    """
    import gc

    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        clear_dtensor_caches()
        gc.collect()


def set_rank_env(rank: int, world: int, port: int) -> None:
    """The environment of CPU rank ``rank`` of ``world`` on ``127.0.0.1:port``: torch's
    rendezvous variables, and no GPU, so that code choosing a device (build_mesh) picks
    cpu + gloo."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable,
    args: tuple,
    outdir: str,
    timeout: float,
    env: dict[str, str] | None = None,
    forked: bool = False,
) -> None:
    import gc
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    if forked:
        # What the fork server imported (FORKSERVER_PRELOAD: some 360k objects with
        # transformers) stays for the life of the rank: keep it out of every garbage
        # collection. A full collection walks, and so writes to, every tracked object:
        # about 1 s per rank on 2 busy cores for each, and it copies the fork server's
        # shared pages into each rank. What ``fn`` makes is collected as before.
        gc.freeze()
        from torch import set_num_threads

        # One intra-op thread per rank: a test forks several ranks onto few cores (4 or 8
        # on 2 in CI), and each rank's OpenMP team of one thread per core spins waiting
        # for cores its peers hold (an index_add_ of a few KiB took ~80 ms so).
        set_num_threads(1)
    # The caller's environment, as it is now (a forked rank has its fork server's).
    if env is not None:
        os.environ.clear()
        os.environ.update(env)

    try:
        # Imported before the default group exists: its functions take
        # ``group=group.WORLD`` as a default argument, evaluated at import, so a first
        # import after init_process_group (torch._dynamo does one) would pin the world
        # group, and its gloo threads, for the life of the process.
        import torch.distributed.nn.functional  # noqa: F401
    except ImportError:  # a torch build without it: nothing to pin the group
        pass

    set_rank_env(rank, world, port)
    result: Any
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        # Every rank finishes connecting before any can run ahead and tear down: a rank
        # still in init_process_group fails ("Connection closed by peer") if a peer whose
        # ``fn`` needs no collective destroys its group meanwhile.
        dist.barrier()
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # report everything to the parent, including assertion errors
        result = ("error", traceback.format_exc())
    problem = None
    leftover: list[str] = []
    try:
        release_distributed()
        leftover = dist_threads()
        # A store's or group's thread that is already stopping can outlive the release by
        # a moment on a loaded machine (the TCPStore's uv loop joins asynchronously): give
        # it a few seconds before calling it a leak. A real leak stays.
        deadline = time.monotonic() + 5.0
        while leftover and time.monotonic() < deadline:
            time.sleep(0.05)
            leftover = dist_threads()
    except BaseException:
        problem = "tearing torch.distributed down failed:\n" + traceback.format_exc()
    if leftover:
        problem = (
            f"{len(leftover)} torch.distributed thread(s) still running after the harness "
            f"destroyed every process group: {', '.join(leftover)}. Something still "
            "references a DeviceMesh, a ProcessGroup or a DTensor (a global, a module-level "
            "cache, or a reference cycle that one garbage collection does not free, such as "
            "an exception kept in a local of a frame its traceback holds); such threads can "
            "abort the process at exit (SIGABRT, issue 8)."
        )
    if problem is not None:
        result = ("error", problem if result[0] == "ok" else f"{result[1]}\n{problem}")
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if leftover:
        # The leak is reported above. Skip interpreter shutdown: it would destroy the
        # leaked groups with their threads running and may abort the rank (issue 8), and
        # the parent would then raise for the signal instead of showing this report.
        os._exit(0)


# How run_ranks starts ranks unless told: "spawn" (a fresh interpreter per rank, as the
# benchmarks and the demo measure them), or "forkserver" (tests/conftest.py sets it for the
# test suite; see run_ranks).
DEFAULT_START_METHOD = "spawn"

# What the fork server imports once, before it forks any rank (run_ranks).
FORKSERVER_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
)


def run_ranks(
    fn: Callable,
    world: int,
    *args: Any,
    timeout: float = 300.0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be importable (module level). Ranks see no GPU. A collective that waits
    longer than ``timeout`` seconds (say, because another rank failed before joining it)
    fails instead of hanging. Raises ``RuntimeError`` with every failing rank's traceback if
    any rank fails.

    ``start_method`` (default :data:`DEFAULT_START_METHOD`): ``"spawn"`` runs each rank as
    a fresh interpreter that shuts down as usual; ``"forkserver"`` forks the ranks from
    multiprocessing's fork server, which imports torch (:data:`FORKSERVER_PRELOAD`) once per
    calling process and has run nothing in parallel (torch's thread pools are not fork-safe
    once used): a fresh interpreter importing torch on every rank of every call cost most of
    a short multi-rank test on 2 busy cores (the test suite forks). A forked rank also runs
    with one intra-op thread (ranks outnumber cores in the tests) and keeps what the fork
    server imported out of garbage collection (``gc.freeze``). Either way each rank
    gets the caller's current environment, working directory and ``sys.path``. A forked
    rank leaves with ``os._exit`` after its teardown, without interpreter shutdown
    (tests/test_harness_shutdown.py spawns, to prove the teardown against that shutdown).

    After ``fn`` returns, each rank destroys every process group (:func:`release_distributed`)
    and fails if a torch.distributed thread survives that (see the module docstring): ``fn``
    must not leave meshes, groups or DTensors in globals.
    """
    import multiprocessing
    import pickle

    import torch.multiprocessing as mp

    start_method = start_method or DEFAULT_START_METHOD
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _entry,
            args=(world, free_port(), fn, args, outdir, timeout, env, start_method != "spawn"),
            nprocs=world,
            join=True,
            start_method=start_method,
        )
        results = []
        errors = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}:\n{value}")
            results.append(value)
    if errors:
        raise RuntimeError("\n".join(errors))
    return results
