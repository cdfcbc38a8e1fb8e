"""Wall time of ``shardspec lint`` and ``shardspec compile`` on synthetic MoE models.

    python -m bench.bench_compiler                     # 1k, 10k, 100k params, best of 5
    python -m bench.bench_compiler --sizes 10000 --repeat 9
    python -m bench.bench_compiler --stages            # also: time of each stage, in-process
    python -m bench.bench_compiler --profile 100000    # cProfile of one lint, top functions

Every timed run is a fresh subprocess, interpreter start included, of the ``shardspec``
script next to this Python (``python -m shardspec`` if there is none) on a spec and manifest
from :mod:`bench.synth` in a temporary folder, with bytecode cached there. Each command runs
once untimed (to warm the page cache and the bytecode cache), then ``--repeat`` rounds over
all commands, round-robin, so a change in machine load hits them alike; the tables show the
best and median wall time and the best CPU time. In the same run it times the fixed start-up
cost (``python -c pass``, importing the CLI, importing everything lint needs) and lint with
the garbage collector off, and checks that lint and compile import no torch.

The issue's targets: lint of the 10k manifest under 0.5 s wall, and cost growing linearly
or better (10x the parameters, at most ~10x the time). ``net`` columns subtract the cost of
``import shardspec.api`` (interpreter start plus every import lint makes), so their growth
is the growth of the work itself.

Extra rows time lint of the same spec with an ``hf { ... }`` block (:func:`bench.synth.
write_hf`: one identity map line per parameter template; every routed expert is a storage
unit under its global index, so 10k parameters are 76k units): without an HF manifest
(SS079 suppressed) at every size, and with one (every key, shape and config value checked)
at ``--hf-sizes`` (default 1k and 10k: the 100k model's HF manifest would be 0.8M keys,
about 90 MB). Target: the hf block adds at most about as much as the rest of lint, so lint
of the 10k spec with the block stays under 0.6 s wall.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench import synth

REPO = Path(__file__).resolve().parents[1]
LINT_TARGET_S = 0.5  # lint of the 10k manifest, wall, end to end
LINT_HF_TARGET_S = 0.6  # the same with the hf block (no HF manifest)
DEFAULT_SIZES = (1_000, 10_000, 100_000)
DEFAULT_HF_SIZES = (1_000, 10_000)  # sizes that also get the HF manifest rows


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("shardspec")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shardspec"]


_PYCACHE: list[str] = []  # set by run(): where children keep their bytecode


def _env() -> dict[str, str]:
    """The children's environment: this checkout importable, and bytecode cached (in a
    temporary folder, not the checkout) even where PYTHONDONTWRITEBYTECODE is set, as an
    installed package would have it."""
    env = dict(os.environ)
    if _PYCACHE:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = _PYCACHE[0]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


@dataclass
class Timing:
    label: str
    times: list[float]  # wall seconds
    cpu: list[float]  # user + system seconds of the child

    @property
    def cpu_best(self) -> float:
        return min(self.cpu)

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


# The same lint with the cyclic garbage collector off, to show what GC passes cost.
_NO_GC = [
    sys.executable,
    "-c",
    "import gc, sys; gc.disable(); from shardspec.cli import main; sys.exit(main(sys.argv[1:]))",
]


def _run_once(label: str, cmd: list[str], cwd: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of ``cmd`` as a fresh process; it must exit 0 and print nothing
    on stderr (lint and compile print findings there)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0 or p.stderr.strip():
        raise SystemExit(f"{label}: `{' '.join(cmd)}` exited {p.returncode}\n{p.stdout}{p.stderr}")
    return wall, r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime


def time_all(jobs: list[tuple[str, list[str]]], repeat: int, cwd: Path) -> dict[str, Timing]:
    """Time every job ``repeat`` times after one untimed warm-up each, round-robin, so that
    a change in machine load hits all jobs alike and their differences stay meaningful."""
    out = {label: Timing(label, [], []) for label, _ in jobs}
    for label, cmd in jobs:
        _run_once(label, cmd, cwd)
    for r in range(repeat):
        for label, cmd in jobs:
            wall, cpu = _run_once(label, cmd, cwd)
            out[label].times.append(wall)
            out[label].cpu.append(cpu)
        print(f"  round {r + 1}/{repeat} done", file=sys.stderr)
    return out


# ----------------------------------------------------------------------- in a child process

_IMPORT_CHECK = """
import json, sys
from shardspec.cli import main
rc = main(sys.argv[1:])
top = sorted({m.split(".")[0] for m in sys.modules if not m.startswith("_")}
             - set(sys.stdlib_module_names))
print(json.dumps({"rc": rc, "torch": "torch" in sys.modules, "third_party": top,
                  "modules": len(sys.modules)}))
"""


def imports_of(args: list[str], cwd: Path) -> dict:
    """Which third-party packages a whole ``shardspec ARGS`` run imports, in-process."""
    p = subprocess.run(
        [sys.executable, "-c", _IMPORT_CHECK, *args],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(p.stdout.strip().splitlines()[-1])


def import_times(module: str, cwd: Path) -> list[tuple[str, int]]:
    """``-X importtime`` of ``import module``: top-level imports, cumulative microseconds."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", f"import {module}"],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    out: dict[str, int] = {}
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _, cum, name = line[len("import time:") :].split("|")
        depth = (len(name) - len(name.lstrip(" "))) // 2
        if depth <= 1:  # what `import module` pulls in directly, and the module itself
            out[name.strip()] = max(out.get(name.strip(), 0), int(cum))
    return sorted(out.items(), key=lambda kv: -kv[1])


_STAGES = r"""
import json, sys, time
T = {}
t = time.process_time()
import shardspec.api  # noqa: F401  (every import lint makes)
T["import shardspec.api"] = time.process_time() - t
from pathlib import Path
from shardspec.resolve.params import params as R
from shardspec.checks import run as run_mod
from shardspec.checks.coverage import COVERAGE_CHECKS
from shardspec.checks.layouts import LAYOUT_CHECKS
from shardspec.checks.structure import STRUCTURE_CHECKS
from shardspec.inputs.load import manifest_path
from shardspec.inputs.manifest import ManifestFile, load_manifest
from shardspec.frontend.parse import parse_file

def timed(name, f, *a, **k):
    t = time.process_time()
    out = f(*a, **k)
    T[name] = time.process_time() - t
    return out

path = sys.argv[1]
spec, _ = timed("parse (lark grammar build included)", parse_file, path)
broken = set()
t = time.process_time()
for c in STRUCTURE_CHECKS:
    c(spec, broken)
T["structure checks"] = time.process_time() - t
mpath = manifest_path(spec)
manifest = timed("load_manifest (total)", load_manifest, mpath)
text = timed("  manifest: read text", Path(mpath).read_text, encoding="utf-8")
raw = timed("  manifest: json.loads", json.loads, text)
timed("  manifest: ManifestFile.model_validate", ManifestFile.model_validate, raw)
import shardspec.inputs.manifest as M
if hasattr(M, "entry_positions"):
    timed("  manifest: entry_positions", M.entry_positions, text)
res = timed("resolve: mesh, globs, rule specs", R.resolve, spec, None, broken=broken)
res.manifest = manifest
timed("resolve: _match_all", R._match_all, res)
timed("resolve: _layouts", R._layouts, res, res.mesh)
diags = []
for c in (*COVERAGE_CHECKS, *LAYOUT_CHECKS):
    diags += timed(f"{c.__module__.rsplit('.', 1)[-1]}.{c.__name__}", c, res)
timed("apply_suppressions", run_mod.apply_suppressions, spec, diags)
if "--render" in sys.argv:
    from shardspec.api import emit
    text = timed("render (emit)", emit, res, path, "generated.moe")
T["(findings)"] = len(diags)
print(json.dumps(T))
"""


def stage_times(spec: Path, cwd: Path, repeat: int = 3) -> dict[str, float]:
    """Seconds per pipeline stage, each the best of ``repeat`` fresh processes.

    Reaches into private functions (``resolve._match_all``, ``resolve._layouts``) to split
    ``check``; if they change, this reports why instead of a number.
    """
    runs = []
    for _ in range(repeat):
        p = subprocess.run(
            [sys.executable, "-c", _STAGES, str(spec), "--render"],
            cwd=cwd,
            env=_env(),
            capture_output=True,
            text=True,
        )
        if p.returncode != 0:
            return {"(stage split failed)": p.stderr.strip().splitlines()[-1]}  # type: ignore[dict-item]
        runs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    return {k: min(r[k] for r in runs) for k in runs[0]}


def profile(spec: Path, cwd: Path, top: int = 30) -> str:
    """cProfile of one in-process lint (imports included), sorted by own time."""
    code = (
        "import cProfile, gc, pstats, sys, io\n"
        "from shardspec.cli import main\n"
        "pr = cProfile.Profile(); pr.enable(); main(['lint', sys.argv[1]]); pr.disable()\n"
        "s = io.StringIO(); st = pstats.Stats(pr, stream=s).strip_dirs()\n"
        f"st.sort_stats('tottime').print_stats({top}); print(s.getvalue())\n"
        "print('gc collections per generation:', [g['collections'] for g in gc.get_stats()])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(spec)],
        cwd=cwd,
        env=_env(),
        capture_output=True,
        text=True,
        check=True,
    )
    return p.stdout


# ----------------------------------------------------------------------------- the report


def _ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "-"


def run(sizes: list[int], repeat: int, stages: bool, hf_sizes: list[int] | None = None) -> str:
    hf_sizes = list(DEFAULT_HF_SIZES) if hf_sizes is None else hf_sizes
    cli = _cli()
    lines: list[str] = []
    out = lines.append
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="shardspec-bench-") as tmp:
        tmpd = Path(tmp)
        _PYCACHE[:] = [str(tmpd / "pycache")]
        specs = {}
        hf_specs: dict[int, Path] = {}  # with the hf block, no HF manifest
        hfm_specs: dict[int, Path] = {}  # with the hf block and its HF manifest
        for n in sizes:
            cfg = synth.config_for(n)
            specs[n] = (cfg, synth.write(cfg, tmpd / f"n{n}"))
            hf_specs[n] = synth.write_hf(cfg, tmpd / f"n{n}", hf_manifest=False)
            if n in hf_sizes:
                hfm_specs[n] = synth.write_hf(cfg, tmpd / f"n{n}")

        base_jobs = [
            ("python -c pass", [sys.executable, "-c", "pass"]),
            ("python -c 'import shardspec.cli'", [sys.executable, "-c", "import shardspec.cli"]),
            ("python -c 'import shardspec.api'", [sys.executable, "-c", "import shardspec.api"]),
        ]
        jobs = list(base_jobs)
        for n in sizes:
            spec = specs[n][1]
            jobs += [
                (f"lint {n}", [*cli, "lint", str(spec)]),
                (f"compile {n}", [*cli, "compile", str(spec), "-o", str(tmpd / f"out{n}")]),
                (f"lint {n}, gc off", [*_NO_GC, "lint", str(spec)]),
                # Relative to the working directory: a suppression comment (this spec's
                # `ignore[SS079]`) applies only when the spec's path is shown as given.
                (f"lint {n} +hf", [*cli, "lint", str(hf_specs[n].relative_to(tmpd))]),
            ]
            if n in hfm_specs:
                jobs.append((f"lint {n} +hf +HF manifest", [*cli, "lint", str(hfm_specs[n])]))
        t = time_all(jobs, repeat, tmpd)
        timings = t
        hf_mb = {n: (hs.parent / "moe.hf.json").stat().st_size / 1e6 for n, hs in hfm_specs.items()}
        base = [t[label] for label, _ in base_jobs]
        fixed = base[2].best
        rows = []
        for n in sizes:
            cfg, spec = specs[n]
            size = (tmpd / f"out{n}" / "moe.py").stat().st_size
            mb = (spec.parent / "moe.manifest.json").stat().st_size / 1e6
            rows.append(
                (n, cfg, t[f"lint {n}"], t[f"compile {n}"], size, mb, t[f"lint {n}, gc off"])
            )

        first = specs[sizes[0]][1]
        imports = imports_of(["lint", str(first)], tmpd)
        cimports = imports_of(["compile", str(first), "-o", str(tmpd / "imports")], tmpd)
        itimes = import_times("shardspec.api", tmpd)
        stage_rows = {n: stage_times(specs[n][1], tmpd) for n in sizes} if stages else {}
    load_after = os.getloadavg()[0]

    py = sys.version.split()[0]
    out(f"Command: `python -m bench.bench_compiler {' '.join(sys.argv[1:])}`".rstrip() + "  ")
    out(
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python {py} "
        f"({platform.python_implementation()}), {platform.system()} {platform.release()}; "
        f"1-minute load average {load_before:.1f} before, {load_after:.1f} after  "
    )
    out(
        f"Runs: fresh processes, bytecode cached, 1 untimed warm-up then {repeat} timed "
        f"rounds over all commands; wall best and median, CPU (user + system) best; "
        f"CLI: `{cli[-1]}`  "
    )
    out("")
    out("Fixed start-up cost, measured in the same run (`import shardspec.api` is every")
    out("import lint makes; `net` below subtracts its best wall time):")
    out("")
    out("| command | wall best | wall median | CPU best |")
    out("|---|---:|---:|---:|")
    for t in base:
        out(f"| `{t.label}` | {_ms(t.best)} | {_ms(t.median)} | {_ms(t.cpu_best)} |")
    out("")
    out(
        "| params | manifest | lint best | lint median | lint CPU | compile best | "
        "compile median | compile CPU | lint per 1k params (net) | lint growth (net) | "
        "compile growth (net) |"
    )
    out("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    prev = None
    for _n, cfg, lint, comp, _size, mb, _ in rows:
        k = cfg.n_params / 1000
        if prev is None:
            growth = cgrowth = "-"
        else:
            growth = (
                f"{_ratio(lint.best, prev[0].best)} "
                f"({_ratio(lint.best - fixed, prev[0].best - fixed)})"
            )
            cgrowth = (
                f"{_ratio(comp.best, prev[1].best)} "
                f"({_ratio(comp.best - fixed, prev[1].best - fixed)})"
            )
        out(
            f"| {cfg.n_params:,} | {mb:.1f} MB | {_ms(lint.best)} | {_ms(lint.median)} "
            f"| {_ms(lint.cpu_best)} | {_ms(comp.best)} | {_ms(comp.median)} "
            f"| {_ms(comp.cpu_best)} | {_ms(lint.best / k)} ({_ms((lint.best - fixed) / k)}) "
            f"| {growth} | {cgrowth} |"
        )
        prev = (lint, comp)
    out("")
    out(
        "Lint with the garbage collector off (`gc.disable()` before `shardspec.cli.main`), "
        "wall best: "
        + ", ".join(f"{r[1].n_params:,}: {_ms(r[6].best)} (CPU {_ms(r[6].cpu_best)})" for r in rows)
        + "."
    )
    out("")
    models = "; ".join(
        f"{r[1].n_params:,}: {r[1].layers} layers ({r[1].moe_layers} MoE x "
        f"{r[1].experts_per_rank} experts per EP rank), module {r[4] / 1e6:.1f} MB"
        for r in rows
    )
    out(f"Models (bench/synth.py, mesh dp_shard x ep x tp over {rows[0][1].world}): {models}.")
    out("")
    out("With an `hf { ... }` block (bench/synth.py `write_hf`: identity map lines, one per")
    out("parameter template; `hf adds` is the best wall time over the same spec without it):")
    out("")
    out(
        "| params | storage units | lint | lint +hf best | +hf median | +hf CPU | hf adds "
        "| +hf growth (net) | +hf +HF manifest best | median | CPU | HF manifest |"
    )
    out("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    prev_hf = None
    for n, cfg, lint, *_ in rows:
        h = timings[f"lint {n} +hf"]
        growth = (
            "-"
            if prev_hf is None
            else f"{_ratio(h.best, prev_hf.best)} ({_ratio(h.best - fixed, prev_hf.best - fixed)})"
        )
        prev_hf = h
        full = timings.get(f"lint {n} +hf +HF manifest")
        if full is not None:
            hf_cells = (
                f"{_ms(full.best)} | {_ms(full.median)} | {_ms(full.cpu_best)} | {hf_mb[n]:.1f} MB"
            )
        else:
            hf_cells = "- | - | - | -"
        out(
            f"| {cfg.n_params:,} | {cfg.n_units:,} | {_ms(lint.best)} | {_ms(h.best)} "
            f"| {_ms(h.median)} | {_ms(h.cpu_best)} | {_ms(h.best - lint.best)} | {growth} "
            f"| {hf_cells} |"
        )
    out("")
    ten = [r for r in rows if r[0] == 10_000]
    if ten:
        best = ten[0][2].best
        verdict = "met" if best < LINT_TARGET_S else "MISSED"
        out(f"Target lint(10k) < {LINT_TARGET_S} s wall: {verdict} ({_ms(best)} best).  ")
        hbest = timings["lint 10000 +hf"].best
        verdict = "met" if hbest < LINT_HF_TARGET_S else "MISSED"
        out(
            f"Target lint(10k) with the hf block < {LINT_HF_TARGET_S} s wall: {verdict} "
            f"({_ms(hbest)} best, the block adding {_ms(hbest - best)}).  "
        )
    out(
        f"Lint imports torch: {'YES (bug)' if imports['torch'] else 'no'} "
        f"(in-process `sys.modules` after a whole lint); third-party packages it loads: "
        f"{', '.join(imports['third_party'])}; {imports['modules']} modules in all.  "
    )
    out(
        f"Compile imports torch: {'YES (bug)' if cimports['torch'] else 'no'}; "
        f"it adds: {', '.join(sorted(set(cimports['third_party']) - set(imports['third_party'])))}."
    )
    out("")
    out("`-X importtime` of `import shardspec.api` (cumulative, direct imports):")
    out("")
    out("| module | ms |")
    out("|---|---:|")
    for name, us in itimes[:8]:
        out(f"| `{name}` | {us / 1000:.1f} |")
    if stage_rows:
        out("")
        out("Stages in-process, CPU seconds, best of 3 fresh processes:")
        out("")
        names = list(next(iter(stage_rows.values())))
        out("| stage | " + " | ".join(f"{n:,}" for n in stage_rows) + " |")
        out("|---|" + "---:|" * len(stage_rows))
        for name in names:
            cells = []
            for n in stage_rows:
                v = stage_rows[n].get(name, "")
                cells.append(f"{v:.3f}" if isinstance(v, float) else str(v))
            out(f"| {name.strip()} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.bench_compiler", description=__doc__)
    ap.add_argument(
        "--sizes",
        default=",".join(str(s) for s in DEFAULT_SIZES),
        help="parameter counts, comma separated (default: 1000,10000,100000)",
    )
    ap.add_argument(
        "--hf-sizes",
        default=",".join(str(s) for s in DEFAULT_HF_SIZES),
        help="sizes that also time lint with an HF manifest (default: 1000,10000)",
    )
    ap.add_argument("--repeat", type=int, default=5, help="timed runs per command (default 5)")
    ap.add_argument("--stages", action="store_true", help="also time each pipeline stage")
    ap.add_argument(
        "--profile",
        type=int,
        metavar="N",
        help="print a cProfile of one lint of an N-parameter model and exit",
    )
    args = ap.parse_args(argv)
    if shutil.which(_cli()[0]) is None and not Path(_cli()[0]).exists():
        ap.error(f"cannot run {_cli()[0]}")
    if args.profile:
        with tempfile.TemporaryDirectory(prefix="shardspec-bench-") as tmp:
            spec = synth.write(synth.config_for(args.profile), tmp)
            sys.stdout.write(profile(spec, Path(tmp)))
        return 0
    sizes = [int(s) for s in args.sizes.split(",") if s]
    hf_sizes = [int(s) for s in args.hf_sizes.split(",") if s]
    sys.stdout.write(run(sizes, args.repeat, args.stages, hf_sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
