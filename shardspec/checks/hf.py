"""Checks on a spec's ``hf { ... }`` block: how a Hugging Face checkpoint maps onto the
model's storage units.

* :func:`check_hf_items` needs nothing but the spec (SS070 malformed items);
* :func:`check_hf_units` needs the model manifest (units produced once, transforms that
  apply, rules that produce something, config names);
* with an HF manifest as well, keys (unexpected, missing), shapes and config values.

Findings are grouped (one per rule, or per name shape such as ``model.layers.N.x``) and
capped, so a checkpoint with thousands of unexpected keys prints a screenful, not thousands.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace

from shardspec import ir
from shardspec.checks.registry import diag
from shardspec.diagnostics import Diagnostic, Span
from shardspec.hfmanifest import HFManifest, HFManifestError, load_hf_manifest
from shardspec.hfmap import HFMap, Source, transform_problem, unit_names
from shardspec.hfresolve import (
    build_hfmap,
    glob_problem,
    hf_manifest_path,
    key_problem,
    template_problem,
)
from shardspec.resolve import Resolved

MAX_GROUPS = 20  # findings of one kind before the rest is summed up in one more
_DIGITS = re.compile(r"[0-9]+")


def _more(names: list[str], limit: int = 1) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def _shape(shape: tuple[int, ...]) -> str:
    return str(list(shape))


# ------------------------------------------------------------------------ the HF manifest


def load_spec_hf_manifest(spec: ir.Spec) -> tuple[HFManifest | None, list[Diagnostic]]:
    """The HF manifest an ``hf "FILE"`` block names, or ``None`` with an SS002 (cannot be
    read) or SS003 (malformed) finding at the file name."""
    path = hf_manifest_path(spec)
    if path is None or spec.hf is None:
        return None, []
    span = spec.hf.manifest_span or spec.hf.span
    try:
        return load_hf_manifest(path), []
    except HFManifestError as e:
        if e.code == "SS002":
            hint = (
                "the path is relative to the spec's folder; create it with "
                "`shardspec hf-manifest HF_DIR -o FILE`"
            )
            return None, [diag("SS002", str(e), span, hint)]
        where = path if (e.line, e.col) == (1, 1) else f"{path}:{e.line}:{e.col}"
        hint = "regenerate it with `shardspec hf-manifest HF_DIR -o FILE`"
        return None, [diag("SS003", f"{where}: {e}", span, hint)]


# ------------------------------------------------------------------------ SS070: the items


def check_hf_items(spec: ir.Spec) -> tuple[list[Diagnostic], set[int]]:
    """SS070 for malformed items; returns the findings and the map lines (indices into
    ``spec.hf.maps``) that take no further part."""
    hf = spec.hf
    assert hf is not None
    out: list[Diagnostic] = []
    bad: set[int] = set()
    for i, m in enumerate(hf.maps):
        for side, pat in (("Hugging Face name", m.hf), ("target", m.target)):
            why = template_problem(pat.text)
            if why:
                out.append(diag("SS070", f"{side} {pat.text!r}: {why}", pat.span, _TEMPLATE_HINT))
                bad.add(i)
    hfmap = build_hfmap(hf)
    for i, why in hfmap.problems():
        if i in bad:
            continue
        m = hf.maps[i]
        span = m.span
        if why.startswith("rope"):
            span = next((t.span for t in m.transforms if t.kind == "rope"), m.span)
        elif "stack index" in why and m.stack is not None:
            span = m.stack.span
        out.append(diag("SS070", why, span, _CAPTURE_HINT))
        bad.add(i)
    for kind, items in (("drop", hf.drops), ("keep", hf.keeps)):
        for g in items:
            why = glob_problem(g.pattern.text)
            if why:
                out.append(
                    diag("SS070", f"{kind} {g.pattern.text!r}: {why}", g.pattern.span, _GLOB_HINT)
                )
    aliases: dict[str, ir.HFTie] = {}
    for t in hf.ties:
        why = key_problem(t.alias.text) or key_problem(t.source.text)
        if why:
            out.append(diag("SS070", f"tie: {why}", t.span, "write `tie ALIAS = SOURCE`"))
        elif t.alias.text == t.source.text:
            out.append(diag("SS070", f"tie {t.alias.text!r} to itself", t.span, "delete the tie"))
        elif t.alias.text in aliases:
            first = aliases[t.alias.text]
            out.append(
                diag(
                    "SS070",
                    f"{t.alias.text!r} is tied twice (first at line {first.span.line})",
                    t.alias.span,
                    "an alias is the same tensor as one source: keep one tie",
                )
            )
        aliases.setdefault(t.alias.text, t)
    for t in hf.ties:
        if t.source.text in aliases and t.source.text != t.alias.text:
            other = aliases[t.source.text]
            out.append(
                diag(
                    "SS070",
                    f"tie source {t.source.text!r} is itself an alias (line {other.span.line})",
                    t.source.span,
                    f"tie to {other.source.text!r} directly",
                )
            )
    seen: dict[str, ir.HFConfig] = {}
    for c in hf.configs:
        if c.name.text in seen:
            out.append(
                diag(
                    "SS070",
                    f"config {c.name.text!r} is bound twice "
                    f"(first at line {seen[c.name.text].span.line})",
                    c.name.span,
                    "keep one binding",
                )
            )
        seen.setdefault(c.name.text, c)
    return out, bad


_TEMPLATE_HINT = (
    "a map line names tensors literally, with `{name}` captures for the parts that vary: "
    "`model.layers.{i}.mlp.up_proj.weight -> layers.{i}.feed_forward.w13.weight.up`"
)
_CAPTURE_HINT = (
    "both sides must use the same `{captures}`, and a stack index `[e]` must be a capture "
    "of the Hugging Face name only"
)
_GLOB_HINT = "`*` matches one segment (or part of one), `**` any number of segments"


# ---------------------------------------------------------------------- units and HF keys


@dataclass
class _Unit:
    name: str
    shape: tuple[int, ...]
    fqn: str  # the manifest parameter it comes from
    rule: int  # the spec rule that places that parameter


@dataclass
class _Facts:
    units: dict[str, _Unit] = field(default_factory=dict)
    source: dict[str, Source] = field(default_factory=dict)  # unit -> its one source
    needed: dict[str, tuple[int, str]] = field(default_factory=dict)  # key -> (rule, unit)
    used: set[int] = field(default_factory=set)  # map lines that produce some unit
    unsized: set[str] = field(default_factory=set)  # units whose transforms do not apply


def _units(res: Resolved) -> dict[str, _Unit]:
    """Every storage unit of the placed parameters, from their layouts."""
    units: dict[str, _Unit] = {}
    done: set[tuple[int, str]] = set()
    for fqn, m in res.params:
        if m.layout is None or m.winner is None:
            continue
        glob = res.globs.get(m.winner)
        if glob is None:
            continue
        virtual = [d.name for d in m.layout.dims if d.virtual]
        spans: list[tuple[int, int]] = []
        if virtual:
            found = glob.regex.match(fqn)
            if found is None:  # pragma: no cover - the rule matched it
                continue
            spans = [found.span(v) for v in virtual]
            # Every module behind a virtual dim stands for all of its global indices.
            key = fqn
            for s, e in sorted(spans, reverse=True):
                key = key[:s] + "{}" + key[e:]
            if (m.winner, key) in done:
                continue
            done.add((m.winner, key))
        for name, shape in unit_names(fqn, m.layout.dims, spans):
            units.setdefault(name, _Unit(name, shape, fqn, m.winner))
    return units


def _group_key(name: str) -> str:
    return _DIGITS.sub("N", name)


def _entry_span(res: Resolved, fqn: str) -> Span:
    assert res.manifest is not None
    line, col = res.manifest.position(fqn)
    return Span(res.manifest.path, line, col, line, col + len(fqn) + 2)


def check_hf_units(
    res: Resolved, hf_manifest: HFManifest | None, bad: set[int]
) -> list[Diagnostic]:
    """SS071-SS078 (those that need a manifest); SS073-SS075 and config values need the
    HF manifest too."""
    spec = res.spec
    hf = spec.hf
    assert hf is not None and res.manifest is not None
    full = build_hfmap(hf)
    # Only sound map lines take part (hfmap cannot fill a template whose captures differ
    # from its other side's); indices are translated back to the spec's map lines.
    good = [i for i in range(len(full.rules)) if i not in bad]
    hfmap = HFMap(tuple(full.rules[i] for i in good), full.drops, full.ties, full.keeps)
    out: list[Diagnostic] = []
    facts = _Facts(units=_units(res))
    not_produced: dict[str, list[_Unit]] = defaultdict(list)
    twice: dict[tuple[int, ...], list[str]] = defaultdict(list)
    transform_bad: dict[tuple[int, str], list[str]] = defaultdict(list)
    prefixes = [_literal_prefix(r.target) for r in hfmap.rules]
    for name, unit in sorted(facts.units.items()):
        if hfmap.kept(name):
            continue
        found = _sources(hfmap, prefixes, name, unit.shape)
        srcs = [replace(s, rule=good[s.rule]) for s in found]
        if not srcs:
            not_produced[_group_key(name)].append(unit)
            continue
        facts.used.update(s.rule for s in srcs)
        if len(srcs) > 1:
            twice[tuple(sorted(s.rule for s in srcs))].append(name)
            continue
        (src,) = srcs
        facts.source[name] = src
        rule = full.rules[src.rule]
        slice_shape = unit.shape[1:] if src.stacked else unit.shape
        why = transform_problem(slice_shape, rule.transforms)
        if why:
            transform_bad[(src.rule, why)].append(name)
            facts.unsized.add(name)
        for k in src.keys:
            facts.needed.setdefault(k, (src.rule, name))
    out += _report_not_produced(res, not_produced)
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
    unknown = _check_config_names(res, hf)
    out += unknown
    if hf_manifest is not None:
        out += _check_keys(res, hfmap, hf_manifest, facts)
        named = [c for c in hf.configs if not any(d.span == c.name.span for d in unknown)]
        out += _check_config_values(res, named, hf_manifest)
    return out


def _literal_prefix(template: str) -> str:
    return template.split("{", 1)[0]


def _sources(hfmap: HFMap, prefixes: list[str], name: str, shape: tuple[int, ...]) -> list[Source]:
    """``hfmap.sources`` with the rules whose literal prefix cannot match skipped first."""
    if not any(name.startswith(p) for p in prefixes):
        return []
    return hfmap.sources(name, shape)


def _report_not_produced(res: Resolved, groups: dict[str, list[_Unit]]) -> list[Diagnostic]:
    out = []
    items = sorted(groups.items(), key=lambda kv: kv[1][0].name)
    for _, units in items[:MAX_GROUPS]:
        first = units[0]
        more = f" (and {len(units) - 1} more like it)" if len(units) > 1 else ""
        out.append(
            diag(
                "SS071",
                f"storage unit {first.name!r} {_shape(first.shape)} is produced by no hf map "
                f"line{more}",
                _entry_span(res, first.fqn),
                f"add a map line `HF_NAME -> {_template_of(first.name)}`, or `keep` it if the "
                "Hugging Face checkpoint has no such tensor",
            )
        )
    rest = items[MAX_GROUPS:]
    if rest:
        n = sum(len(u) for _, u in rest)
        first = rest[0][1][0]
        out.append(
            diag(
                "SS071",
                f"{n} more storage units are produced by no hf map line, such as {first.name!r}",
                _entry_span(res, first.fqn),
                "map them, or `keep` them",
            )
        )
    return out


def _template_of(name: str) -> str:
    return _DIGITS.sub("{i}", name, count=1)


def _check_keys(res: Resolved, hfmap: HFMap, hfm: HFManifest, facts: _Facts) -> list[Diagnostic]:
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
                f"HF key {_more(keys)} has shape {_shape(got)}, line {m.span.line} expects "
                f"{_shape(expected)}",
                m.hf.span,
                "the expected shape is the unit's, inverted through the transforms "
                "(and without the stacked first dimension for `[e]`)",
            )
        )
    unexpected: dict[str, list[str]] = defaultdict(list)
    prefixes = [_literal_prefix(r.hf) for r in hfmap.rules]
    for key in sorted(tensors):
        if key in facts.needed or key in read:
            continue
        if hfmap.tie_of(key) is not None or hfmap.dropped(key):
            continue
        if _consumed(hfmap, prefixes, key, facts):
            continue
        unexpected[_group_key(key)].append(key)
    groups = sorted(unexpected.values(), key=lambda ks: ks[0])
    for keys in groups[:MAX_GROUPS]:
        more = f" (and {len(keys) - 1} more like it)" if len(keys) > 1 else ""
        out.append(
            diag(
                "SS073",
                f"unexpected HF key {keys[0]!r}{more}: no map line consumes it",
                _key_span(hfm, keys[0]),
                "map it (`HF_NAME -> UNIT`), `drop` it, or `tie` it to the key it duplicates",
            )
        )
    rest = groups[MAX_GROUPS:]
    if rest:
        n = sum(len(k) for k in rest)
        out.append(
            diag(
                "SS073",
                f"{n} more unexpected HF keys, such as {rest[0][0]!r}",
                _key_span(hfm, rest[0][0]),
                "map them, or `drop` them",
            )
        )
    return out


def _consumed(hfmap: HFMap, prefixes: list[str], key: str, facts: _Facts) -> bool:
    """A rule reads ``key`` for a real unit (with a stack index inside its first dim)."""
    if not any(key.startswith(p) for p in prefixes):
        return False
    for _, unit, index in hfmap.consumers(key):
        u = facts.units.get(unit)
        if u is None:
            continue
        if index is None or (u.shape and 0 <= index < u.shape[0]):
            return True
    return False


def _key_span(hfm: HFManifest, key: str) -> Span:
    line, col = hfm.position(key)
    return Span(hfm.path, line, col, line, col + len(key) + 2)


# ------------------------------------------------------------------------------ config


def _sizes(res: Resolved, name: str) -> list[tuple[int, str]]:
    """(global size, parameter) of dimension or component ``name``, per placed parameter."""
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


def _check_config_names(res: Resolved, hf: ir.HFBlock) -> list[Diagnostic]:
    names = {d.text for r in res.spec.rules for d in r.dims}
    names |= {c.name.text for r in res.spec.rules for f in r.fusions for c in f.components}
    out = []
    for c in hf.configs:
        if c.name.text not in names:
            out.append(
                diag(
                    "SS077",
                    f"config {c.name.text!r} names no dimension or fused component of any rule",
                    c.name.span,
                    "bind a rule's dimension name (`hidden`) or component name (`q`, `gate`)",
                )
            )
    return out


def _check_config_values(
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
            sizes = _sizes(res, c.name.text)
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


# ------------------------------------------------------------------------------ no file


def no_hf_manifest(spec: ir.Spec) -> list[Diagnostic]:
    """SS079 when the hf block names no HF manifest."""
    hf = spec.hf
    if hf is None or hf.manifest is not None:
        return []
    span = Span(hf.span.file, hf.span.line, hf.span.col, hf.span.line, hf.span.col + 2)
    return [
        diag(
            "SS079",
            "the hf block names no HF manifest: key, shape and config checks did not run",
            span,
            'write `hf "model.hf.json" { ... }` (made by `shardspec hf-manifest HF_DIR -o FILE`)',
        )
    ]
