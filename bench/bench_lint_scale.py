"""Lint time against the world size: the layout checks sample the mesh (one rank per box of
ranks that hold alike, ``shardspec.core.layout.sample_boxes``) instead of walking every rank.

Lints every example spec (``specs/*.shard``) in this process at each world size
(``-D world=N``: the ``*`` axis, usually ``dp_shard``, takes the rest), with the layout
caches cleared before each run. ``walk`` is the same lint with ``sample_boxes`` replaced by
one box per rank: what the checks cost when they visited every rank (as before sampling),
measured in the same run up to ``--walk-max`` ranks.

    python -m bench.bench_lint_scale [--rounds 3] [--walk-max 65536] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import glob
import itertools
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from shardspec import api
from shardspec.core import layout as L

WORLDS = (64, 1024, 16384, 65536, 1 << 20)


_CACHED = (L.sample_boxes, L.sampled_table, L.representable, L.rank_table)


def _clear() -> None:
    for fn in _CACHED:
        fn.cache_clear()


@contextmanager
def walking() -> Iterator[None]:
    """Every rank its own box: the checks visit every rank."""
    real = L.sample_boxes

    def every_rank(layouts: tuple, mesh: L.Mesh) -> tuple[L.Box, ...]:
        return tuple(
            L.Box(c, tuple(x + 1 for x in c))
            for c in itertools.product(*(range(s) for s in mesh.sizes))
        )

    L.sample_boxes = every_rank  # type: ignore[assignment]
    try:
        yield
    finally:
        L.sample_boxes = real  # type: ignore[assignment]


def lint_once(paths: list[str], world: int) -> tuple[tuple[float, float], list[str]]:
    """(CPU, wall) seconds for one lint of ``paths`` at ``world``, and the findings (code,
    place, message and hint of each). CPU time is the figure to read on a shared machine."""
    _clear()
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    _results, outcome = api.lint_specs(paths, world=world)
    took = (time.process_time() - cpu, time.perf_counter() - start)
    return took, [f"{d.code} {d.span} {d.message} {d.hint}" for d in outcome.diagnostics]


def run(paths: list[str], worlds: tuple[int, ...], rounds: int, walk_max: int) -> list[dict]:
    rows = []
    for world in worlds:
        modes = ["sampled"] + (["walk"] if world <= walk_max else [])
        times: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
        findings: dict[str, list[str]] = {}
        for _ in range(rounds):
            for mode in modes:  # alternating, so load changes hit both alike
                if mode == "walk":
                    with walking():
                        t, n = lint_once(paths, world)
                else:
                    t, n = lint_once(paths, world)
                times[mode].append(t)
                findings[mode] = n
        if findings.get("walk", findings["sampled"]) != findings["sampled"]:
            raise SystemExit(f"world {world}: the sampled and the walking lint disagree")
        rows.append({"world": world, "times": times, "findings": len(findings["sampled"])})
    return rows


def report(rows: list[dict], paths: list[str], rounds: int) -> str:
    base = min(c for c, _ in rows[0]["times"]["sampled"])
    out = [
        f"Command: `python -m bench.bench_lint_scale {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python "
        f"{platform.python_version()}; 1-minute load average {os.getloadavg()[0]:.1f} after  ",
        f"Specs: {len(paths)} ({', '.join(os.path.basename(p) for p in paths)}); in-process "
        f"`api.lint_specs`, layout caches cleared before each run; best of {rounds}  ",
        "",
        "| world | findings | sampled CPU | vs sampled at 64 | sampled wall | walk CPU | "
        "sampled vs walk (CPU) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        cpu = min(c for c, _ in r["times"]["sampled"])
        wall = min(w for _, w in r["times"]["sampled"])
        walk = r["times"].get("walk")
        walk_cpu = min(c for c, _ in walk) if walk else None
        out.append(
            f"| {r['world']:,} | {r['findings']} | {cpu * 1000:,.0f} ms | {cpu / base:.2f}x | "
            f"{wall * 1000:,.0f} ms | "
            + (f"{walk_cpu * 1000:,.0f} ms | {cpu / walk_cpu:.4f}x |" if walk_cpu else "- | - |")
        )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_lint_scale", description=__doc__)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--walk-max", type=int, default=65536)
    ap.add_argument("--worlds", type=int, nargs="*", default=list(WORLDS))
    ap.add_argument("--specs", nargs="*", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    paths = args.specs or sorted(glob.glob("specs/*.shard"))
    rows = run(paths, tuple(args.worlds), args.rounds, args.walk_max)
    print(report(rows, paths, args.rounds))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
