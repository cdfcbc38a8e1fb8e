"""Soak test of the rank harness's shutdown (issue 8): run it many times, each time in a
fresh Python process, and count the runs that did not exit cleanly.

    python -m bench.soak_harness --runs 50 [--world 4] [--workload dtensor|demo]

``dtensor`` (the default): one :func:`shardspec.testing.run_ranks` spawn whose ranks
distribute the example models with their generated modules (``examples/demo.py``'s
``run``, which leaves each spec's ``last_mesh`` set), then build a 2-D DeviceMesh and run
DTensor ops (distribute_tensor, redistribute, a matmul, full_tensor) on it. ``demo``: the
whole ``python examples/demo.py --world N`` (its HF load/export spawn included; needs
transformers and ``shardspec compile`` run first). A run is abnormal when its process
exits non-zero (the harness raises for a rank killed by a signal, and for a rank left
with torch.distributed threads after teardown) or its output says ``terminate called``.

The abort itself is rare, so the ``dtensor`` workload also reports its precondition: each
rank counts, at interpreter exit (atexit, after the harness's teardown), the gloo and
TCPStore threads still alive.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CRASH_MARKERS = ("terminate called", "SIGABRT", "core dumped")
EXIT_MARKER = "[threads at exit]"


def _dist_threads() -> list[str]:
    """This process's torch.distributed background threads (gloo, TCPStore), by name."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    return sorted(n for n in names if "gloo" in n or "tcpstore" in n)


def _report_at_exit(rank: int) -> None:
    # Runs at interpreter exit, after the harness's teardown: threads still alive here are
    # the ones that abort the rank when interpreter shutdown destroys their groups.
    threads = _dist_threads()
    print(f"{EXIT_MARKER} rank {rank}: {len(threads)} {' '.join(threads)}", flush=True)


def dtensor_work(rank: int, world: int) -> int:
    """The ``dtensor`` workload, on one rank; returns how many parameters were distributed."""
    import atexit

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from examples import demo

    atexit.register(_report_at_exit, rank)
    lines = demo.run(rank, world)
    full = torch.arange(64.0).reshape(8, 8)
    if world % 2 == 0:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        d = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
        e = (d * 2 + 1).redistribute(mesh, [Replicate(), Shard(0)])
        tp = mesh["tp"]
        t = distribute_tensor(full, tp, [Shard(0)])
        ok = torch.equal(e.full_tensor(), full * 2 + 1)
        ok &= torch.allclose((t @ t.T).full_tensor(), full @ full.T)
        if not ok:
            raise AssertionError(f"rank {rank}: wrong DTensor result")
    return sum(line.startswith("  ") for line in lines)


def _once(world: int) -> None:
    from bench.soak_harness import dtensor_work as work  # by module name, not __main__
    from shardspec.testing import run_ranks

    counts = run_ranks(work, world)
    print(f"ranks {world}, DTensor parameters per rank {counts}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--workload", choices=("dtensor", "demo"), default="dtensor")
    ap.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # one run, here
    ap.add_argument("--log", help="also write each run's output to this file")
    args = ap.parse_args()
    if args.once:
        _once(args.world)
        return 0
    if args.workload == "demo":
        cmd = [sys.executable, "examples/demo.py", "--world", str(args.world)]
    else:
        cmd = [sys.executable, "-m", "bench.soak_harness", "--once", "--world", str(args.world)]
    log = open(args.log, "w") if args.log else None  # closed below
    abnormal: list[str] = []
    lingering = 0  # runs where some rank still had torch.distributed threads at exit
    times = []
    for i in range(1, args.runs + 1):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        times.append(time.perf_counter() - t0)
        out = proc.stdout + proc.stderr
        crashed = [m for m in CRASH_MARKERS if m in out]
        alive = [int(n) for n in re.findall(re.escape(EXIT_MARKER) + r" rank \d+: (\d+)", out)]
        if any(alive):
            lingering += 1
        status = "ok" if proc.returncode == 0 and not crashed else "ABNORMAL"
        if status != "ok":
            abnormal.append(f"run {i}: exit code {proc.returncode}, markers {crashed}")
        took = times[-1]
        at_exit = f", threads at exit per rank {alive}" if alive else ""
        print(f"run {i:3}/{args.runs}: {status} exit {proc.returncode} {took:.1f}s{at_exit}")
        sys.stdout.flush()
        if log:
            log.write(f"===== run {i}: {status} exit {proc.returncode}\n{out}\n")
            log.flush()
    if log:
        log.close()
    print(
        f"{args.runs - len(abnormal)}/{args.runs} runs clean, {len(abnormal)} abnormal "
        f"(workload {args.workload}, {args.world} ranks; {min(times):.1f}-{max(times):.1f}s "
        f"per run, {sum(times):.0f}s in all)"
    )
    if args.workload == "dtensor":
        print(
            f"{lingering}/{args.runs} runs had a rank with torch.distributed threads still "
            "alive at interpreter exit (the precondition of the issue 8 abort)"
        )
    for line in abnormal:
        print("  " + line)
    return 1 if abnormal else 0


if __name__ == "__main__":
    sys.exit(main())
