"""Asynchronous save: how long the training loop waits, against a synchronous save.

    python -m bench.bench_async_save                # ~1 GB state dict, 4 ranks, 3 rounds
    python -m bench.bench_async_save --rounds 5 --json /tmp/async.json

4 gloo CPU ranks (``shardspec.testing.run_ranks``), mesh dp_shard 2 x tp 2, the model of
``bench/bench_hf.py`` (``MODEL``: Llama-2's vocabulary, 6 layers of dim 1536, 255M
parameters, 1.02 GB fp32) distributed on the llama spec's layout (``bench_spec``), model
state only. Every round times, in alternating order, on a fresh folder each:

* ``sync``: ``save(state, path)`` (the generated planner, the atomic protocol, on the
  default group): the loop waits for all of it;
* ``async``: ``save(state, path, asynchronous=True)``: the loop waits for the call (plan
  this rank's part, copy what it writes to CPU memory); the rest runs in a background
  thread on the checkpoint group. Timed twice: the call (``blocking``) and until the
  future is done (``complete``), the loop idle meanwhile.

A time is the slowest rank's, between two barriers. "Paired" is the median over rounds of
the ratio within one round. Round 0 is untimed: warm-up (plans cached, the checkpoint
group created, pages touched), and a check that the asynchronous checkpoint, loaded into
zeroed tensors, equals the state at the call (the live tensors change right after the call
returns: each is incremented, so a save that read them late would differ).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.bench_checkpoint import _revision, bench_spec, build_state, logical_bytes, machine
from bench.bench_hf import MODEL

WORLD = 4
SIZES = {"tp": 2}  # dp_shard takes the rest
TARGET = 0.1  # async blocking / sync save time
OPS = ("sync", "async")


def _rank(rank: int, world: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist

    from shardspec.runtime import checkpoint as ck
    from shardspec.runtime import dtensor as rt

    torch.set_num_threads(1)
    spec = bench_spec(opts["model"])
    mesh = rt.build_mesh(spec, **opts["sizes"])
    state = {"model": build_state(spec, mesh, opts["model"], adam=False)["model"]}
    size = logical_bytes(state)
    tensors = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
    root = opts["workdir"]

    def slowest(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def run(op: str, path: str) -> dict[str, float]:
        dist.barrier()
        t0 = time.perf_counter()
        if op == "sync":
            ck.save(spec, state, path, mesh=mesh)
            out = {"blocking": time.perf_counter() - t0}
            out["complete"] = out["blocking"]
        else:
            future = ck.save(spec, state, path, mesh=mesh, asynchronous=True)
            out = {"blocking": time.perf_counter() - t0}
            future.result()
            out["complete"] = time.perf_counter() - t0
        return {k: slowest(v) for k, v in out.items()}

    times: dict[str, dict[str, list[float]]] = {op: {"blocking": [], "complete": []} for op in OPS}
    checks: list[str] = []
    for rnd in range(opts["rounds"] + 1):
        order = OPS if rnd % 2 == 0 else OPS[::-1]
        for op in order:
            path = os.path.join(root, f"{op}{rnd}")
            if rnd == 0 and op == "async":  # the check: a save that read late would differ
                at_call = [
                    t.to_local().clone() if hasattr(t, "to_local") else t.clone() for t in tensors
                ]
                future = ck.save(spec, state, path, mesh=mesh, asynchronous=True)
                with torch.no_grad():
                    for t in tensors:
                        t.add_(1.0)
                future.result()
                loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
                ck.load(spec, loaded, path, mesh=mesh)
                for (k, v), want in zip(loaded["model"].items(), at_call, strict=True):
                    got = v.to_local() if hasattr(v, "to_local") else v
                    if not torch.equal(got, want):
                        checks.append(k)
                with torch.no_grad():
                    for t in tensors:
                        t.sub_(1.0)
            else:
                took = run(op, path)
                if rnd > 0:
                    for k, v in took.items():
                        times[op][k].append(v)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    return {"times": times, "size": size, "checks": checks}


def run(
    model: dict[str, int] | None = None,
    *,
    rounds: int = 3,
    world: int = WORLD,
    sizes: dict[str, int] | None = None,
    workdir: str | None = None,
) -> dict:
    from shardspec.testing import run_ranks

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="shardspec-bench-async-")
    opts = dict(
        model=model if model is not None else MODEL,
        rounds=rounds,
        sizes=sizes if sizes is not None else SIZES,
        workdir=workdir,
    )
    try:
        per_rank = run_ranks(_rank, world, opts, timeout=900.0)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    first = per_rank[0]
    return dict(
        times=first["times"],  # already the slowest rank's
        size=first["size"],
        checks=sorted({k for r in per_rank for k in r["checks"]}),
        world=world,
        rounds=rounds,
        model=opts["model"],
    )


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def summary(res: dict) -> dict[str, float]:
    t = res["times"]
    sync, blocking, complete = t["sync"]["blocking"], t["async"]["blocking"], t["async"]["complete"]
    return {
        "paired_blocking": statistics.median(b / s for b, s in zip(blocking, sync, strict=True)),
        "paired_complete": statistics.median(c / s for c, s in zip(complete, sync, strict=True)),
    }


def report(res: dict) -> list[str]:
    t = res["times"]
    s = summary(res)
    rows = [
        ("synchronous `save`", t["sync"]["blocking"]),
        ("`save(asynchronous=True)`: the call (the loop waits)", t["async"]["blocking"]),
        ("`save(asynchronous=True)`: until the future is done", t["async"]["complete"]),
    ]
    lines = [
        f"State dict: {res['size'] / 1e9:.3f} GB (model {res['model']}), {res['world']} ranks; "
        f"{res['rounds']} timed rounds.",
        "",
        "| what | best | median | all rounds |",
        "|---|---:|---:|---|",
    ]
    for label, xs in rows:
        lines.append(
            f"| {label} | {_ms(min(xs))} | {_ms(statistics.median(xs))} | "
            + ", ".join(_ms(x) for x in xs)
            + " |"
        )
    lines += [
        "",
        f"Paired ratio, async call / sync save: {s['paired_blocking']:.3f}x (target <= "
        f"{TARGET}x: {'met' if s['paired_blocking'] <= TARGET else 'NOT met'}); until done / "
        f"sync save: {s['paired_complete']:.2f}x.",
        "Check: the asynchronous checkpoint loads equal to the state at the call, with the live "
        "tensors changed right after the call: "
        + ("all equal." if not res["checks"] else f"DIFFER: {res['checks'][:5]}"),
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (default 3)")
    ap.add_argument("--workdir", help="checkpoint folder (default: a new one under $TMPDIR)")
    ap.add_argument("--json", help="also write the raw results here")
    args = ap.parse_args(argv)
    args_text = argv if argv is not None else sys.argv[1:]
    started = time.time()
    load0 = os.getloadavg()[0]
    workdir = args.workdir or tempfile.mkdtemp(prefix="shardspec-bench-async-")
    res = run(rounds=args.rounds, workdir=workdir)
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    lines = [
        f"Command: `python -m bench.bench_async_save {' '.join(args_text)}`".rstrip() + "  ",
        f"Machine: {machine(workdir if args.workdir else tempfile.gettempdir())}  ",
        f"Date: {datetime.date.today().isoformat()}; code: {_revision()}  ",
        f"Load: 1-minute load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"whole run {time.time() - started:.0f} s  ",
        "",
        *report(res),
    ]
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1), encoding="utf-8")
    return 0 if not res["checks"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
