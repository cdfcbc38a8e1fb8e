"""Helpers to run a function on N local torch.distributed ranks (gloo, CPU).

Used by the demo and the multi-rank tests: one spawn runs many scenarios, since a process
start costs seconds.
"""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(
    rank: int, world: int, port: int, fn: Callable, args: tuple, outdir: str, timeout: float
) -> None:
    import pickle
    from datetime import timedelta

    import torch.distributed as dist

    # CPU ranks: hide GPUs so that code choosing a device (build_mesh) picks cpu + gloo.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    result: Any
    try:
        dist.init_process_group(
            "gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
        )
        result = ("ok", fn(rank, world, *args))
    except BaseException:  # report everything to the parent, including assertion errors
        result = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 300.0) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return each rank's result.

    ``fn`` must be importable (module level). Ranks see no GPU. A collective that waits
    longer than ``timeout`` seconds (say, because another rank failed before joining it)
    fails instead of hanging. Raises ``RuntimeError`` with every failing rank's traceback if
    any rank fails.
    """
    import pickle

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(
            _entry,
            args=(world, free_port(), fn, args, outdir, timeout),
            nprocs=world,
            join=True,
            start_method="spawn",
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
