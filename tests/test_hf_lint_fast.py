"""The hf checks' fast paths against the language reference, worked out the slow way.

``HFMap.sources``/``consumers`` look rules up by their literal segments before any regex,
and ``checks/hf.py:check_hf_units`` checks the units a parameter expands to (one per
global expert index) as a group. The oracle here shares none of that code: it builds
each template's regex itself, tries every map line on every storage unit and every HF
key, fills templates by plain substitution, and takes the model's storage units from a
table written out by hand. Besides the parsed spec and its rules as lint builds them
(``build_hfmap``, ``glob_problem``), it uses only the public, slow definitions
(``hf_shape``, ``hf_dim``, ``transform_problem``, and ``HFMap.kept``/``dropped``/
``tie_of``, one glob or tie at a time).

The findings are compared as summaries read back from their messages: code, where,
the first name shown, how many it stands for, and the detail. They come from many
random hf blocks over one small model with local experts (indices up to 11, so
``"10" < "2"`` matters), fused components (listed out of name order), stacked experts,
keeps, drops, ties, literal digits in targets, captures inside a segment (``e{e}``,
``1{d}``), repeated captures and two parameters naming one unit; ``sources`` and
``consumers`` also on names and templates made up at random.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from bench import synth
from shardspec.checks import hf as hf_checks
from shardspec.checks import run as run_mod
from shardspec.checks.hf import check_hf_units
from shardspec.core.hfmap import (
    Fused,
    HFMap,
    MapRule,
    Part,
    Source,
    Split,
    Transform,
    hf_dim,
    hf_shape,
    template_captures,
    transform_problem,
)
from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend.parse import parse_file
from shardspec.inputs.hfmanifest import HFManifest, dump_hf_manifest
from shardspec.inputs.manifest import dump_manifest
from shardspec.resolve.hf import build_hfmap, glob_problem
from shardspec.resolve.params import Resolved

# ------------------------------------------------------------ templates, the slow way

_CAPTURE = re.compile(r"\{(\w+)\}")


def template_regex(template: str, numeric: str | None = None) -> re.Pattern[str]:
    """A capture is one segment or part of one; a repeated capture repeats its text; the
    stack capture of an HF template (``numeric``) is a whole number."""
    out: list[str] = []
    seen: set[str] = set()
    for k, piece in enumerate(_CAPTURE.split(template)):
        if k % 2 == 0:
            out.append(re.escape(piece))
        elif piece in seen:
            out.append(f"(?P={piece})")
        else:
            seen.add(piece)
            out.append(f"(?P<{piece}>{'[0-9]+' if piece == numeric else '[^.]+'})")
    return re.compile("".join(out))


def fill(template: str, values: dict[str, str]) -> str:
    return _CAPTURE.sub(lambda m: values[m.group(1)], template)


def oracle_sources(
    rules: Sequence[MapRule],
    name: str,
    shape: tuple[int, ...],
    fused: Fused | None = None,
    only: Sequence[int] | None = None,
) -> list[Source]:
    """What every rule (of ``only``) makes of unit ``name``: a line whose target is the
    unit reads it whole (one key per index of a stack); a line whose target is a fused
    parameter reads the unit as its part of the parameter's HF tensor."""
    out = []
    for i in range(len(rules)) if only is None else only:
        rule = rules[i]
        target = template_regex(rule.target)
        keys = _keys_of(rule, shape)
        m = target.fullmatch(name)
        if m is not None and rule.parts is None and not rule.grouped and keys is not None:
            sub = shape[1:] if rule.stack else shape
            chain = rule.transforms
            out.append(
                Source(i, keys(m.groupdict()), hf_shape(sub, chain), bool(rule.stack), chain)
            )
        base, _, comp = name.rpartition(".")
        m = target.fullmatch(base) if fused is not None and base else None
        if m is None or fused is None or keys is None:
            continue
        at, comps, groups = fused
        groups = groups if rule.grouped else 1
        sizes = dict(comps)
        parts = list(rule.parts) if rule.parts is not None else [Part(c) for c, _ in comps]
        order = [p.name for p in parts]
        d = at - 1 if rule.stack else at
        if comp not in order or d < 0:
            continue
        chain = rule.transforms + parts[order.index(comp)].transforms
        sub = shape[1:] if rule.stack else shape
        # The HF tensor is the parts one after another along the fused dimension (a part
        # that is no component counts 0), seen through the transforms; grouped, one group's
        # rows of every part after another, group after group.
        whole = list(sub)
        whole[d] = sum(sizes.get(p, 0) for p in order)
        start = sum(sizes.get(p, 0) // groups for p in order[: order.index(comp)])
        split = Split(hf_dim(len(sub), chain, d), start, sub[d], whole[d], groups)
        caps = m.groupdict()
        out.append(Source(i, keys(caps), hf_shape(whole, chain), bool(rule.stack), chain, split))
    return out


def _keys_of(rule: MapRule, shape: tuple[int, ...]) -> Any:
    """captures -> the HF keys a unit of ``shape`` needs (None: a stack with no first dim)."""
    if not rule.stack:
        return lambda caps: (fill(rule.hf, caps),)
    if not shape:
        return None
    stack = rule.stack
    return lambda caps: tuple(fill(rule.hf, {**caps, stack: str(e)}) for e in range(shape[0]))


def oracle_consumers(
    rules: Sequence[MapRule], key: str, only: Sequence[int] | None = None
) -> list[tuple[int, str, int | None]]:
    """Every rule whose HF template matches ``key``: (rule, target filled, stack index)."""
    out = []
    for i in range(len(rules)) if only is None else only:
        rule = rules[i]
        m = template_regex(rule.hf, rule.stack).fullmatch(key)
        if m is None:
            continue
        caps = m.groupdict()
        index = int(caps.pop(rule.stack)) if rule.stack else None
        out.append((i, fill(rule.target, caps), index))
    return out


# ---------------------------------------------------------------- the model, by hand


@dataclass(frozen=True)
class Unit:
    shape: tuple[int, ...]
    fqn: str  # the manifest parameter findings point at (the first to name the unit)
    fused: Fused | None = None


W13: Fused = Fused(0, (("up", 4), ("gate", 4)))  # `fuse ffn as up, gate` on ffn 8


def model_units() -> dict[str, Unit]:
    """The storage units of ``MODEL``: experts under global indices 0..11, whichever
    rank's module names them; w13 as its components. ``CLASH``'s parameter names a unit
    w13 already names, and w13 comes first in name order, so it adds none."""
    units = {"norm.weight": Unit((8,), "norm.weight")}
    for i in LAYERS:
        for comp in ("up", "gate"):
            units[f"layers.{i}.w13.{comp}"] = Unit((4, 8), f"layers.{i}.w13", W13)
        for e in range(EXPERTS):
            units[f"layers.{i}.moe.{e}.w1"] = Unit((4, 8), f"layers.{i}.moe.0.w1")
            units[f"layers.{i}.moe.{e}.w2"] = Unit((8, 4), f"layers.{i}.moe.0.w2")
            units[f"layers.{i}.moe.e{e}.w3"] = Unit((4,), f"layers.{i}.moe.e0.w3")
    for i in (0, 10):
        units[f"layers.{i}.experts"] = Unit((3, 4, 8), f"layers.{i}.experts")
    return units


def dim_sizes(fqn: str) -> dict[str, int]:
    """Each dimension's and component's global size in parameter ``fqn`` of ``MODEL``."""
    if fqn == "norm.weight":
        return {"hidden": 8}
    if fqn.endswith(".w13"):
        return {"ffn": 8, "up": 4, "gate": 4, "hidden": 8}
    if fqn.endswith(".w13.gate"):
        return {"ffn": 4, "hidden": 8}
    if fqn.endswith(".experts"):
        return {"expert": 3, "ffn": 4, "hidden": 8}
    if fqn.endswith((".w1", ".w2")):
        return {"expert": EXPERTS, "ffn": 4, "hidden": 8}
    assert fqn.endswith(".w3"), fqn
    return {"expert": EXPERTS, "ffn": 4}


# ------------------------------------------------------------- the findings, slowly

# A finding as (code, where, first name shown, how many it stands for, detail); where is
# the map line, or for SS071 the parameter, or for SS073 nothing (a line of hf.json).
Summary = tuple[str, Any, str, int, str]


def _digits(name: str) -> str:
    return re.sub(r"[0-9]+", "N", name)


def _grouped(code: str, names: list[str], where: Any) -> list[Summary]:
    """Names in one finding per digit pattern, by first name, and the rest summed up."""
    groups: dict[str, list[str]] = defaultdict(list)
    for n in sorted(names):
        groups[_digits(n)].append(n)
    ordered = sorted(groups.values())
    shown = hf_checks.MAX_GROUPS
    out: list[Summary] = [(code, where(g[0]), g[0], len(g), "") for g in ordered[:shown]]
    rest = ordered[shown:]
    if rest:
        first = rest[0][0]
        out.append((code + " rest", where(first), first, sum(map(len, rest)), ""))
    return out


def oracle(res: Resolved, hfm: HFManifest | None, bad: set[int], fqns: list[str]) -> list[Summary]:
    """SS071-SS078 for ``MODEL`` with manifest parameters ``fqns``, by brute force."""
    hf = res.spec.hf
    assert hf is not None
    full = build_hfmap(hf)  # rule i is map line i
    rules = full.rules
    good = [i for i in range(len(rules)) if i not in bad]
    line = [m.span.line for m in hf.maps]
    units = model_units()
    out: list[Summary] = []
    not_produced: list[str] = []
    twice: dict[tuple[int, ...], list[str]] = defaultdict(list)
    transform_bad: dict[tuple[int, str], list[str]] = defaultdict(list)
    used: set[int] = set()
    needed: dict[str, tuple[int, tuple[int, ...] | None]] = {}  # key -> (rule, HF shape)
    for name in sorted(units):
        u = units[name]
        if full.kept(name):
            continue
        found = oracle_sources(rules, name, u.shape, u.fused, good)
        used |= {s.rule for s in found}
        if not found:
            not_produced.append(name)
        elif len(found) > 1:
            twice[tuple(s.rule for s in found)].append(name)
        else:
            (s,) = found
            why = transform_problem(u.shape[1:] if s.stacked else u.shape, s.transforms)
            if why:
                transform_bad[(s.rule, why)].append(name)
            for k in s.keys:
                needed.setdefault(k, (s.rule, None if why else s.shape))
    out += _grouped("SS071", not_produced, lambda n: units[n].fqn)
    for rs, names in twice.items():
        lines = ", ".join(str(line[i]) for i in rs)
        out.append(("SS072", line[rs[-1]], names[0], len(names), f"lines {lines}"))
    for (i, why), names in transform_bad.items():
        out.append(("SS076", line[i], names[0], len(names), why))
    out += [("SS078", line[i], "", 0, "map") for i in good if i not in used]
    for g in hf.keeps:
        glob = g.pattern.text
        if glob_problem(glob) is None and not any(HFMap(keeps=(glob,)).kept(n) for n in units):
            out.append(("SS078", g.pattern.span.line, "", 0, "keep"))
    if hfm is None:
        return out
    out += _keys(full, hf.drops, hfm, needed, line, good, units)
    for c in hf.configs:
        values = [f.number if f.number is not None else hfm.config[f.text] for f in c.factors]
        value = math.prod(values)
        name = c.name.text
        off = [(fqn, s) for fqn in fqns for n, s in dim_sizes(fqn).items() if n == name]
        off = [(fqn, s) for fqn, s in off if s != value]
        if off:
            out.append(("SS077", c.span.line, off[0][0], len(off), f"{name}={value}: {off[0][1]}"))
    return out


def _keys(
    full: HFMap,
    drops: list[Any],
    hfm: HFManifest,
    needed: dict[str, tuple[int, tuple[int, ...] | None]],
    line: list[int],
    good: list[int],
    units: dict[str, Unit],
) -> list[Summary]:
    """SS073-SS075 and unmatched drops: the HF keys the units need, against the file."""
    tensors = hfm.tensors
    missing: dict[int, list[str]] = defaultdict(list)
    wrong: dict[tuple[int, str], list[str]] = defaultdict(list)  # shown: the key read
    read: set[str] = set()
    for key in sorted(needed):
        i, expected = needed[key]
        present = key if key in tensors else full.tie_of(key)
        if present is None or present not in tensors:
            missing[i].append(key)
            continue
        read.add(present)
        got = tensors[present].shape
        if expected is not None and got != expected:
            wrong[(i, f"{list(got)} for {list(expected)}")].append(present)
    out: list[Summary] = [("SS074", line[i], ks[0], len(ks), "") for i, ks in missing.items()]
    out += [("SS075", line[i], ks[0], len(ks), d) for (i, d), ks in wrong.items()]
    bases = {n.rpartition(".")[0]: u for n, u in units.items() if u.fused is not None}

    def consumed(key: str) -> bool:
        for _, target, index in oracle_consumers(full.rules, key, good):
            u = units.get(target) or bases.get(target)
            if u is not None and (index is None or 0 <= index < (u.shape or (0,))[0]):
                return True
        return False

    unexpected = [
        k
        for k in tensors
        if k not in needed
        and k not in read
        and full.tie_of(k) is None
        and not full.dropped(k)
        and not consumed(k)
    ]
    out += _grouped("SS073", unexpected, lambda _: "")
    for g in drops:
        glob = g.pattern.text
        if glob_problem(glob) is None and not any(HFMap(drops=(glob,)).dropped(k) for k in tensors):
            out.append(("SS078", g.pattern.span.line, "", 0, "drop"))
    return out


# -------------------------------------------------------- the findings, read back

_FIRST = r"'(?P<first>[^']*)'(?: \(and (?P<more>\d+) more(?: like it)?\))?"
_SHAPE = r"\[[0-9, ]*\]"
_MESSAGES = {
    "SS071": [
        rf"storage unit '(?P<first>[^']*)' {_SHAPE} is produced by no hf map line"
        r"(?: \(and (?P<more>\d+) more like it\))?",
        r"(?P<n>\d+) more storage units are produced by no hf map line, such as "
        r"'(?P<first>[^']*)'",
    ],
    "SS072": [
        rf"storage unit {_FIRST} is produced by \d+ map lines \((?P<detail>lines [0-9, ]+)\)"
    ],
    "SS073": [
        rf"unexpected HF key {_FIRST}: no map line consumes it",
        r"(?P<n>\d+) more unexpected HF keys, such as '(?P<first>[^']*)'",
    ],
    "SS074": [rf"HF key {_FIRST} that line \d+ needs is not in the HF manifest"],
    "SS075": [rf"HF key {_FIRST} has shape (?P<got>{_SHAPE}), line \d+ expects (?P<exp>{_SHAPE})"],
    "SS076": [rf"{_FIRST}: (?P<detail>.+)"],
    "SS077": [
        r"config (?P<name>\w+) = .+ = (?P<value>\d+), but '(?P<first>[^']*)'"
        r"(?: \(and (?P<more>\d+) more\))? has \w+ of (?P<size>\d+)"
    ],
    "SS078": [
        r"map line .+ produces no storage unit(?P<map>)",
        r"keep '.+' matches no storage unit(?P<keep>)",
        r"drop '.+' matches no key of the HF manifest(?P<drop>)",
    ],
}


def summary(d: Diagnostic) -> Summary:
    """What finding ``d`` says, as the oracle puts it (a message of no known form fails)."""
    for pattern in _MESSAGES[d.code]:
        m = re.fullmatch(pattern, d.message)
        if m is None:
            continue
        g = {k: v for k, v in m.groupdict().items() if v is not None}
        code = d.code + (" rest" if "n" in g else "")
        count = int(g["n"]) if "n" in g else 1 + int(g.get("more", 0))
        where: Any = d.span.line
        if d.code == "SS071":  # the manifest line of the parameter
            text = Path(d.span.file).read_text("utf-8").splitlines()[d.span.line - 1]
            where = json.loads(text.strip().rstrip(","))["fqn"]
        elif d.code == "SS073":
            where = ""
        if d.code == "SS078":
            return (d.code, where, "", 0, next(iter(g)))
        detail = g.get("detail", "")
        if d.code == "SS075":
            detail = f"{g['got']} for {g['exp']}"
        elif d.code == "SS077":
            detail = f"{g['name']}={g['value']}: {g['size']}"
        return (code, where, g["first"], count, detail)
    raise AssertionError(f"a finding of no known form: {d}")


# ----------------------------------------------------------- running both on a spec


def run_fast(spec_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """``check_hf_units``' inputs as lint makes them, its findings, and the names it asked
    ``HFMap.sources`` about."""
    calls: list[tuple[Any, ...]] = []

    def capture(
        res: Resolved, hfm: HFManifest | None, bad: set[int], *_: object, **__: object
    ) -> list[Diagnostic]:
        calls.append((res, hfm, bad))
        return []

    asked: list[str] = []
    sources = HFMap.sources

    def counting(self: HFMap, name: str, *a: Any) -> list[Source]:
        asked.append(name)
        return sources(self, name, *a)

    spec, diags = parse_file(spec_path)
    assert spec is not None, diags
    with monkeypatch.context() as mp:
        mp.setattr(run_mod, "check_hf_units", capture)
        run_mod.check(spec)
    ((res, hfm, bad),) = calls
    with monkeypatch.context() as mp:
        mp.setattr(HFMap, "sources", counting)
        found = check_hf_units(res, hfm, set(bad))
    return res, hfm, bad, found, asked


def both(
    spec_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Summary], list[Summary], list[str]]:
    """(the fast findings, the oracle's, the names ``HFMap.sources`` was asked about)."""
    res, hfm, bad, found, asked = run_fast(spec_path, monkeypatch)
    fast = sorted(summary(d) for d in found if d.code != "SS081")  # SS081: tests/checks
    fqns = sorted(fqn for fqn, _ in res.params)
    return fast, sorted(oracle(res, hfm, set(bad), fqns)), asked


# ------------------------------------------------------------------ a varied small model

LAYERS = (0, 1, 2, 10)
PER_RANK, EP = 6, 2  # global expert indices 0..11
EXPERTS = PER_RANK * EP

MODEL = """\
mesh over 4 ranks {
    ep: 2
    tp: 2
}
param norm.weight [hidden] {}
param layers.*.w13 [ffn, hidden] { fuse ffn as up, gate }
param layers.*.experts [expert, ffn, hidden] {}
param layers.*.moe.{expert}.w1 [expert, ffn, hidden] {
    local ep
    shard expert over ep
}
param layers.*.moe.{expert}.w2 [expert, hidden, ffn] {
    local ep
    shard expert over ep
}
param layers.*.moe.e{expert}.w3 [expert, ffn] {
    local ep
    shard expert over ep
}
"""
# A parameter named like a component of another: two parameters name one unit.
CLASH = "param layers.*.w13.gate [ffn, hidden] {}\n"


def manifest(clash: bool) -> dict[str, list[int]]:
    out = {"norm.weight": [8]}
    for i in LAYERS:
        out[f"layers.{i}.w13"] = [8, 8]
        for e in range(PER_RANK):
            out[f"layers.{i}.moe.{e}.w1"] = [4, 8]
            out[f"layers.{i}.moe.{e}.w2"] = [8, 4]
            out[f"layers.{i}.moe.e{e}.w3"] = [4]
    for i in (0, 10):
        out[f"layers.{i}.experts"] = [3, 4, 8]
    if clash:
        out["layers.1.w13.gate"] = [4, 8]
    return out


MAPS = [
    "model.norm.weight -> norm.weight",
    "model.norm.weight -> norm.weight transpose",
    "model.layers.{i}.gate -> layers.{i}.w13.gate",
    "model.layers.{i}.up -> layers.{i}.w13.up",
    "model.layers.{i}.{c}_proj -> layers.{i}.w13.{c}",
    "model.layers.{i}.gate -> layers.{i}.w13.gate rope 16",
    "model.layers.{i}.gate -> layers.{i}.w13.up transpose",
    "model.layers.{i}.mlp.experts.{e}.w1 -> layers.{i}.moe.{e}.w2 transpose",
    "model.layers.{i}.experts.{e}.w1 -> layers.{i}.experts[e]",
    "model.layers.{i}.experts.{e}.w1 -> layers.{i}.experts[e] transpose",
    "model.layers.{i}.mlp.experts.{e}.w1 -> layers.{i}.moe.{e}.w1",
    "model.layers.{i}.mlp.experts.{e}.w1 -> layers.{i}.moe.{e}.w1 transpose",
    "model.layers.{i}.mlp.experts.{e}.w2 -> layers.{i}.moe.{e}.w2 transpose",
    "model.layers.{i}.mlp.experts.{e}.w2 -> layers.{i}.moe.{e}.w2",
    "model.layers.{i}.mlp.x{e}.w3 -> layers.{i}.moe.e{e}.w3",
    "model.layers.{i}.mlp.experts.{e}.w3 -> layers.{i}.moe.e{e}.w3",
    "model.{e}.{i}.w3 -> layers.{i}.moe.e{e}.w3",
    "model.special.{e}.w1 -> layers.0.moe.{e}.w1",
    "model.special3.w1 -> layers.1.moe.3.w1",
    "model.layers.{i}.tens.{d}.w1 -> layers.{i}.moe.1{d}.w1",
    "model.diag.{i}.w1 -> layers.{i}.moe.{i}.w1",
    "model.layers.{i}.mlp.{e}.{p} -> layers.{i}.moe.{e}.{p}",
    "model.{a}.{b}.{c}.{d}.{f} -> {a}.{b}.{c}.{d}.{f}",
    "model.layers.{i}.w.{e}.{e} -> layers.{i}.moe.{e}.w2",
    "model.layers.{i}.bad.{e} -> layers.{i}.moe.{e}.w1[e]",
    "model.layers.{i}.only.{z} -> layers.{i}.moe.{e}.w1",
    "model.layers.{i}.experts.{e} -> layers.{i}.experts[e]",
    "model.layers.10.up -> layers.10.w13.up",
    # split lines: one HF tensor to w13's components
    "model.layers.{i}.gate_up -> layers.{i}.w13",
    "model.layers.{i}.gate_up -> layers.{i}.w13 transpose as gate rope 4, up",
    "model.layers.{i}.ug -> layers.{i}.w13 as up 4, gate (intermediate_size)",
    "model.layers.{i}.gd -> layers.{i}.w13 as gate, down",
    "model.norm.weight -> norm.weight as a, b",
]
OTHER = [
    "keep layers.1.moe.*.w2",
    "keep **.w3",
    "keep layers.*.moe.1*.w1",
    "keep layers.*.moe.0.w2",
    "keep layers.*.moe.1.w2",
    "keep nothing.*",
    "keep layers.2.w13.*",
    "drop model.extra.*",
    "drop **.bias",
    "tie model.alias.weight = model.norm.weight",
    "tie model.layers.2.gate = model.layers.1.gate",
    "config hidden = hidden_size",
    "config ffn = intermediate_size",
    "config expert = num_experts",
    "config gate = intermediate_size",
    "config up = 2 * intermediate_size",
]
# The block that maps everything once (a clean lint, given the HF manifest below).
CLEAN = [
    "model.norm.weight -> norm.weight",
    "model.layers.{i}.gate -> layers.{i}.w13.gate",
    "model.layers.{i}.up -> layers.{i}.w13.up",
    "model.layers.{i}.experts.{e}.w1 -> layers.{i}.experts[e]",
    "model.layers.{i}.mlp.experts.{e}.w1 -> layers.{i}.moe.{e}.w1",
    "model.layers.{i}.mlp.experts.{e}.w2 -> layers.{i}.moe.{e}.w2",
    "model.layers.{i}.mlp.experts.{e}.w3 -> layers.{i}.moe.e{e}.w3",
]
assert set(CLEAN) <= set(MAPS)


def hf_tensors(extras: bool = True) -> dict[str, list[int]]:
    """The HF checkpoint of ``CLEAN``, with ``extras``: keys to drop, tie, or report."""
    out = {"model.norm.weight": [8]}
    for i in LAYERS:
        out[f"model.layers.{i}.gate"] = [4, 8]
        out[f"model.layers.{i}.up"] = [4, 8]
        for e in range(EXPERTS):
            out[f"model.layers.{i}.mlp.experts.{e}.w1"] = [4, 8]
            out[f"model.layers.{i}.mlp.experts.{e}.w2"] = [8, 4]
            out[f"model.layers.{i}.mlp.experts.{e}.w3"] = [4]
    for i in (0, 10):
        for e in range(3):
            out[f"model.layers.{i}.experts.{e}.w1"] = [4, 8]
    if not extras:
        return out
    out["model.extra.thing"] = [1]
    out["model.alias.weight"] = [8]
    for i in LAYERS:
        out[f"model.layers.{i}.bias"] = [2]
        out[f"model.layers.{i}.mlp.experts.{EXPERTS}.w1"] = [4, 8]  # beyond the last expert
    for i in (0, 10):
        out[f"model.layers.{i}.experts.3.w1"] = [4, 8]  # past the stacked dim (3)
    out["model.special.5.w1"] = [4, 8]
    out["model.layers.1.tens.1.w1"] = [4, 8]
    out["model.diag.1.w1"] = [4, 8]
    for i in LAYERS[:2]:
        out[f"model.layers.{i}.gate_up"] = [8, 8]
        out[f"model.layers.{i}.ug"] = [8, 8]
    return out


def write_case(tmp: Path, rng: random.Random | None, n: int) -> Path:
    """Case ``n``: a random block and HF checkpoint, or (``rng`` None) the clean ones."""
    if rng is None:
        items = [*CLEAN, "config hidden = hidden_size", "config gate = intermediate_size"]
    elif n % 4 == 0:
        items = list(CLEAN)
    else:
        draw = rng.random
        items = [m for m in MAPS if draw() < 0.3]
        if rng.random() < 0.5:
            items += CLEAN
    if rng is not None:
        items += [o for o in OTHER if rng.random() < 0.25]
        rng.shuffle(items)
    tensors = hf_tensors(extras=rng is not None)
    for k in sorted(tensors):
        x = 1.0 if rng is None else rng.random()
        if x < 0.03:
            del tensors[k]
        elif x < 0.06:
            tensors[k] = [*tensors[k], 1]
    return write_spec(tmp / f"case{n}", items, tensors, clash=n % 7 == 3, with_file=n % 5 != 4)


def write_spec(
    d: Path, items: list[str], tensors: dict[str, list[int]], clash: bool, with_file: bool
) -> Path:
    """A spec of ``MODEL`` with hf block ``items`` (naming an HF manifest of ``tensors``
    if ``with_file``), and its model manifest; ``clash`` adds ``CLASH``."""
    d.mkdir()
    entries = [
        {"fqn": fqn, "kind": "param", "shape": shape, "dtype": "float32"}
        for fqn, shape in manifest(clash).items()
    ]
    (d / "m.json").write_text(dump_manifest(entries, "tests:model", {"ep": EP}), "utf-8")
    hf = dump_hf_manifest(
        {
            "format": "shardspec-hf-manifest/1",
            "config": {"hidden_size": 8, "intermediate_size": 4, "num_experts": EXPERTS},
            "tensors": {
                k: {"shape": s, "dtype": "F32", "file": "model.safetensors"}
                for k, s in tensors.items()
            },
        }
    )
    (d / "hf.json").write_text(hf, "utf-8")
    head = 'hf "hf.json" {' if with_file else "hf {"
    text = 'manifest "m.json"\n' + MODEL + (CLASH if clash else "")
    text += "\n".join([head, *(f"    {i}" for i in items), "}", ""])
    (d / "spec.shard").write_text(text, "utf-8")
    return d / "spec.shard"


def family(name: str) -> str:
    """A unit's name with its expert index left out: the units one group stands for."""
    return re.sub(r"moe\.(e?)[0-9]+", r"moe.\1E", name)


def random_case(
    n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[Summary], list[Summary], list[str]]:
    """Case ``n`` run both ways; every third shows one group of a kind before summing up
    the rest (lint's default shows 20, more than this model has)."""
    spec = write_case(tmp_path, random.Random(n), n)
    with monkeypatch.context() as mp:
        if n % 3 == 0:
            mp.setattr(hf_checks, "MAX_GROUPS", 1)
        return both(spec, monkeypatch)


@pytest.mark.parametrize("n", range(40))
def test_random_blocks_match_the_oracle(
    n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fast, slow, _ = random_case(n, tmp_path, monkeypatch)
    assert fast == slow


def test_the_cases_reach_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The random cases above check expert units as one group and one by one, and find
    every kind of finding, also in its summed-up form."""
    codes: set[str] = set()
    grouped = single = False
    for n in range(40):
        fast, _, asked = random_case(n, tmp_path, monkeypatch)
        codes |= {s[0] for s in fast}
        per_family = defaultdict(int)
        for name in asked:
            per_family[family(name)] += 1
        moe = [k for f, k in per_family.items() if ".moe." in f]
        grouped |= 1 in moe
        single |= any(k > 1 for k in moe)
    wanted = {"SS071", "SS072", "SS073", "SS074", "SS075", "SS076", "SS077", "SS078"}
    assert codes >= wanted | {"SS071 rest", "SS073 rest"}
    assert grouped and single


def test_clean_block_is_clean_and_grouped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_case(tmp_path, None, 0)
    fast, slow, asked = both(spec, monkeypatch)
    assert fast == slow == []
    # w1's and w2's expert units are checked as one group each (one name asked); w3's
    # index sits inside a segment (`e{expert}`), so its units are checked one by one.
    units = model_units()
    grouped = {family(n) for n in units if re.search(r"moe\.[0-9]+\.", n)}
    one_by_one = [n for n in units if not re.search(r"moe\.[0-9]+\.", n)]
    assert sorted(map(family, asked)) == sorted([*grouped, *map(family, one_by_one)])


def test_two_lines_read_one_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """w1's and w2's units read the same HF keys (two groups): a missing or misshapen key
    counts for the line of the first unit, in name order, that needs it."""
    w2_from_w1 = "model.layers.{i}.mlp.experts.{e}.w1 -> layers.{i}.moe.{e}.w2 transpose"
    items = [w2_from_w1 if m.endswith(".w2") else m for m in CLEAN]
    tensors = hf_tensors(extras=False)
    del tensors["model.layers.1.mlp.experts.7.w1"]
    tensors["model.layers.2.mlp.experts.10.w1"] = [4, 9]
    spec = write_spec(tmp_path / "case", items, tensors, clash=False, with_file=True)
    fast, slow, _ = both(spec, monkeypatch)
    assert fast == slow
    line = spec.read_text("utf-8").splitlines().index(f"    {CLEAN[4]}") + 1
    # (and SS073: the checkpoint's w2 keys are read by no line now)
    assert [(s[0], s[1]) for s in fast] == [("SS073", ""), ("SS074", line), ("SS075", line)]


@pytest.mark.parametrize("with_file", [True, False])
def test_synthetic_benchmark_model(
    with_file: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = synth.config_for(200)
    spec = synth.write_hf(cfg, tmp_path, hf_manifest=with_file)
    *_, found, asked = run_fast(spec, monkeypatch)
    assert found == []
    groups = 3 + 12 * cfg.first_dense + cfg.moe_layers * 17  # n_units, experts grouped
    assert len(asked) == len(set(asked)) == groups < cfg.n_units


# ------------------------------------------------------- HFMap against every regex

SEGMENTS = ["model", "layers", "0", "1", "12", "w1", "w12", "experts", "gate", "x", "weight"]
COMPONENTS = (("gate", 6), ("up", 10))  # a fused dimension's, out of name order
T = Transform("transpose")


def _random_template(rng: random.Random, caps: list[str]) -> str:
    segs = []
    for _ in range(rng.randint(1, 5)):
        r = rng.random()
        if r < 0.45:
            segs.append(rng.choice(SEGMENTS))
        elif r < 0.75:
            segs.append("{" + rng.choice(caps) + "}")
        else:  # a capture inside a segment, or two
            c = rng.choice(caps)
            segs.append(rng.choice(["w{%s}", "{%s}1", "e{%s}x", "{%s}_{b}"]) % c)
    return ".".join(segs)


def _random_name(rng: random.Random, templates: list[str]) -> str:
    if rng.random() < 0.7:  # fill a template, so that names often match
        t = rng.choice(templates)
        return re.sub(r"\{[a-z]\}", lambda _: rng.choice(SEGMENTS[:7]), t)
    return ".".join(rng.choice(SEGMENTS) for _ in range(rng.randint(1, 5)))


def _random_rule(rng: random.Random, caps: list[str]) -> MapRule:
    target = _random_template(rng, caps)
    hf = _random_template(rng, caps)
    # Sound rules only (both sides the same captures), as lint lets through.
    both_caps = set(template_captures(target)) | set(template_captures(hf))
    target += "".join(f".{{{c}}}" for c in sorted(both_caps - set(template_captures(target))))
    hf += "".join(f".{{{c}}}" for c in sorted(both_caps - set(template_captures(hf))))
    stack = "s" if rng.random() < 0.2 else None
    if stack:
        hf += ".{s}"
    transforms = (T,) * rng.choice([0, 0, 1, 2])
    parts = None
    if rng.random() < 0.3:  # an `as` list: the components in some order, or a stranger
        names = rng.sample(["gate", "up", "down"], rng.randint(1, 3))
        parts = tuple(Part(n, (T,) if rng.random() < 0.2 else ()) for n in names)
    return MapRule(hf, target, stack, transforms, 0, parts, grouped=rng.random() < 0.2)


def defined(sources: list[Source], shape: tuple[int, ...]) -> list[Any]:
    """Sources as far as they are defined: where the transforms do not fit the unit (a
    transpose of a 3-D tensor; lint says SS076, the runtime refuses it), only which rule
    makes the unit from which keys."""
    out: list[Any] = []
    for s in sources:
        fits = transform_problem(shape[1:] if s.stacked else shape, s.transforms) is None
        out.append(s if fits else (s.rule, s.keys, s.stacked))
    return out


Case = tuple[tuple[MapRule, ...], str, tuple[int, ...], Fused | None, str]


def regex_cases(seed: int) -> list[Case]:
    """Random rules, and 300 (rules, unit name, shape, fused dim, HF key) to try them on."""
    rng = random.Random(seed)
    rules = tuple(_random_rule(rng, ["i", "e", "b"]) for _ in range(rng.randint(1, 12)))
    targets = [r.target for r in rules]
    keys = [r.hf for r in rules]
    keys += [k.replace("{s}", "7") for k in keys]
    out: list[Case] = []
    for _ in range(300):
        name = _random_name(rng, targets)
        shape = rng.choice([(), (3,), (2, 4), (2, 8, 4)])
        fused = None
        if len(shape) > 1 and rng.random() < 0.5:  # name one component of a fused dim
            name += "." + rng.choice(["gate", "up"])
            fused = Fused(rng.randrange(len(shape)), COMPONENTS, rng.choice([1, 2]))
        out.append((rules, name, shape, fused, _random_name(rng, keys)))
    return out


@pytest.mark.parametrize("seed", range(30))
def test_sources_and_consumers_match_every_regex(seed: int) -> None:
    cases = regex_cases(seed)
    hfmap = HFMap(cases[0][0])
    for rules, name, shape, fused, key in cases:
        got = defined(hfmap.sources(name, shape, fused), shape)
        assert got == defined(oracle_sources(rules, name, shape, fused), shape), name
        assert hfmap.consumers(key) == oracle_consumers(rules, key), key


def test_the_regex_cases_reach_every_path() -> None:
    """The random rules above make plain, stacked and split sources (some with the fused
    dimension moved by a transpose), and consumers with and without a stack index."""
    kinds: set[str] = set()
    for seed in range(30):
        for rules, name, shape, fused, key in regex_cases(seed):
            for s in oracle_sources(rules, name, shape, fused):
                kinds.add("split" if s.split else "stacked" if s.stacked else "plain")
                if s.split and fused and s.split.dim != fused[0] - s.stacked:
                    kinds.add("moved")
            for _, _, index in oracle_consumers(rules, key):
                kinds.add("consumer" if index is None else "stack index")
    assert kinds == {"plain", "stacked", "split", "moved", "consumer", "stack index"}
