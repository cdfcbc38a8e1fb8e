"""What ``shardspec diff OLD NEW`` finds out about a spec change, as typed values: how the
mesh changes, how each parameter's layout changes (grouped: every parameter with the same
change once), whether a checkpoint saved under OLD loads under NEW, and how the ``hf``
block's mapping changes. :mod:`shardspec.diff.render` writes them as text or JSON;
nothing here formats output.

The checkpoint verdict follows what ``load`` validates before it reads a byte
(``shardspec.runtime.checkpoint.planners``): DCP reshards any chunking, so only the stored
keys, their global shapes and dtypes matter. A key NEW stores that the checkpoint lacks is
*missing*, except a fused parameter's component read from the whole tensor a checkpoint
stored (load's fallback); a key the checkpoint holds that NEW neither stores nor ignores
is *unexpected*; shapes and dtypes must be equal. Pipeline stages do not enter: keys are
global names on every stage. The optimizer state is stored under its parameter's keys, so
the verdict covers it too.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum

from shardspec.api import lint_specs
from shardspec.checks.hf import stored_units
from shardspec.checks.keys import component_key, spec_key_layout, squeezed
from shardspec.checks.layouts import rule_styles
from shardspec.core.hfmap import Fused, Source
from shardspec.core.layout import (
    Mesh,
    ParamLayout,
    dtensor_mesh,
    dtensor_placements,
    local_indices,
    ranges_len,
    sampled_table,
)
from shardspec.core.paramtable import split_name
from shardspec.explain.facts import no_manifest
from shardspec.explain.render import _dim_text, _placement_text
from shardspec.findings.diagnostics import Diagnostic
from shardspec.inputs.manifest import Manifest
from shardspec.resolve.hf import build_hfmap
from shardspec.resolve.params import Match, Resolved


class Status(IntEnum):
    """``shardspec diff``'s exit status."""

    SAME = 0  # no change in layout, checkpoint keys or the hf mapping
    CHANGED = 1  # something changed; checkpoints saved under OLD load under NEW
    INCOMPATIBLE = 2  # a checkpoint (DCP, or a Hugging Face one) saved/loaded under OLD does not
    ERROR = 3  # a spec (or the command line) has errors: nothing compared


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Refusal:
    """Why diff compares nothing: the findings (lint's, with their sources)."""

    diagnostics: tuple[Diagnostic, ...]
    sources: dict[str, str] = field(repr=False)


@dataclass(frozen=True)
class MeshChange:
    """One change of the mesh: ``subject`` (``axis tp``, ``world``, ``fsdp``, ``view
    expert``, ``pipeline``) from ``old`` to ``new`` (None: absent on that side)."""

    subject: str
    old: str | None
    new: str | None


@dataclass(frozen=True)
class Side:
    """One parameter's layout under one spec. ``state``: ``placed``, or why it has none
    (``ignored``, ``absent``: not in the manifest, ``unplaced``: no rule)."""

    state: str
    mesh: str = ""
    dims: str = ""
    axes: tuple[tuple[str, str], ...] = ()  # per mesh axis: its placement
    dtensor: str = ""
    rank: int = 0  # the representative rank: the first on the parameter's stage
    local_shape: tuple[int, ...] = ()
    shapes: tuple[tuple[tuple[int, ...], int], ...] = ()  # every local shape, with its count
    stage: str = ""
    style: str = ""
    note: str = ""


@dataclass(frozen=True)
class ParamChange:
    """Parameters whose layout changes alike: their globs (each with its count), and
    their layout before and after."""

    globs: tuple[tuple[str, int], ...]
    count: int
    old: Side
    new: Side

    @property
    def axis_changes(self) -> tuple[tuple[str, str, str], ...]:
        """``(axis, old placement, new placement)`` for every axis whose placement
        changes (``-``: the axis is not on that side's mesh)."""
        old, new = dict(self.old.axes), dict(self.new.axes)
        names = list(dict.fromkeys([*old, *new]))
        return tuple(
            (a, old.get(a, "-"), new.get(a, "-")) for a in names if old.get(a) != new.get(a)
        )


@dataclass(frozen=True)
class Problem:
    """Checkpoint keys that do not load alike: ``kind`` (``missing``, ``unexpected``,
    ``shape``, ``dtype``), the keys' globs, and why."""

    kind: str
    globs: tuple[tuple[str, int], ...]
    count: int
    why: str


@dataclass(frozen=True)
class HFChange:
    """Storage units whose Hugging Face sources change alike."""

    globs: tuple[tuple[str, int], ...]
    count: int
    old: str  # the sources under OLD ("-": none)
    new: str


@dataclass(frozen=True)
class HFFacts:
    """How the hf block changes: its lines, the units read differently, the HF keys only
    one side reads (and writes, on export), and what keeps an HF checkpoint that loaded
    under OLD from loading under NEW."""

    removed_lines: tuple[str, ...] = ()
    added_lines: tuple[str, ...] = ()
    units: tuple[HFChange, ...] = ()
    keys_only_old: tuple[tuple[str, int], ...] = ()
    keys_only_new: tuple[tuple[str, int], ...] = ()
    problems: tuple[Problem, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(
            self.removed_lines
            or self.added_lines
            or self.units
            or self.keys_only_old
            or self.keys_only_new
        )


@dataclass(frozen=True)
class SpecDiff:
    """Everything diff shows about OLD -> NEW."""

    old_path: str
    new_path: str
    mesh: tuple[MeshChange, ...]
    params: tuple[ParamChange, ...]
    unchanged: int  # parameters whose layout stays the same
    checkpoint: tuple[Problem, ...]
    fallbacks: tuple[tuple[str, int], ...]  # components NEW reads from a whole stored tensor
    hf: HFFacts | None  # None: neither spec has an hf block
    # `checkpoint keys`: the key layouts save and load use by default, OLD and NEW, where
    # they differ (None: the same).
    keys: tuple[str, str] | None = None

    @property
    def status(self) -> Status:
        hf_bad = self.hf is not None and bool(self.hf.problems)
        if self.checkpoint or hf_bad:
            return Status.INCOMPATIBLE
        hf_changed = self.hf is not None and self.hf.changed
        if self.mesh or self.params or self.fallbacks or hf_changed or self.keys:
            return Status.CHANGED
        return Status.SAME


# ----------------------------------------------------------------------------- names


def globs_of(names: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """Names summarized as globs with counts: names that differ only in numbers share one
    (``layers.*.attention.wq.weight``, a number that differs written ``*``), sorted."""
    by_skeleton: dict[str, list[tuple[int, ...]]] = defaultdict(list)
    for name in names:
        skeleton, values = split_name(name)
        by_skeleton[skeleton].append(values)
    out = []
    for skeleton, numbers in by_skeleton.items():
        slots = [
            str(column[0]) if len(set(column)) == 1 else "*"
            for column in zip(*numbers, strict=True)
        ]
        text = skeleton.replace("{}", "\0").replace("{{", "{").replace("}}", "}")
        for s in slots:
            text = text.replace("\0", s, 1)
        out.append((text, len(numbers)))
    return tuple(sorted(out))


# ----------------------------------------------------------------------------- computing


def diff_specs(
    old: str,
    new: str,
    sizes: dict[str, int] | None = None,
    world: int | None = None,
    manifest: Manifest | None = None,
) -> SpecDiff | Refusal:
    """Compare spec ``old`` with spec ``new`` (both checked as lint checks them, with the
    ``-D`` values ``sizes``/``world`` and, where given, ``manifest`` in place of the one
    each names). A spec with errors, or without a manifest, gives a :class:`Refusal`."""
    results, outcome = lint_specs([old, new], sizes, world, manifest)
    # (once each: OLD and NEW may be one file, or name one manifest)
    errors = tuple(dict.fromkeys(d for d in outcome.diagnostics if d.is_error))
    if errors:
        return Refusal(errors, outcome.sources)
    (old_shown, a), (new_shown, b) = results
    assert a is not None and b is not None
    missing = tuple(
        no_manifest(shown, "diff", ", or pass -m FILE")
        for shown, r in results
        if r and r.manifest is None
    )
    if missing:
        return Refusal(missing, outcome.sources)
    params, unchanged = _param_changes(a, b)
    checkpoint, fallbacks = _checkpoint(a, b)
    return SpecDiff(
        old_shown,
        new_shown,
        _mesh_changes(a, b),
        params,
        unchanged,
        checkpoint,
        fallbacks,
        _hf_facts(a, b),
        _key_layouts(a, b),
    )


def _key_layouts(a: Resolved, b: Resolved) -> tuple[str, str] | None:
    """OLD's and NEW's `checkpoint keys` where they differ."""
    old, new = spec_key_layout(a.spec), spec_key_layout(b.spec)
    return (old, new) if old != new else None


# ----------------------------------------------------------------------------- the mesh


def _mesh_text(mesh: Mesh) -> str:
    return ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes, strict=True))


def _views(res: Resolved) -> dict[str, tuple[Mesh, str | None]]:
    """Each view's mesh and fsdp axis (a spec with one unnamed mesh: one view, ``""``)."""
    if res.views is None:
        return {}
    if not res.spec.views:
        assert res.mesh is not None
        return {"": (res.mesh, res.views.fsdp_of(res.views.default))}
    return {v: (res.view_meshes[v], res.views.fsdp_of(v)) for v in res.views.names}


def _mesh_changes(a: Resolved, b: Resolved) -> tuple[MeshChange, ...]:
    out: list[MeshChange] = []
    va, vb = _views(a), _views(b)
    wa = next(iter(va.values()))[0].world if va else None
    wb = next(iter(vb.values()))[0].world if vb else None
    if wa != wb:
        out.append(MeshChange("world", str(wa), str(wb)))
    for view in dict.fromkeys([*va, *vb]):
        where = f"view {view} " if view else ""
        if view not in va or view not in vb:
            pa, pb = va.get(view), vb.get(view)
            out.append(
                MeshChange(
                    f"view {view}" if view else "mesh (unnamed)",
                    _mesh_text(pa[0]) if pa else None,
                    _mesh_text(pb[0]) if pb else None,
                )
            )
            continue
        (ma, fa), (mb, fb) = va[view], vb[view]
        sa = dict(zip(ma.names, ma.sizes, strict=True))
        sb = dict(zip(mb.names, mb.sizes, strict=True))
        for axis in dict.fromkeys([*ma.names, *mb.names]):
            if sa.get(axis) != sb.get(axis):
                old = str(sa[axis]) if axis in sa else None
                new = str(sb[axis]) if axis in sb else None
                out.append(MeshChange(f"{where}axis {axis}", old, new))
        if [n for n in ma.names if n in sb] != [n for n in mb.names if n in sa]:
            out.append(MeshChange(f"{where}axis order", _mesh_text(ma), _mesh_text(mb)))
        if fa != fb:
            out.append(MeshChange(f"{where}fsdp", fa, fb))
    stages_a, stages_b = _pipeline_text(a), _pipeline_text(b)
    if stages_a != stages_b:
        out.append(MeshChange("pipeline", stages_a, stages_b))
    return tuple(out)


def _pipeline_text(res: Resolved) -> str | None:
    p = res.pipeline
    if p is None:
        return None
    sizes = res.axis_sizes
    return f"{sizes.get(p.axis, '?')} stages over {p.axis}"


# ----------------------------------------------------------------------------- parameters


def _param_changes(a: Resolved, b: Resolved) -> tuple[tuple[ParamChange, ...], int]:
    """Every parameter and buffer of either manifest whose layout differs, grouped."""
    sides_a, sides_b = _Sides(a), _Sides(b)
    groups: dict[tuple[Side, Side], list[str]] = defaultdict(list)
    unchanged = 0
    names = dict.fromkeys([*a.matches, *b.matches])
    for fqn in names:
        ma, mb = a.matches.get(fqn), b.matches.get(fqn)
        if _kind(ma, mb) == "extra_state":
            continue
        sa, sb = sides_a.of(ma), sides_b.of(mb)
        if sa == sb:
            unchanged += 1
        else:
            groups[(sa, sb)].append(fqn)
    changes = [ParamChange(globs_of(fqns), len(fqns), sa, sb) for (sa, sb), fqns in groups.items()]
    changes.sort(key=lambda c: c.globs)
    return tuple(changes), unchanged


def _kind(ma: Match | None, mb: Match | None) -> str:
    m = ma if ma is not None else mb
    assert m is not None
    return m.entry.kind


class _Sides:
    """Each parameter's :class:`Side` under one spec, computed once per distinct layout."""

    def __init__(self, res: Resolved) -> None:
        self.res = res
        self.styles = rule_styles(res)
        self.cache: dict[tuple, Side] = {}

    def of(self, m: Match | None) -> Side:
        res = self.res
        if m is None:
            return Side("absent", note="not in the manifest")
        if m.ignored_by is not None:
            return Side("ignored", note=f"ignore {res.spec.ignores[m.ignored_by].pattern.text}")
        mesh = res.mesh_for(m)
        if m.layout is None or mesh is None:
            return Side("unplaced", note="no rule places it")
        key = (m.layout, mesh, m.winner, m.entry.dtype)
        side = self.cache.get(key)
        if side is None:
            side = self.cache[key] = self._side(m, m.layout, mesh)
        return side

    def _side(self, m: Match, layout: ParamLayout, mesh: Mesh) -> Side:
        res = self.res
        view = ""
        if res.spec.views and res.views is not None:
            view = res.rule_views.get(m.winner, res.views.default) if m.winner is not None else ""
            view = view or res.views.default
        sub = dtensor_mesh(layout, mesh)
        over_stage = layout.stage_axis in layout.axes
        placements = () if over_stage else dtensor_placements(layout, mesh)
        by_axis = dict(zip(sub.names, map(_placement_text, placements), strict=False))
        axes = []
        for axis in mesh.names:
            if axis == layout.stage_axis:
                axes.append((axis, "stage"))
            elif axis in layout.local:
                dim = next((d.name for d in layout.dims if axis in d.axes), None)
                axes.append((axis, f"local, shards {dim}" if dim else "local"))
            else:
                axes.append((axis, by_axis.get(axis, "Replicate()")))
        coord = [0] * len(mesh.names)
        if layout.stage_axis is not None and layout.stages:
            coord[mesh.names.index(layout.stage_axis)] = layout.stages[0]
        local = tuple(ranges_len(r) for r in local_indices(layout, mesh, coord))
        shapes: dict[tuple[int, ...], int] = defaultdict(int)
        for t, box in sampled_table(layout, mesh):
            if layout.on_stage(mesh, t.coord):
                shapes[t.shape] += box.size
        dims = "; ".join(map(_dim_text, layout.dims))
        for d, over in zip(layout.dims, layout.ckpt, strict=False):
            if over:
                dims += f"; checkpoint shards {d.name} over {', '.join(over)}"
        stage = ""
        if layout.stage_axis is not None:
            stage = f"stages {', '.join(map(str, layout.stages))} on {layout.stage_axis}"
        return Side(
            "placed",
            mesh=(f"view {view}: " if view else "") + _mesh_text(mesh),
            dims=f"{dims}  ({m.entry.dtype})",
            axes=tuple(axes),
            dtensor="none (over the pipeline axis)"
            if over_stage
            else f"({', '.join(sub.names)}): ({', '.join(map(_placement_text, placements))})",
            rank=mesh.rank_of(tuple(coord)),
            local_shape=local,
            shapes=tuple(sorted(shapes.items(), key=lambda kv: (-kv[1], kv[0]))),
            stage=stage,
            style=self._style(m.winner),
        )

    def _style(self, rule_index: int | None) -> str:
        if rule_index is None:
            return "none"
        rule = next(r for r in self.res.spec.rules if r.index == rule_index)
        st = rule.style
        if st is not None:
            words = [st.kind.text]
            words += [f"input {st.input.text}"] if st.input is not None else []
            words += [f"output {st.output.text}"] if st.output is not None else []
            words += ["dtensor"] if st.dtensor else []
            return " ".join(words)
        derived = self.styles.get(rule_index, ("", "", None, None))[1]
        return f"{derived} (derived)" if derived in ("colwise", "rowwise") else "none"


# ----------------------------------------------------------------------------- checkpoints


@dataclass(frozen=True)
class _Unit:
    shape: tuple[int, ...]
    fqn: str
    fused: Fused | None
    dtype: str
    squeezed: bool = False  # a squeezed component (stored without its fused dimension)


def _units(res: Resolved) -> dict[str, _Unit]:
    """The model's entries a checkpoint of ``res`` stores, by key, as save stores them (a
    fused parameter per component, under a trainer's hooks' keys, or whole: see
    :func:`~shardspec.checks.keys.component_key`)."""
    out: dict[str, _Unit] = {}
    for key, shape, fqn, fused in stored_units(res):
        dtype = res.matches[fqn].entry.dtype
        if fused is None:
            out[key] = _Unit(shape, fqn, None, dtype)
            continue
        comps = [c for c, _ in fused.components]
        name, _, comp = key.rpartition(".")
        stored, own = component_key(res, name, fqn, comps, comp)
        if own and squeezed(res, fqn):  # stored without the fused dim, never read from whole
            out[stored] = _Unit(shape[: fused.at] + shape[fused.at + 1 :], fqn, None, dtype, True)
            continue
        if own:
            out[stored] = _Unit(shape, fqn, fused, dtype)
            continue
        full = list(shape)
        full[fused.at] = sum(size for _, size in fused.components)
        out[stored] = _Unit(tuple(full), fqn, None, dtype)
    return out


def _ignored(res: Resolved, key: str) -> bool:
    """Whether checkpoint key ``key`` lies inside what ``res`` ignores (a dot-bounded part
    of it matches an ignore pattern), as load decides."""
    regexes = [g.regex for g in res.ignore_globs.values()]
    if not regexes:
        return False
    starts = [0] + [i + 1 for i, ch in enumerate(key) if ch == "."]
    stops = [i for i, ch in enumerate(key) if ch == "."] + [len(key)]
    return any(
        r.fullmatch(key[s:e]) is not None for s in starts for e in stops if e > s for r in regexes
    )


def _checkpoint(
    a: Resolved, b: Resolved
) -> tuple[tuple[Problem, ...], tuple[tuple[str, int], ...]]:
    """What keeps a checkpoint saved under ``a`` from loading under ``b``, grouped, and the
    components ``b`` reads from a whole tensor ``a`` stored."""
    old, new = _units(a), _units(b)
    was, now = _suffixes(old), _suffixes(new)
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    fallbacks: list[str] = []
    read: set[str] = set()
    for key, u in new.items():
        have = old.get(key)
        if have is None and u.fused is not None:
            whole_key = key.rpartition(".")[0]
            whole = old.get(whole_key)
            full = list(u.shape)
            full[u.fused.at] = sum(size for _, size in u.fused.components)
            if whole is not None and whole.shape == tuple(full):
                fallbacks.append(key)
                read.add(whole_key)
                if whole.dtype != u.dtype:
                    found[("dtype", _dtypes(whole.dtype, u.dtype))].append(key)
                continue
        if have is None:
            found[("missing", _missing_why(a, u, was, now))].append(key)
            continue
        read.add(key)
        if have.shape != u.shape:
            shapes = f"global shape {list(have.shape)} under OLD, {list(u.shape)} under NEW"
            found[("shape", shapes)].append(key)
        if have.dtype != u.dtype:
            found[("dtype", _dtypes(have.dtype, u.dtype))].append(key)
    for key, u in old.items():
        if key in new or key in read or _ignored(b, key):
            continue
        found[("unexpected", _unexpected_why(b, u, was, now))].append(key)
    problems = [
        Problem(kind, globs_of(keys), len(keys), why) for (kind, why), keys in found.items()
    ]
    problems.sort(key=lambda p: (p.kind, p.globs))
    return tuple(problems), globs_of(fallbacks)


def _problems(found: dict[tuple[str, str], list[str]]) -> tuple[Problem, ...]:
    """Keys grouped by (kind, why) as problems, sorted."""
    out = [Problem(kind, globs_of(keys), len(keys), why) for (kind, why), keys in found.items()]
    return tuple(sorted(out, key=lambda p: (p.kind, p.globs)))


def _dtypes(old: str, new: str) -> str:
    return f"dtype {old} under OLD, {new} under NEW"


def _suffixes(units: dict[str, _Unit]) -> dict[str, list[str]]:
    """Per parameter, the keys a checkpoint stores it under, relative to its name (a
    name-indexed module's keys: its global names')."""
    out: dict[str, set[str]] = defaultdict(set)
    for key, u in units.items():
        if u.fused is None and not u.squeezed:
            out[u.fqn].add("(whole)")
        else:  # a component: under the parameter's name, or a trainer's hook's key
            own = key.startswith(u.fqn + ".")
            out[u.fqn].add(key[len(u.fqn) :] if own else _relative(key, u.fqn))
    return {fqn: sorted(tails) for fqn, tails in out.items()}


def _relative(key: str, fqn: str) -> str:
    """``key`` without the leading segments it shares with ``fqn``."""
    parts, others = key.split("."), fqn.split(".")
    n = 0
    while n < min(len(parts), len(others)) - 1 and parts[n] == others[n]:
        n += 1
    return ".".join(parts[n:])


def _renamed(was: list[str], now: list[str], lacking: str) -> str:
    """Why a parameter stored under both specs has a key only one of them stores."""
    if was == now:
        return f"{lacking} stores no such key: the global index range of its module differs"
    return (
        f"its parameter is stored as {', '.join(was) or 'nothing'} under OLD and as "
        f"{', '.join(now) or 'nothing'} under NEW (a `fuse` line, `stored fused` or "
        "`checkpoint keys` changed the keys)"
    )


def _missing_why(
    a: Resolved, u: _Unit, was: dict[str, list[str]], now: dict[str, list[str]]
) -> str:
    """Why a checkpoint saved under ``a`` lacks a key NEW stores for ``u.fqn``."""
    m = a.matches.get(u.fqn)
    if m is None:
        return "NEW stores it; its parameter is not in OLD's manifest"
    if m.ignored_by is not None:
        return f"OLD ignores its parameter (`ignore {a.spec.ignores[m.ignored_by].pattern.text}`)"
    return _renamed(was.get(u.fqn, []), now[u.fqn], "OLD")


def _unexpected_why(
    b: Resolved, u: _Unit, was: dict[str, list[str]], now: dict[str, list[str]]
) -> str:
    """Why NEW reads no key a checkpoint saved under OLD holds for ``u.fqn``."""
    if b.matches.get(u.fqn) is None:
        return (
            "OLD stores it; its parameter is not in NEW's manifest (load refuses a key it "
            "does not expect: `ignore` it, or load with partial=True)"
        )
    return _renamed(was[u.fqn], now.get(u.fqn, []), "NEW")


# ----------------------------------------------------------------------------- Hugging Face


def _hf_lines(res: Resolved) -> list[str]:
    """The hf block's items as canonical text (spacing, comments and order left out)."""
    block = res.spec.hf
    if block is None:
        return []
    hfmap = build_hfmap(block)
    lines = [str(r) for r in hfmap.rules]
    lines += [f"drop {g}" for g in hfmap.drops]
    lines += [f"tie {x} = {y}" for x, y in hfmap.ties]
    lines += [f"keep {g}" for g in hfmap.keeps]
    lines += [str(q) for q in hfmap.quants]
    lines += [
        f"config {c.name.text} = {' * '.join(f.text for f in c.factors)}" for c in block.configs
    ]
    return lines


def _source_text(src: Source) -> str:
    """Where a unit comes from, without the spec's line numbers (they differ between the
    specs while the meaning stays)."""
    keys = src.keys[0] if len(src.keys) == 1 else f"{src.keys[0]} .. {src.keys[-1]}"
    text = f"{keys} {list(src.shape)}"
    if src.stacked:
        text += f" ({len(src.keys)} tensors, stacked)"
    sp = src.split
    if sp is not None:
        per = sp.size // sp.groups
        group = f" of each of {sp.groups} groups" if sp.groups > 1 else ""
        text += f" [{sp.start}:{sp.start + per}{group} of dim {sp.dim}]"
    return text + "".join(f" {t}" for t in src.transforms)


def _hf_reads(res: Resolved) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """Per storage unit, where an HF checkpoint has it (text), and every HF key the block
    reads with its shape."""
    if res.spec.hf is None:
        return {}, {}
    hfmap = build_hfmap(res.spec.hf, res.hf_manifest)
    texts: dict[str, str] = {}
    keys: dict[str, tuple[int, ...]] = {}
    for name, shape, _fqn, fused in stored_units(res):
        if hfmap.kept(name):
            texts[name] = "kept (not in the checkpoint)"
            continue
        try:
            sources = hfmap.sources(name, shape, fused)
        except ValueError as e:  # a capture only one side of a line has (lint: SS070)
            texts[name] = str(e)
            continue
        texts[name] = "; ".join(map(_source_text, sources)) or "-"
        for src in sources:
            keys.update((k, src.shape) for k in src.keys)
    return texts, keys


def _hf_facts(a: Resolved, b: Resolved) -> HFFacts | None:
    if a.spec.hf is None and b.spec.hf is None:
        return None
    la, lb = _hf_lines(a), _hf_lines(b)
    ta, ka = _hf_reads(a)
    tb, kb = _hf_reads(b)
    groups: dict[tuple[str, str], list[tuple[str, str, str]]] = defaultdict(list)
    for unit in dict.fromkeys([*ta, *tb]):
        old, new = ta.get(unit, "-"), tb.get(unit, "-")
        if old != new:
            groups[(split_name(old)[0], split_name(new)[0])].append((unit, old, new))
    units = [
        HFChange(
            globs_of(u for u, _, _ in rows),
            len(rows),
            globs_of(o for _, o, _ in rows)[0][0],
            globs_of(n for _, _, n in rows)[0][0],
        )
        for rows in groups.values()
    ]
    units.sort(key=lambda c: c.globs)
    return HFFacts(
        tuple(x for x in la if x not in lb),
        tuple(x for x in lb if x not in la),
        tuple(units),
        globs_of(k for k in ka if k not in kb),
        globs_of(k for k in kb if k not in ka),
        _hf_problems(a, b, ka, kb),
    )


def _hf_problems(
    a: Resolved, b: Resolved, ka: dict[str, tuple[int, ...]], kb: dict[str, tuple[int, ...]]
) -> tuple[Problem, ...]:
    """What keeps an HF checkpoint that loaded under ``a`` from loading under ``b``: a
    key ``b`` reads that it lacks, or holds in another shape. The checkpoint is the one
    ``a``'s HF manifest describes, or else one holding exactly the keys ``a`` reads."""
    if a.spec.hf is None or b.spec.hf is None:
        return ()
    if a.hf_manifest is not None:
        have = {k: t.shape for k, t in a.hf_manifest.tensors.items()}
        what = "OLD's HF manifest has no such tensor"
    else:
        have = dict(ka)
        what = "OLD reads no such key, so an HF checkpoint that loads under OLD need not have it"
    hfmap = build_hfmap(b.spec.hf)
    found: dict[tuple[str, str], list[str]] = defaultdict(list)
    for key, shape in kb.items():
        got = have.get(key)
        if got is None and (alias := hfmap.tie_of(key)) is not None:
            got = have.get(alias)
        if got is None:
            found[("missing", f"NEW reads it; {what}")].append(key)
        elif tuple(got) != tuple(shape):
            found[("shape", f"shape {list(got)} under OLD, {list(shape)} read by NEW")].append(key)
    problems = [
        Problem(kind, globs_of(keys), len(keys), why) for (kind, why), keys in found.items()
    ]
    return tuple(sorted(problems, key=lambda p: (p.kind, p.globs)))
