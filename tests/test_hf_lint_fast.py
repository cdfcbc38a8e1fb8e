"""The hf checks' fast paths agree with the straightforward code they replaced.

``HFMap.sources``/``consumers`` look rules up by literal segments before any regex, and
``checks/hf.py:check_hf_units`` checks the units a parameter expands to (one per global
expert index) as a group. Both are compared here with a frozen copy of the per-unit code
(every rule's regex on every name, one ``Source`` per unit, findings lists sorted by name),
on many random hf blocks over one small model with local experts (indices up to 11, so
``"10" < "2"`` matters), fused components (listed out of name order), stacked experts,
keeps, drops, ties, literal digits in targets, captures inside a segment (``e{e}``,
``1{d}``), repeated captures and two parameters naming one unit; and on names and
templates made up at random.
"""

from __future__ import annotations

import math
import random
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from bench import synth
from shardspec.checks import hf as H
from shardspec.checks import run as run_mod
from shardspec.checks.coverage import entry_span
from shardspec.core.hfmap import (
    Fused,
    HFMap,
    MapRule,
    Source,
    Split,
    Transform,
    _fill,
    fused_of,
    hf_shape,
    template_captures,
    transform_problem,
    unit_names,
)
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend import ir
from shardspec.frontend.parse import parse_file
from shardspec.inputs.hfmanifest import HFManifest, dump_hf_manifest
from shardspec.inputs.manifest import dump_manifest
from shardspec.resolve.hf import build_hfmap, glob_problem
from shardspec.resolve.params import Resolved

# ------------------------------------------------------------- the reference (frozen copy)


def ref_sources(
    hfmap: HFMap, name: str, shape: Sequence[int], fused: Fused | None = None
) -> list[Source]:
    out = []
    base, _, comp = name.rpartition(".")
    for i, rule in enumerate(hfmap.rules):
        m = rule.target_regex.match(name)
        chain = rule.transforms
        if m is not None and rule.parts is None:
            caps = m.groupdict()
            if rule.stack:
                if not shape:
                    continue
                keys = tuple(_fill(rule.hf, {**caps, rule.stack: str(e)}) for e in range(shape[0]))
                out.append(Source(i, keys, hf_shape(shape[1:], chain), True, chain))
            else:
                out.append(Source(i, (_fill(rule.hf, caps),), hf_shape(shape, chain), False, chain))
            continue
        m = rule.target_regex.match(base) if fused is not None and base else None
        if m is None:
            continue
        # A split: the HF tensor is the parts one after another (unknown parts count 0).
        at, comps = fused  # type: ignore[misc]
        sizes = dict(comps)
        order = [p.name for p in rule.parts] if rule.parts is not None else [c for c, _ in comps]
        if comp not in order or (rule.stack and (at == 0 or not shape)):
            continue
        k = order.index(comp)
        part = rule.parts[k] if rule.parts is not None else None
        chain = rule.transforms + (part.transforms if part else ())
        sub = list(shape[1:] if rule.stack else shape)
        d = at - 1 if rule.stack else at
        if chain.count(Transform("transpose")) % 2 and len(sub) == 2:
            d, sub = 1 - d, sub[::-1]
        total = sum(sizes.get(p, 0) for p in order)
        start = sum(sizes.get(p, 0) for p in order[:k])
        size, sub[d] = sub[d], total
        caps = m.groupdict()
        if rule.stack:
            keys = tuple(_fill(rule.hf, {**caps, rule.stack: str(e)}) for e in range(shape[0]))
        else:
            keys = (_fill(rule.hf, caps),)
        out.append(
            Source(i, keys, tuple(sub), bool(rule.stack), chain, Split(d, start, size, total))
        )
    return out


def ref_consumers(hfmap: HFMap, hf_key: str) -> list[tuple[int, str, int | None]]:
    out = []
    for i, rule in enumerate(hfmap.rules):
        m = rule.hf_regex.match(hf_key)
        if m is None:
            continue
        caps = m.groupdict()
        index = int(caps.pop(rule.stack)) if rule.stack else None
        out.append((i, _fill(rule.target, caps), index))
    return out


@dataclass
class _Unit:
    name: str
    shape: tuple[int, ...]
    fqn: str
    rule: int
    fused: Fused | None = None


@dataclass
class _Facts:
    units: dict[str, _Unit] = field(default_factory=dict)
    source: dict[str, Source] = field(default_factory=dict)
    needed: dict[str, tuple[int, str]] = field(default_factory=dict)
    used: set[int] = field(default_factory=set)
    unsized: set[str] = field(default_factory=set)


def _more(names: list[str], limit: int = 1) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def ref_units(res: Resolved) -> dict[str, _Unit]:
    units: dict[str, _Unit] = {}
    done: set[tuple[int, str]] = set()
    for fqn, m in res.params:
        if m.layout is None or m.winner is None:
            continue
        glob = res.globs.get(m.winner)
        if glob is None:
            continue
        indexed = [d.name for d in m.layout.dims if d.name_indexed]
        spans: list[tuple[int, int]] = []
        if indexed:
            found = glob.regex.match(fqn)
            assert found is not None
            spans = [found.span(v) for v in indexed]
            key = fqn
            for s, e in sorted(spans, reverse=True):
                key = key[:s] + "{}" + key[e:]
            if (m.winner, key) in done:
                continue
            done.add((m.winner, key))
        fused = fused_of(m.layout.dims)
        for name, shape in unit_names(fqn, m.layout.dims, spans):
            units.setdefault(name, _Unit(name, shape, fqn, m.winner, fused))
    return units


def ref_check_hf_units(
    res: Resolved, hf_manifest: HFManifest | None, bad: set[int]
) -> list[Diagnostic]:
    spec = res.spec
    hf = spec.hf
    assert hf is not None and res.manifest is not None
    full = build_hfmap(hf)
    good = [i for i in range(len(full.rules)) if i not in bad]
    hfmap = HFMap(tuple(full.rules[i] for i in good), full.drops, full.ties, full.keeps)
    out: list[Diagnostic] = []
    facts = _Facts(units=ref_units(res))
    not_produced: dict[str, list[_Unit]] = defaultdict(list)
    twice: dict[tuple[int, ...], list[str]] = defaultdict(list)
    transform_bad: dict[tuple[int, str], list[str]] = defaultdict(list)
    for name, unit in sorted(facts.units.items()):
        if hfmap.kept(name):
            continue
        found = ref_sources(hfmap, name, unit.shape, unit.fused)
        srcs = [replace(s, rule=good[s.rule]) for s in found]
        if not srcs:
            not_produced[H._group_key(name)].append(unit)
            continue
        facts.used.update(s.rule for s in srcs)
        if len(srcs) > 1:
            twice[tuple(sorted(s.rule for s in srcs))].append(name)
            continue
        (src,) = srcs
        facts.source[name] = src
        slice_shape = unit.shape[1:] if src.stacked else unit.shape
        why = transform_problem(slice_shape, src.transforms)
        if why:
            transform_bad[(src.rule, why)].append(name)
            facts.unsized.add(name)
        for k in src.keys:
            facts.needed.setdefault(k, (src.rule, name))
    out += ref_report_not_produced(res, not_produced, hf_manifest)
    out += H._check_splits(res, full, bad, facts.units, hf_manifest)  # type: ignore[arg-type]
    for rules, names in sorted(twice.items()):
        maps = [hf.maps[i] for i in rules]
        lines = ", ".join(str(m.span.line) for m in maps)
        out.append(
            diag(
                "SS072",
                f"storage unit {_more(names)} is produced by {len(maps)} map lines (lines {lines})",
                maps[-1].target.span,
                "each unit comes from exactly one Hugging Face tensor: narrow or delete one",
            )
        )
    for (i, why), names in sorted(transform_bad.items()):
        m = hf.maps[i]
        out.append(
            diag(
                "SS076",
                f"{_more(names)}: {why}",
                m.transforms[0].span if m.transforms else m.span,
                "the transforms must apply to the unit's shape (and so invert on export)",
            )
        )
    for i, m in enumerate(hf.maps):
        if i not in bad and i not in facts.used:
            out.append(
                diag(
                    "SS078",
                    f"map line {m.hf.text} -> {m.target.text} produces no storage unit",
                    m.target.span,
                    "units are named `<fqn>`, `<fqn>.<component>` for a fused dimension, "
                    "with global expert indices; check the target against the manifest",
                )
            )
    for g in hf.keeps:
        if glob_problem(g.pattern.text) is not None:
            continue
        only = HFMap(keeps=(g.pattern.text,))
        if not any(only.kept(n) for n in facts.units):
            out.append(
                diag(
                    "SS078",
                    f"keep {g.pattern.text!r} matches no storage unit",
                    g.pattern.span,
                    "delete it if those parameters no longer exist",
                )
            )
    unknown = H._check_config_names(res, hf)
    out += unknown
    if hf_manifest is not None:
        out += ref_check_keys(res, hfmap, hf_manifest, facts)
        named = [c for c in hf.configs if not any(d.span == c.name.span for d in unknown)]
        out += ref_check_config_values(res, named, hf_manifest)
    return out


def ref_report_not_produced(
    res: Resolved, groups: dict[str, list[_Unit]], hfm: HFManifest | None
) -> list[Diagnostic]:
    out = []
    items = sorted(groups.items(), key=lambda kv: kv[1][0].name)
    for _, units in items[: H.MAX_GROUPS]:
        first = units[0]
        more = f" (and {len(units) - 1} more like it)" if len(units) > 1 else ""
        out.append(
            diag(
                "SS071",
                f"storage unit {first.name!r} {H._shape(first.shape)} is produced by no hf map "
                f"line{more}",
                entry_span(res, first.fqn),
                H._not_produced_hint(first, hfm),  # type: ignore[arg-type]
            )
        )
    rest = items[H.MAX_GROUPS :]
    if rest:
        n = sum(len(u) for _, u in rest)
        first = rest[0][1][0]
        out.append(
            diag(
                "SS071",
                f"{n} more storage units are produced by no hf map line, such as {first.name!r}",
                entry_span(res, first.fqn),
                "map them, or `keep` them",
            )
        )
    return out


def ref_check_keys(res: Resolved, hfmap: HFMap, hfm: HFManifest, facts: _Facts) -> list[Diagnostic]:
    hf = res.spec.hf
    assert hf is not None
    out: list[Diagnostic] = []
    tensors = hfm.tensors
    missing: dict[int, list[str]] = defaultdict(list)
    wrong: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[str]] = defaultdict(list)
    read: set[str] = set()
    for key, (i, unit) in sorted(facts.needed.items()):
        present = key if key in tensors else hfmap.tie_of(key)
        if present is None or present not in tensors:
            missing[i].append(key)
            continue
        read.add(present)
        if unit in facts.unsized:
            continue
        expected = facts.source[unit].shape
        got = tensors[present].shape
        if got != expected:
            wrong[(i, expected, got)].append(present)
    for i, keys in sorted(missing.items()):
        m = hf.maps[i]
        out.append(
            diag(
                "SS074",
                f"HF key {_more(keys)} that line {m.span.line} needs is not in the HF manifest",
                m.hf.span,
                "check the Hugging Face name against the HF manifest (a tied key may be "
                "absent when its `tie` source is there)",
            )
        )
    for (i, expected, got), keys in sorted(wrong.items()):
        m = hf.maps[i]
        out.append(
            diag(
                "SS075",
                f"HF key {_more(keys)} has shape {H._shape(got)}, line {m.span.line} expects "
                f"{H._shape(expected)}",
                m.hf.span,
                "the expected shape is the unit's, inverted through the transforms "
                "(and without the stacked first dimension for `[e]`)",
            )
        )
    unexpected: dict[str, list[str]] = defaultdict(list)
    for key in sorted(tensors):
        if key in facts.needed or key in read:
            continue
        if hfmap.tie_of(key) is not None or hfmap.dropped(key):
            continue
        if ref_consumed(hfmap, key, facts):
            continue
        unexpected[H._group_key(key)].append(key)
    groups = sorted(unexpected.values(), key=lambda ks: ks[0])
    for keys in groups[: H.MAX_GROUPS]:
        more = f" (and {len(keys) - 1} more like it)" if len(keys) > 1 else ""
        out.append(
            diag(
                "SS073",
                f"unexpected HF key {keys[0]!r}{more}: no map line consumes it",
                H._key_span(hfm, keys[0]),
                "map it (`HF_NAME -> UNIT`), `drop` it, or `tie` it to the key it duplicates",
            )
        )
    rest = groups[H.MAX_GROUPS :]
    if rest:
        n = sum(len(k) for k in rest)
        out.append(
            diag(
                "SS073",
                f"{n} more unexpected HF keys, such as {rest[0][0]!r}",
                H._key_span(hfm, rest[0][0]),
                "map them, or `drop` them",
            )
        )
    return out


def ref_consumed(hfmap: HFMap, key: str, facts: _Facts) -> bool:
    for _, unit, index in ref_consumers(hfmap, key):
        u = facts.units.get(unit)
        if u is None:  # the name of a fused parameter that a line splits
            u = next(
                (v for n, v in facts.units.items() if v.fused and n.rpartition(".")[0] == unit),
                None,
            )
        if u is None:
            continue
        if index is None or (u.shape and 0 <= index < u.shape[0]):
            return True
    return False


def ref_sizes(res: Resolved, name: str) -> list[tuple[int, str]]:
    out = []
    for fqn, m in res.params:
        if m.layout is None:
            continue
        for d in m.layout.dims:
            if d.name == name:
                out.append((d.size, fqn))
            if d.fusion is not None:
                for comp, size in d.fusion.components:
                    if comp == name:
                        out.append((size * d.fusion.groups, fqn))
    return out


def ref_check_config_values(
    res: Resolved, configs: list[ir.HFConfig], hfm: HFManifest
) -> list[Diagnostic]:
    out = []
    for c in configs:
        values: list[int] = []
        for f in c.factors:
            if f.number is not None:
                values.append(f.number)
                continue
            if f.text not in hfm.config:
                out.append(
                    diag(
                        "SS077",
                        f"config.json has no key {f.text!r}",
                        f.span,
                        "the keys are those of the HF manifest's config (config.json)",
                    )
                )
                break
            v = hfm.config[f.text]
            if not isinstance(v, int) or isinstance(v, bool):
                out.append(
                    diag(
                        "SS077",
                        f"config.json's {f.text!r} is {v!r}, not a whole number",
                        f.span,
                        "a binding multiplies whole numbers",
                    )
                )
                break
            values.append(v)
        else:
            value = math.prod(values)
            sizes = ref_sizes(res, c.name.text)
            off = [(s, fqn) for s, fqn in sizes if s != value]
            if off:
                s, fqn = off[0]
                more = f" (and {len(off) - 1} more)" if len(off) > 1 else ""
                shown = " * ".join(f.text for f in c.factors)
                out.append(
                    diag(
                        "SS077",
                        f"config {c.name.text} = {shown} = {value}, but {fqn!r}{more} has "
                        f"{c.name.text} of {s}",
                        c.span,
                        "the model and the Hugging Face config disagree: check the model's "
                        "sizes, or the binding",
                    )
                )
    return out


# ------------------------------------------------------------------- running both on a spec


def both(spec_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list, list, list[int]]:
    """(fast findings, reference findings, the counts the fast path checked units in)."""
    calls: list[tuple[Any, ...]] = []

    def capture(res: Resolved, hfm: HFManifest | None, bad: set[int]) -> list[Diagnostic]:
        calls.append((res, hfm, bad))
        return []

    counts: list[int] = []
    unit = H._Acc.unit

    def counting(self: Any, g: Any, name: str, count: int, *a: Any) -> None:
        counts.append(count)
        unit(self, g, name, count, *a)

    spec, diags = parse_file(spec_path)
    assert spec is not None, diags
    with monkeypatch.context() as mp:
        mp.setattr(run_mod, "check_hf_units", capture)
        run_mod.check(spec)
    assert len(calls) == 1
    res, hfm, bad = calls[0]
    with monkeypatch.context() as mp:
        mp.setattr(H._Acc, "unit", counting)
        fast = H.check_hf_units(res, hfm, set(bad))
    return fast, ref_check_hf_units(res, hfm, set(bad)), counts


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
    clash = n % 7 == 3
    with_file = n % 5 != 4
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
    d = tmp / f"case{n}"
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


@pytest.mark.parametrize("n", range(40))
def test_random_blocks_match_the_reference(
    n: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = write_case(tmp_path, random.Random(n), n)
    fast, ref, _ = both(spec, monkeypatch)
    assert fast == ref


def test_the_cases_reach_every_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The random cases above check groups both ways, and find every kind of finding."""
    codes: set[str] = set()
    grouped = single = 0
    for n in range(40):
        fast, _, counts = both(write_case(tmp_path, random.Random(n), n), monkeypatch)
        codes |= {d.code for d in fast}
        grouped += sum(c > 1 for c in counts)
        single += sum(c == 1 for c in counts)
    assert codes >= {"SS071", "SS072", "SS073", "SS074", "SS075", "SS076", "SS077", "SS078"}
    assert grouped and single


def test_clean_block_is_clean_and_grouped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = write_case(tmp_path, None, 0)
    fast, ref, counts = both(spec, monkeypatch)
    assert fast == ref == []
    assert EXPERTS in counts  # a parameter's expert units checked as one group


@pytest.mark.parametrize("with_file", [True, False])
def test_synthetic_benchmark_model(
    with_file: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = synth.config_for(200)
    spec = synth.write_hf(cfg, tmp_path, hf_manifest=with_file)
    fast, ref, counts = both(spec, monkeypatch)
    assert fast == ref == []
    assert sum(counts) == cfg.n_units


# ------------------------------------------------------------- HFMap against every regex

SEGMENTS = ["model", "layers", "0", "1", "12", "w1", "w12", "experts", "gate", "x", "weight"]


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


@pytest.mark.parametrize("seed", range(30))
def test_sources_and_consumers_match_every_regex(seed: int) -> None:
    rng = random.Random(seed)
    caps = ["i", "e", "b"]
    rules = []
    for _ in range(rng.randint(1, 12)):
        target = _random_template(rng, caps)
        hf = _random_template(rng, caps)
        # Sound rules only (both sides the same captures), as lint lets through.
        both_caps = set(template_captures(target)) | set(template_captures(hf))
        target += "".join(f".{{{c}}}" for c in sorted(both_caps - set(template_captures(target))))
        hf += "".join(f".{{{c}}}" for c in sorted(both_caps - set(template_captures(hf))))
        stack = "s" if rng.random() < 0.2 else None
        if stack:
            hf += ".{s}"
        rules.append(MapRule(hf, target, stack))
    hfmap = HFMap(tuple(rules))
    targets = [r.target for r in rules]
    sources = [r.hf for r in rules]
    for _ in range(300):
        name = _random_name(rng, targets)
        shape = rng.choice([(), (3,), (2, 4)])
        assert hfmap.sources(name, shape) == ref_sources(hfmap, name, shape), name
        key = _random_name(rng, [s.replace("{s}", "7") for s in sources] + sources)
        assert hfmap.consumers(key) == ref_consumers(hfmap, key), key
