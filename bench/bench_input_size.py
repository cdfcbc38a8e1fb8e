"""Lint time and peak memory against the input's size, on the three inputs of issue 20's
point 6, each linted by ``python -m shardspec lint`` in a fresh process:

* ``name``: a spec whose one rule's pattern is a 50 MB identifier (with a real manifest);
* ``rules``: a valid spec of 510,000 rules (about 50 MB; no manifest, so lint warns SS061
  and runs every check that needs none);
* ``manifest``: the synthetic DeepSeek-V3-like spec of ``bench/synth.py`` with its
  1,000,000-parameter manifest (about 125 MB).

For each: exit status, wall and CPU seconds, the process's peak RSS (``ru_maxrss``), that
peak over the input's size, and the bytes of output. ``floor`` is the peak RSS of linting a
one-line spec (Python, lark, pydantic: what any lint costs), reported so that the growth
with the input can be read apart from it.

``--stages`` adds, for the rules and manifest inputs, where the time and memory go: the
lint's stages run one by one in a fresh process (reading the spec, parsing it, loading the
manifest, checking), each with its CPU seconds and the process's RSS and peak RSS after it
(``VmRSS``, ``VmHWM``).

``--baseline DIR`` runs the same inputs with the ``shardspec`` package of another checkout
(``git worktree add /tmp/base <commit>`` or ``git archive <commit> | tar -x -C DIR``) in the
same run, and reports this checkout against it. ``--scale 0.1`` makes every input ten times
smaller.

    python -m bench.bench_input_size [--scale 1] [--cases name,rules,manifest]
        [--baseline DIR] [--timeout 900] [--json PATH] [--stages]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import synth

REPO = Path(__file__).resolve().parents[1]
MB = 1_000_000

# One rule, about 100 bytes, of several kinds (a rule per module, as a generator writes).
_BODIES = (
    ("[ffn, hidden]", "{\n    shard ffn over tp\n}"),
    ("[ffn, hidden]", "{\n    fuse ffn as gate, up\n    shard ffn over tp\n}"),
    ("[heads, hidden]", "{\n    heads heads 128\n    shard heads over tp\n}"),
    ("[hidden, ffn]", "{\n    shard ffn over tp\n    style rowwise\n}"),
    ("[dim]", "replicate"),
)
_MODULES = ("mlp.experts.{e}.gate_up_proj", "self_attn.q_proj", "mlp.experts.{e}.down_proj")


def rules_text(n: int) -> str:
    """A valid spec of ``n`` rules, each naming one module's weight."""
    out = ["mesh over 64 ranks {\n    dp_shard: *\n    tp: 2\n}\nfsdp dp_shard\n"]
    for i in range(n):
        dims, body = _BODIES[i % len(_BODIES)]
        module = _MODULES[i % len(_MODULES)].format(e=i // 7 % 256)
        out.append(f"param model.layers.{i // 1792}.{module}.w{i % 7}.weight {dims} {body}\n")
    return "".join(out)


def name_text(size: int) -> str:
    """A spec whose second rule's pattern is ``size`` characters long."""
    return (
        'manifest "m.json"\nmesh over 8 ranks { dp: * }\nparam ** [a, b] {}\n'
        f"param {'a' * size} [a] {{}}\n"
    )


@dataclass
class Run:
    case: str
    tree: str  # "this" or "baseline"
    input_bytes: int
    status: int | None  # None: timed out
    wall_s: float
    cpu_s: float
    peak_rss_mb: float
    output_bytes: int


def make_inputs(root: Path, scale: float, cases: list[str]) -> dict[str, tuple[Path, int]]:
    """The spec to lint for each case, and the bytes of input it reads."""
    out: dict[str, tuple[Path, int]] = {}
    small = root / "floor.shard"
    small.write_text("mesh over 8 ranks { dp: * }\nparam ** replicate\n", encoding="utf-8")
    out["floor"] = (small, small.stat().st_size)
    if "name" in cases:
        d = root / "name"
        d.mkdir()
        shutil.copy(REPO / "specs" / "llama.manifest.json", d / "m.json")
        (d / "s.shard").write_text(name_text(int(50 * MB * scale)), encoding="utf-8")
        size = (d / "s.shard").stat().st_size + (d / "m.json").stat().st_size
        out["name"] = (d / "s.shard", size)
    if "rules" in cases:
        d = root / "rules"
        d.mkdir()
        (d / "s.shard").write_text(rules_text(int(510_000 * scale)), encoding="utf-8")
        out["rules"] = (d / "s.shard", (d / "s.shard").stat().st_size)
    if "manifest" in cases:
        spec = synth.write(synth.config_for(int(1_000_000 * scale)), root / "manifest")
        size = spec.stat().st_size + (spec.parent / "moe.manifest.json").stat().st_size
        out["manifest"] = (spec, size)
    return out


def make_inputs_apart(root: Path, scale: float, cases: list[str]) -> dict[str, tuple[Path, int]]:
    """:func:`make_inputs` in a process of its own. A child's peak RSS counts the parent's
    at fork (Linux keeps the larger of the two across exec): this process must stay small,
    so it never holds the inputs it writes."""
    argv = [sys.executable, "-m", "bench.bench_input_size", "--make-inputs", str(root)]
    argv += ["--scale", str(scale), "--cases", ",".join(cases)]
    made = subprocess.run(argv, capture_output=True, text=True, check=True, cwd=REPO).stdout
    return {case: (Path(path), size) for case, (path, size) in json.loads(made).items()}


def lint_once(spec: Path, src: Path, timeout: float) -> tuple[int | None, float, float, float, int]:
    """(status, wall s, CPU s, peak RSS MB, output bytes) of ``shardspec lint spec`` run
    with the package of checkout ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    with tempfile.TemporaryFile() as sink:
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardspec", "lint", str(spec)],
            stdout=sink,
            stderr=sink,
            env=env,
            cwd=spec.parent,
        )
        deadline = start + timeout
        status: int | None = None
        while True:
            pid, raw, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(raw)
                break
            if time.perf_counter() > deadline:
                proc.kill()
                _, _, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        wall = time.perf_counter() - start
        sink.seek(0, os.SEEK_END)
        written = sink.tell()
    proc.returncode = status if status is not None else -9  # reaped by wait4 above
    return status, wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, written


def _memory() -> tuple[float, float]:
    """This process's RSS and peak RSS, MB (Linux's /proc/self/status)."""
    fields = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1024
    return fields["VmRSS"], fields["VmHWM"]


def stage_child(spec: Path) -> list[tuple[str, float, float, float]]:
    """Lint ``spec`` a stage at a time, in this process: (stage, CPU s, RSS MB, peak RSS
    MB) after each. The shardspec package is whatever PYTHONPATH gives."""
    from shardspec.checks.run import check
    from shardspec.frontend.parse import parse
    from shardspec.frontend.textfile import read_text
    from shardspec.inputs.manifest import load_manifest

    out: list[tuple[str, float, float, float]] = []

    def stage(name: str, fn: Callable[[], Any]) -> Any:
        start = time.process_time()
        got = fn()
        out.append((name, time.process_time() - start, *_memory()))
        return got

    parse("param x replicate", "warm.shard")  # lark's tables: part of the floor
    out.append(("start", 0.0, *_memory()))
    text = stage("read the spec", lambda: read_text(spec))
    ir, _ = stage("parse", lambda: parse(text, str(spec)))
    assert ir is not None, "the benchmark's specs parse"
    manifest = None
    if ir.manifest is not None:
        manifest = stage("load the manifest", lambda: load_manifest(spec.parent / ir.manifest))
    stage("check", lambda: check(ir, manifest=manifest, use_manifest=False))
    return out


def stages(inputs: dict[str, tuple[Path, int]], trees: dict[str, Path]) -> list[str]:
    """The report's table of :func:`stage_child` per input (rules, manifest) and tree."""
    lines = [
        "",
        "| input | tree | stage | CPU | RSS after | peak RSS after |",
        "|---|---|---|---:|---:|---:|",
    ]
    for case in ("rules", "manifest"):
        if case not in inputs:
            continue
        spec = inputs[case][0]
        for tree, src in trees.items():
            argv = [sys.executable, "-m", "bench.bench_input_size", "--stage-child", str(spec)]
            # run from the tree itself: `python -m` puts the working directory first on the
            # path, ahead of PYTHONPATH (from REPO, every tree's stages were this one's)
            env = {**os.environ, "PYTHONPATH": str(src)}
            done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=src)
            if done.returncode != 0:
                lines.append(f"| {case} | {tree} | failed: {done.stderr.strip()[-200:]} | | | |")
                continue
            for name, cpu, rss, peak in json.loads(done.stdout):
                lines.append(
                    f"| {case} | {tree} | {name} | {cpu:.1f} s | {rss:,.0f} MB | {peak:,.0f} MB |"
                )
    return lines


def run(
    inputs: dict[str, tuple[Path, int]], trees: dict[str, Path], rounds: int, timeout: float
) -> list[Run]:
    out = []
    for case, (spec, size) in inputs.items():
        for tree, src in trees.items():
            best: Run | None = None
            for _ in range(rounds if case == "floor" else 1):
                status, wall, cpu, rss, written = lint_once(spec, src, timeout)
                r = Run(case, tree, size, status, wall, cpu, rss, written)
                best = r if best is None or r.peak_rss_mb < best.peak_rss_mb else best
            assert best is not None
            out.append(best)
            print(f"  {case:8} {tree:8} {_row(best)}", file=sys.stderr, flush=True)
    return out


def _row(r: Run) -> str:
    status = "timed out" if r.status is None else f"exit {r.status}"
    return f"{status}, {r.wall_s:.1f} s, CPU {r.cpu_s:.1f} s, {r.peak_rss_mb:,.0f} MB"


def report(runs: list[Run], trees: dict[str, Path], args: argparse.Namespace) -> str:
    floor = {r.tree: r.peak_rss_mb for r in runs if r.case == "floor"}
    lines = [
        f"Command: `python -m bench.bench_input_size {' '.join(sys.argv[1:])}`".rstrip() + "  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python "
        f"{platform.python_version()}; 1-minute load average {os.getloadavg()[0]:.1f} after  ",
        "Trees: " + ", ".join(f"{t} = {p}" for t, p in trees.items()) + "  ",
        "Floor (peak RSS of linting a one-line spec): "
        + ", ".join(f"{t} {mb:,.0f} MB" for t, mb in floor.items()),
        "",
        "| input | size | tree | exit | wall | CPU | peak RSS | RSS / size | "
        "(RSS - floor) / size | output |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in runs:
        if r.case == "floor":
            continue
        status = "timeout" if r.status is None else str(r.status)
        above = (r.peak_rss_mb - floor[r.tree]) * MB / r.input_bytes
        lines.append(
            f"| {r.case} | {r.input_bytes / MB:,.1f} MB | {r.tree} | {status} | "
            f"{r.wall_s:,.1f} s | {r.cpu_s:,.1f} s | {r.peak_rss_mb:,.0f} MB | "
            f"{r.peak_rss_mb * MB / r.input_bytes:.1f}x | {above:.1f}x | "
            f"{r.output_bytes:,} B |"
        )
    if "baseline" in trees:
        lines += ["", "| input | CPU this / baseline | peak RSS this / baseline |"]
        lines.append("|---|---:|---:|")
        by = {(r.case, r.tree): r for r in runs}
        for case in dict.fromkeys(r.case for r in runs if r.case != "floor"):
            a, b = by[(case, "this")], by[(case, "baseline")]
            cpu = f"{a.cpu_s / b.cpu_s:.2f}x"
            if b.status is None:
                cpu += " (baseline timed out)"
            lines.append(f"| {case} | {cpu} | {a.peak_rss_mb / b.peak_rss_mb:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_input_size", description=__doc__)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--cases", default="name,rules,manifest")
    ap.add_argument("--baseline", default=None, metavar="DIR")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the floor (best kept)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--stages", action="store_true", help="time and memory per stage too")
    ap.add_argument("--make-inputs", default=None, metavar="DIR", help=argparse.SUPPRESS)
    ap.add_argument("--stage-child", default=None, metavar="SPEC", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    if args.make_inputs:  # the child of make_inputs_apart
        made = make_inputs(Path(args.make_inputs), args.scale, cases)
        print(json.dumps({case: (str(path), size) for case, (path, size) in made.items()}))
        return 0
    if args.stage_child:  # the child of stages
        print(json.dumps(stage_child(Path(args.stage_child))))
        return 0
    trees = {"this": REPO}
    if args.baseline:
        trees["baseline"] = Path(args.baseline).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        inputs = make_inputs_apart(Path(tmp), args.scale, cases)
        runs = run(inputs, trees, args.rounds, args.timeout)
        table = stages(inputs, trees) if args.stages else []
    print("\n".join([report(runs, trees, args), *table]))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in runs], indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
