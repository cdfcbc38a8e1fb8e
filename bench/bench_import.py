"""What a generated module adds to every rank's start, by parameter count (issue 20.11).

    python -m bench.bench_import                              # 1k, 100k and 1M parameters
    python -m bench.bench_import --sizes 1000 100000 --rounds 5 --plan-size 100000

For each size, ``bench/synth.py`` writes a DeepSeek-V3-like MoE spec and manifest
(``config_for(N)``), and ``shardspec compile`` compiles it in a subprocess (timed; the
module's size recorded). Then, in fresh interpreters, rounds interleaved:

* **baseline**: ``import torch, shardspec.runtime``: its time and peak RSS;
* **module**: the same, then ``import`` the generated module: the time and the peak RSS the
  module's import adds in that process, *cold* (no ``.pyc``: a rank of a fresh or read-only
  checkout compiles the source) and *warm* (``.pyc`` cached);
* **first use**: after that, importing what ``parallelize``/``save``/``load`` use of the
  runtime (``shardspec.runtime.parallel``, ``checkpoint``: torch's DTensor and DCP), which
  a generated module defers to its first call;
* **expanded**: the table as generated modules held it before: one
  ``"name": Param(rule, shape, dtype)`` line per parameter in a dict literal, imported alone
  (cold and warm), the baseline for the module's table measured in the same run.

And one runtime call at ``--plan-size`` parameters: ``canonical_plan`` (what ``save`` and
``load`` plan from, per rank) over a meta state dict of every parameter on a
``--plan-world`` mesh, with the folded table, and with the same spec whose table answers
from a plain dict of every name (the lookups of the old table), in the same process. Plus
the name lookups alone: ``PARAMS.get`` of every name against ``dict.get``.

Results are medians over ``--rounds``; ``--json`` writes every sample.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import synth

REPO = Path(__file__).resolve().parents[1]
SIZES = (1_000, 100_000, 1_000_000)

# The child: import torch and the runtime (the baseline), then optionally a module from a
# folder, then optionally the runtime parts a module's first call needs. Prints JSON.
_CHILD = r"""
import importlib, json, sys, time

def rss():
    # Peak RSS in MB: VmHWM is this process's own (ru_maxrss starts from the parent's peak).
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) / 1024

t0 = time.perf_counter()
import torch, shardspec.runtime
out = {"base_s": time.perf_counter() - t0, "base_rss_mb": rss()}
folder, name, first_use = sys.argv[1:4]
if name:
    sys.path.insert(0, folder)
    r, t = rss(), time.perf_counter()
    mod = importlib.import_module(name)
    out["import_s"] = time.perf_counter() - t
    out["import_rss_mb"] = rss() - r
    out["params"] = len(mod.PARAMS)
if first_use == "1":
    r, t = rss(), time.perf_counter()
    from shardspec.runtime import checkpoint, dtensor, parallel
    out["first_use_s"] = time.perf_counter() - t
    out["first_use_rss_mb"] = rss() - r
print(json.dumps(out))
"""


def _child(folder: Path | None, name: str, *, cold: bool, first_use: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if cold:
        shutil.rmtree(folder / "__pycache__", ignore_errors=True)  # type: ignore[operator]
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder or ""), name, "1" if first_use else "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
    )
    if run.returncode != 0:
        raise SystemExit(f"import of {name or 'the baseline'} failed:\n{run.stderr[-4000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _warm(folder: Path, name: str) -> None:
    """Write the module's ``.pyc`` as a first import would."""
    import py_compile

    py_compile.compile(str(folder / f"{name}.py"), doraise=True)


def compile_size(n: int, root: Path) -> dict:
    """Write the synthetic spec of about ``n`` parameters, compile it (a subprocess, timed)
    and write the expanded per-parameter table beside it."""
    cfg = synth.config_for(n)
    folder = root / f"n{n}"
    t = time.perf_counter()
    shard = synth.write(cfg, folder)
    synth_s = time.perf_counter() - t
    out = folder / "out"
    t = time.perf_counter()
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys\n"
            "from shardspec.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if 'VmHWM' in l))\n"
            "sys.exit(rc)",
            "compile",
            "-o",
            str(out),
            str(shard),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    compile_s = time.perf_counter() - t
    if run.returncode != 0:
        raise SystemExit(f"compile of {shard} failed:\n{run.stdout[-2000:]}{run.stderr[-4000:]}")
    module = out / "moe.py"
    expanded = _write_expanded(out / "expanded.py")
    return {
        "n": n,
        "params": cfg.n_params,
        "folder": out,
        "synth_s": synth_s,
        "compile_s": compile_s,
        "compile_rss_mb": int(run.stdout.split()[-1]) / 1024,
        "module_bytes": module.stat().st_size,
        "rows": _rows(module.read_text(encoding="utf-8")),
        "expanded_bytes": expanded,
    }


def _rows(text: str) -> int:
    """The number of PARAMS rows, from the module's own count (``# N parameters in M rows.``)."""
    m = re.search(r"^# [0-9]+ parameters? in ([0-9]+) rows?\.$", text, re.M)
    if m is None:
        raise SystemExit("the module does not count its PARAMS rows")
    return int(m.group(1))


def _write_expanded(target: Path) -> int:
    """The table as modules held it before folding: one line per parameter (rule numbers
    from the compiled module's rows, so the values are the module's own)."""
    sys.path.insert(0, str(target.parent))
    try:
        import importlib

        mod = importlib.import_module("moe")
        lines = [
            f'    "{fqn}": Param({p.rule}, {tuple(p.shape)!r}, "{p.dtype}"),'
            for fqn, p in mod.PARAMS.items()
        ]
        del sys.modules["moe"]
    finally:
        sys.path.remove(str(target.parent))
    text = "from shardspec.runtime import Param\n\nPARAMS = {\n" + "\n".join(lines) + "\n}\n"
    target.write_text(text, encoding="utf-8")
    return len(text.encode())


def import_rounds(sizes: list[dict], rounds: int) -> dict[str, list[dict]]:
    """Every sample: key ``base``, ``<n>:cold``, ``<n>:warm``, ``<n>:expanded-cold``, ...,
    rounds interleaved so that load changes hit every kind alike."""
    samples: dict[str, list[dict]] = {}
    for _ in range(rounds):
        samples.setdefault("base", []).append(_child(None, "", cold=False, first_use=False))
        for s in sizes:
            folder = s["folder"]
            for name, kind in (("moe", ""), ("expanded", "expanded-")):
                key = f"{s['n']}:{kind}"
                samples.setdefault(key + "cold", []).append(
                    _child(folder, name, cold=True, first_use=not kind)
                )
                _warm(folder, name)
                samples.setdefault(key + "warm", []).append(
                    _child(folder, name, cold=False, first_use=False)
                )
    return samples


_PLAN = r"""
import importlib, json, sys, time
import torch
sys.path.insert(0, sys.argv[1])
from shardspec.core.layout import Mesh
from shardspec.runtime import CompiledSpec, ParamTable, units
mod = importlib.import_module("moe")
world, kind = int(sys.argv[2]), sys.argv[3]
names = list(mod.PARAMS)
plain = dict(mod.PARAMS.items())


class DictTable(ParamTable):
    # The same rows, answering lookups from a dict of every name, as PARAMS was before.
    def _find(self, name):
        return plain.get(name)


table = mod.PARAMS if kind == "folded" else DictTable(mod.PARAMS.rows)
out = {"params": len(names)}
best = []
for _ in range(3):  # best of 3 passes over every name
    t = time.perf_counter()
    for f in names:
        table.get(f)
    best.append((time.perf_counter() - t) / len(names) * 1e6)
out["lookup_us"] = min(best)
s = mod.SPEC
spec = CompiledSpec(
    name=s.name, axes=s.axes, sizes=s.default_sizes, world=world, rules=s.rules,
    params=table, ignore=s.ignore, name_indexed_counts=s.name_indexed_counts,
    factory_args=mod.FACTORY_ARGS, fsdp=s.fsdp_axis, styles=s.rule_styles,
    buffers=s.buffers, hook_keys=s.hook_keys,
)
flat = {f: torch.empty(p.shape, dtype=getattr(torch, p.dtype), device="meta")
        for f, p in plain.items()}
sizes = spec.sizes(world=world)
mesh = Mesh(tuple(sizes), tuple(sizes.values()))
t = time.perf_counter()
plan, _, local = units.canonical_plan(spec, mesh, 0, flat, saving=True)
out["plan_s"] = time.perf_counter() - t
out["units"] = len(plan.units)
out["fingerprint"] = plan.fingerprint
print(json.dumps(out))
"""


def plan_call(world: int, folder: Path, rounds: int) -> dict:
    """``canonical_plan`` over every parameter of the module in ``folder`` (rank 0 of a
    ``world`` mesh, saving), with the folded table and with a table answering from a dict
    of every name, each in a fresh process (layout caches cold), alternating; and the name
    lookups alone. Medians over ``rounds``."""
    samples: dict[str, list[dict]] = {"folded": [], "dict": []}
    for r in range(rounds):
        for kind in ("folded", "dict") if r % 2 == 0 else ("dict", "folded"):
            run = subprocess.run(
                [sys.executable, "-c", _PLAN, str(folder), str(world), kind],
                capture_output=True,
                text=True,
                cwd=REPO,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
            if run.returncode != 0:
                raise SystemExit(f"the plan call failed:\n{run.stderr[-4000:]}")
            samples[kind].append(json.loads(run.stdout.strip().splitlines()[-1]))
    first = samples["folded"][0]
    got = {"params": first["params"], "units": first["units"], "rounds": rounds}
    if len({(x["units"], x["fingerprint"]) for runs in samples.values() for x in runs}) != 1:
        raise SystemExit("the folded and the dict table planned differently")
    for kind, runs in samples.items():
        got[f"{kind}_plan_s"] = _median(runs, "plan_s")
        got[f"{kind}_lookup_us"] = _median(runs, "lookup_us")
    return got


def _median(samples: list[dict], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def report(sizes: list[dict], samples: dict[str, list[dict]], plan: dict | None, args) -> str:
    base = samples["base"]
    lines = [
        f"Command: `python -m bench.bench_import {' '.join(args.argv)}`".rstrip() + "  ",
        f"Machine: {os.cpu_count()} CPU cores, {platform.machine()}, Python "
        f"{platform.python_version()}; 1-minute load average {os.getloadavg()[0]:.1f} after  ",
        f"Baseline `import torch, shardspec.runtime`: {_median(base, 'base_s'):.2f} s, peak RSS "
        f"{_median(base, 'base_rss_mb'):.0f} MB (median of {len(base)})",
        "",
        "| parameters | rows | module | compile | import cold | import warm | RSS added "
        "| first use | expanded table | expanded cold | expanded warm | expanded RSS |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in sizes:
        k = str(s["n"])
        cold, warm = samples[k + ":cold"], samples[k + ":warm"]
        ecold, ewarm = samples[k + ":expanded-cold"], samples[k + ":expanded-warm"]
        ms = {key: _median(cold, key) * 1e3 for key in ("import_s", "first_use_s")}
        lines.append(
            f"| {s['params']:,} | {s['rows']} | {s['module_bytes'] / 1e3:,.1f} kB "
            f"| {s['compile_s']:.1f} s, {s['compile_rss_mb']:,.0f} MB "
            f"| {ms['import_s']:,.0f} ms | {_median(warm, 'import_s') * 1e3:,.0f} ms "
            f"| {_median(cold, 'import_rss_mb'):,.1f} MB "
            f"| {ms['first_use_s']:,.0f} ms, {_median(cold, 'first_use_rss_mb'):,.0f} MB "
            f"| {s['expanded_bytes'] / 1e6:,.1f} MB "
            f"| {_median(ecold, 'import_s'):,.2f} s | {_median(ewarm, 'import_s'):,.2f} s "
            f"| {_median(ecold, 'import_rss_mb'):,.0f} MB |"
        )
    if plan is not None:
        lines += [
            "",
            f"Runtime call at {plan['params']:,} parameters, world {args.plan_world}: "
            f"`canonical_plan` (rank 0, saving; median of {plan['rounds']} per table, each in a "
            f"fresh process) {plan['folded_plan_s']:.1f} s with the folded table, "
            f"{plan['dict_plan_s']:.1f} s with a dict of every name "
            f"({plan['folded_plan_s'] / plan['dict_plan_s']:.2f}x), {plan['units']:,} units; "
            f"a lookup of every name {plan['folded_lookup_us']:.2f} us per name, "
            f"{plan['dict_lookup_us']:.2f} us from the dict (best of 3 passes).",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--plan-size", type=int, default=100_000, help="0: no plan call")
    parser.add_argument("--plan-world", type=int, default=16)
    parser.add_argument("--plan-rounds", type=int, default=1)
    parser.add_argument("--keep", type=Path, help="work here and keep the files")
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    root = args.keep or Path(tempfile.mkdtemp(prefix="bench_import_"))
    try:
        sizes = [compile_size(n, root) for n in args.sizes]
        for s in sizes:
            print(
                f"compiled {s['params']:,} parameters: {s['rows']} rows, "
                f"{s['module_bytes']:,} bytes, {s['compile_s']:.1f} s",
                flush=True,
            )
        samples = import_rounds(sizes, args.rounds)
        plan = None
        if args.plan_size:
            folder = next((s["folder"] for s in sizes if s["n"] == args.plan_size), None)
            if folder is None:
                folder = compile_size(args.plan_size, root)["folder"]
            plan = plan_call(args.plan_world, folder, args.plan_rounds)
        print(report(sizes, samples, plan, args))
        if args.json is not None:
            data = {
                "sizes": [{k: v for k, v in s.items() if k != "folder"} for s in sizes],
                "samples": samples,
                "plan": plan,
            }
            args.json.write_text(json.dumps(data, indent=1), encoding="utf-8")
    finally:
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
