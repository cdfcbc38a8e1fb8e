"""IR (+ manifest) -> resolved facts: mesh sizes, rules in plain data, and for every
manifest entry the rules that match it, the winner and its layout.

Resolution reports nothing itself: :mod:`shardspec.checks` reads these facts and turns
them into diagnostics. Rules that the structural checks found broken are passed in as
``broken`` and take no part (so one typo does not cascade into many findings).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from shardspec.core.layout import (
    MAX_WORLD,
    WHOLE,
    LayoutError,
    Mesh,
    ParamLayout,
    RuleSpec,
    build_layout,
    resolve_sizes,
)
from shardspec.core.patterns import Glob, PatternError, compile_glob
from shardspec.core.patterns import shared as one
from shardspec.core.stages import PipelineSpec, StageError, StagePlan, plan
from shardspec.core.views import SINGLE, Views, view_sizes
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest
from shardspec.inputs.manifest import Entry, Manifest
from shardspec.resolve.views import per_rule, rule_view, views_of

_V = TypeVar("_V")

# What a Match holds when nothing matched: shared by every match, never changed.
_NO_CAPTURES: dict[str, str] = {}


@dataclass(slots=True)  # one per manifest entry: a million of them in a large model
class Match:
    """One manifest entry and the rules that match it. Its tuples and captures are shared
    with every match like it (read only): a million matches hold a few hundred."""

    entry: Entry
    candidates: tuple[int, ...] = ()  # rule indices, best first
    winner: int | None = None
    tied: tuple[int, ...] = ()  # rules with the winner's key
    captures: dict[str, str] = field(default_factory=lambda: _NO_CAPTURES)
    layout: ParamLayout | None = None
    layout_error: LayoutError | None = None
    ignored_by: int | None = None  # ignore-rule index

    @property
    def buffer(self) -> bool:
        """A persistent buffer: stored as parameters are, whole on every rank where no rule
        matches it (``winner`` None, ``layout`` the whole tensor's)."""
        return self.entry.kind == "buffer"


@dataclass
class Resolved:
    spec: ir.Spec
    manifest: Manifest | None
    mesh: Mesh | None
    mesh_error: str | None
    globs: Mapping[int, Glob]  # rule index -> compiled pattern (good patterns only)
    rule_specs: Mapping[int, RuleSpec]  # rule index -> plain rule (sound rules only)
    ignore_globs: dict[int, Glob]
    matches: dict[str, Match]  # fqn -> match, for params and extra state
    name_indexed_counts: dict[int, dict[str, int]]
    broken: frozenset[int] = frozenset()
    mesh_error_code: str = "SS010"  # SS004 when a -D override names no axis
    mesh_error_hint: str = ""  # the LayoutError's own hint, where it has one
    hf_manifest: HFManifest | None = None  # the hf block's, when it could be read
    # The pipeline block in plain data (None: no block, or one the checks found broken),
    # and where every parameter lives at the mesh's pipeline size (when it places them).
    pipeline: PipelineSpec | None = None
    stages: StagePlan | None = None
    stage_error: StageError | None = None  # why the parameters could not be placed
    # Views (named meshes): each view's mesh, and each rule's view (one implicit view,
    # ``SINGLE``, for a spec with one unnamed mesh). ``mesh`` is the default view's.
    views: Views | None = None
    view_meshes: dict[str, Mesh] = field(default_factory=dict)
    rule_views: Mapping[int, str] = field(default_factory=dict)
    # Pipeline ties (`tie ALIAS = SOURCE`): per alias whose source is a parameter, the rules
    # that match the alias's own name and, where one wins, its layout on the source's shape
    # (the alias's stage must hold the source's layout; the rule gives the module's style).
    tie_matches: dict[str, Match] = field(default_factory=dict)

    def mesh_of_rule(self, rule: int | None) -> Mesh | None:
        """The mesh of rule ``rule``'s view (None: the default view's; a buffer that no
        rule places lives there too)."""
        if rule is None or self.views is None or len(self.views.names) == 1:
            return self.mesh
        return self.view_meshes.get(self.rule_views.get(rule, self.views.default))

    def mesh_for(self, m: Match) -> Mesh | None:
        """The mesh that ``m``'s layout is on: its winning rule's view's."""
        return self.mesh_of_rule(m.winner)

    @property
    def axis_sizes(self) -> dict[str, int]:
        """Every view's axis sizes, by axis name (a shared axis once)."""
        out: dict[str, int] = {}
        for mesh in self.view_meshes.values():
            out.update(zip(mesh.names, mesh.sizes, strict=True))
        return out

    def fsdp_of_rule(self, rule: int | None) -> str | None:
        """The FSDP axis of rule ``rule``'s view."""
        if self.views is None:
            return None
        view = self.rule_views.get(rule, self.views.default) if rule is not None else None
        return self.views.fsdp_of(view if view is not None else self.views.default)

    @property
    def params(self) -> list[tuple[str, Match]]:
        """Parameters that a rule places, sorted by name."""
        return sorted(
            (f, m)
            for f, m in self.matches.items()
            if m.entry.kind == "param" and m.winner is not None and m.ignored_by is None
        )

    @property
    def buffers(self) -> list[tuple[str, Match]]:
        """Persistent buffers stored as units of their own (not ignored), sorted by name:
        placed by a rule, or whole on every rank (of their pipeline stage)."""
        return sorted((f, m) for f, m in self.matches.items() if m.buffer and m.ignored_by is None)

    @property
    def stored(self) -> list[tuple[str, Match]]:
        """What checkpoints and the hf block store, sorted by name: the placed parameters
        and the persistent buffers."""
        return sorted([*self.params, *self.buffers])


class MeshError(ValueError):
    """A mesh the compiler cannot size, with the check code it reports it under: SS004 for a
    ``-D`` override that names no axis, SS010 for the rest."""

    def __init__(self, message: str, code: str = "SS010", hint: str = "") -> None:
        super().__init__(message)
        self.code, self.hint = code, hint


def meshes_of(
    spec: ir.Spec, overrides: dict[str, int] | None = None, world: int | None = None
) -> dict[str, Mesh]:
    """Every view's mesh with compile-time overrides applied (by axis name; a shared axis
    once): the one mesh of a spec without views under ``SINGLE``. Raises
    :class:`MeshError`."""
    views = views_of(spec)
    if views is None or spec.mesh is None or spec.mesh.name is None:
        return {SINGLE: mesh_of(spec, overrides, world)}
    names = views.all_axes
    axis_aliases(spec)
    declared: dict[str, int | None] = {}
    named = [m for m in spec.views if m.name is not None]
    for m in named:
        for a in m.axes:
            declared.setdefault(a.name.text, a.size)
        if len({a.name.text for a in m.axes}) != len(m.axes):
            raise MeshError(f"view {m.name.text!r} declares an axis twice")  # type: ignore[union-attr]
    declared.update(_overrides(overrides, names, "no view has"))
    w = world if world is not None else next((m.world for m in named if m.world), None)
    try:
        sizes = view_sizes(views, declared, w)
    except LayoutError as e:
        raise MeshError(str(e), hint=e.hint) from None
    meshes = views.meshes(sizes)
    for mesh in meshes.values():
        _sized(mesh.names, mesh.sizes)
    return meshes


def _overrides(
    overrides: dict[str, int] | None, names: tuple[str, ...], who: str
) -> dict[str, int]:
    """``overrides``, each naming one of ``names``; raises SS004's :class:`MeshError` for
    one that names no axis."""
    for name, value in (overrides or {}).items():
        if name not in names:
            raise MeshError(
                f"-D {name}={value}: {who} axis {name!r} (axes: {', '.join(names)})",
                "SS004",
                "-D takes a mesh axis of the spec, or world",
            )
    return dict(overrides or {})


def _sized(names: tuple[str, ...], resolved: tuple[int, ...]) -> None:
    """Raise :class:`MeshError` for an empty axis or a world beyond ``MAX_WORLD``."""
    if any(s < 1 for s in resolved):
        raise MeshError(f"mesh {dict(zip(names, resolved, strict=True))} has an empty axis")
    if math.prod(resolved) > MAX_WORLD:
        raise MeshError(
            f"mesh {dict(zip(names, resolved, strict=True))} has {math.prod(resolved)} ranks; "
            f"lint and compile check meshes of up to {MAX_WORLD} ranks",
            "SS010",
            f"lint it at a world of at most {MAX_WORLD} ranks (-D world=N) with the same "
            "model-parallel sizes",
        )


def axis_aliases(spec: ir.Spec) -> dict[str, str]:
    """The mesh's ``aka`` names, alias -> axis (the names a trainer's DeviceMesh may give
    an axis). Raises :class:`MeshError` for an alias that is an axis's name or another
    alias, and for aliases in views (not yet)."""
    out: dict[str, str] = {}
    for view in spec.views:
        if view.name is not None and any(a.aliases for a in view.axes):
            raise MeshError(
                f"view {view.name.text!r}: `aka` names an axis of the one unnamed mesh only",
                hint="name the view's axes as the trainer's meshes do",
            )
    axes = {a.name.text for a in spec.mesh.axes} if spec.mesh is not None else set()
    for a in spec.mesh.axes if spec.mesh is not None else ():
        for alias in a.aliases:
            if alias.text in axes or alias.text in out:
                raise MeshError(
                    f"axis {a.name.text!r} aka {alias.text!r}: the mesh already calls an axis "
                    f"{alias.text!r}",
                    hint="an alias is another name for one axis, used by no other",
                )
            out[alias.text] = a.name.text
    return out


def mesh_of(
    spec: ir.Spec, overrides: dict[str, int] | None = None, world: int | None = None
) -> Mesh:
    """The spec's mesh with compile-time overrides applied. Raises :class:`MeshError`."""
    if spec.mesh is None:
        raise MeshError("the spec declares no mesh")
    names = tuple(a.name.text for a in spec.mesh.axes)
    if not names:
        raise MeshError("the mesh has no axes")
    if len(set(names)) != len(names):
        raise MeshError("the mesh declares an axis twice")
    axis_aliases(spec)
    declared: list[int | None] = [a.size for a in spec.mesh.axes]
    sizes = list(declared)
    given = _overrides(overrides, names, "the mesh has no")
    for name, value in given.items():
        sizes[names.index(name)] = value
    w = world if world is not None else spec.mesh.world
    try:
        resolved = resolve_sizes(names, sizes, w)
    except LayoutError as e:
        hint = e.hint
        if given and world is None and spec.mesh.world is not None:
            hint = _world_hint(names, declared, sizes, spec.mesh.world, given) or hint
        raise MeshError(str(e), hint=hint) from None
    _sized(names, resolved)
    return Mesh(names, resolved)


def _world_hint(
    names: tuple[str, ...],
    declared: list[int | None],
    sizes: list[int | None],
    world: int,
    given: dict[str, int],
) -> str:
    """SS010's hint when ``-D`` overrides (``given``) make the axes no longer fit the
    spec's own world size (``mesh over N ranks``): the ``-D world=`` that fits them, computed
    (keeping the rest axis's declared size, and the smallest); "" when none fits."""
    said = " ".join(f"-D {k}={v}" for k, v in given.items())
    known = math.prod(s for s in sizes if s is not None)
    if known < 1:
        return ""
    rest = [i for i, s in enumerate(sizes) if s is None]
    if not rest:
        return (
            f"`{said}` makes the mesh {known} ranks, but the spec sizes it over {world} "
            f"ranks: pass the world size too, `{said} -D world={known}`"
        )
    name = names[rest[0]]
    ways = []
    before = math.prod(s for s in declared if s is not None)
    if before and world % before == 0 and world // before > 1:
        keep = world // before
        ways.append(f"`-D world={known * keep}` keeps {name} {keep}")
    ways.append(f"`-D world={known}` makes {name} 1")
    return (
        f"`{said}` makes the axes other than {name!r} {known} ranks, but the spec sizes "
        f"the mesh over {world} ranks: pass the world size too: " + ", or ".join(ways)
    )


def pipeline_spec(spec: ir.Spec) -> PipelineSpec | None:
    """The plain-data form of the spec's pipeline block (None without one)."""
    p = spec.pipeline
    if p is None:
        return None
    split = p.splits[0] if p.splits else None
    return PipelineSpec(
        axis=p.axis.text,
        first=tuple(x.text for x in p.first),
        last=tuple(x.text for x in p.last),
        split=split.pattern.text if split else None,
        counts=tuple(split.counts) if split else (),
        local_names=bool(split and split.local_names),
        ties=tuple((t.alias.text, t.source.text) for t in p.ties),
    )


def rule_spec(rule: ir.Rule, fsdp: str | None, pattern: str | None = None) -> RuleSpec:
    """The plain-data form of a rule, with the FSDP default applied (``pattern``: the
    rule's, or that of another rule of its shape in a rule table).

    FSDP shards the module tensor's first dimension over the data-parallel axis, innermost
    (after any model-parallel axes on that dimension), unless the rule mentions that axis
    itself (in a ``shard`` or a ``replicate``), or is ``replicate``.
    """
    pattern = rule.pattern.text if pattern is None else pattern
    glob = compile_glob(pattern)
    name_indexed = tuple(d.text for d in rule.dims if d.text in glob.captures)
    shard = {s.dim.text: tuple(a.text for a in s.axes) for s in rule.shards}
    mentioned = {a for axes in shard.values() for a in axes} | {a.text for a in rule.replicate}
    tensor_dims = [d.text for d in rule.dims if d.text not in name_indexed]
    if fsdp and not rule.replicate_all and fsdp not in mentioned and tensor_dims:
        first = tensor_dims[0]
        shard[first] = (*shard.get(first, ()), fsdp)
    fuse = tuple(
        (
            f.dim.text,
            tuple((c.name.text, c.size) for c in f.components),
            f.groups or 1,
        )
        for f in rule.fusions
    )
    return RuleSpec(  # its tuples shared with every rule like it (a large spec's repeat)
        pattern=pattern,
        dims=one(tuple(d.text for d in rule.dims)),
        shard=one(tuple((d, shard[d]) for d in (x.text for x in rule.dims) if d in shard)),
        fuse=one(fuse),
        local=one(tuple(a.text for a in rule.local)),
        name_indexed=one(name_indexed),
        stored_fused=any(f.stored_fused for f in rule.fusions),
        squeezed=tuple(f.dim.text for f in rule.fusions if f.squeezed),
        any_rank=not rule.dims_given,
        ckpt_shard=one(
            tuple((s.dim.text, tuple(a.text for a in s.axes)) for s in rule.checkpoint_shards)
        ),
        replicated_heads=replicated_heads(rule),
    )


def replicated_heads(rule: ir.Rule) -> tuple[tuple[str, str, int], ...]:
    """``(dim, component, head size)`` of the rule's ``heads COMP SIZE replicated`` items
    that name a component of a fused dimension (or the fused dimension: every component)
    with a whole-number size, outside groups; lint refuses the others (SS117)."""
    out = []
    for item in rule.heads:
        if not item.replicated or not item.size:
            continue
        for f in (f for f in rule.fusions if not f.groups):
            for c in f.components:
                if item.target.text in (f.dim.text, c.name.text):
                    out.append((f.dim.text, c.name.text, item.size))
    return tuple(out)


def resolve(
    spec: ir.Spec,
    manifest: Manifest | None,
    *,
    broken: set[int] = frozenset(),  # type: ignore[assignment]
    overrides: dict[str, int] | None = None,
    world: int | None = None,
) -> Resolved:
    """Resolve ``spec`` against ``manifest`` (``None``: rules and mesh only).

    Never raises for a bad spec: a mesh that cannot be sized leaves ``mesh`` ``None`` and
    says why in ``mesh_error``; rules in ``broken`` get no :class:`RuleSpec` and win no
    layout.
    """
    mesh: Mesh | None = None
    meshes: dict[str, Mesh] = {}
    mesh_error = None
    mesh_error_code = "SS010"
    mesh_error_hint = ""
    views = views_of(spec)
    try:
        meshes = meshes_of(spec, overrides, world)
        assert views is not None
        mesh = meshes[views.default]
    except MeshError as e:
        mesh_error = str(e)
        mesh_error_code = e.code
        mesh_error_hint = e.hint
    # An FSDP axis the mesh lacks is reported (SS011) and otherwise left out, so that no
    # layout refers to an axis without a size. Each rule takes its view's FSDP axis.
    rule_views = per_rule(spec.rules, lambda r: rule_view(views, r)) if views else {}
    globs: Mapping[int, Glob]
    specs: Mapping[int, RuleSpec]
    if isinstance(spec.rules, ir.RuleTable):
        globs, specs = _table_globs(spec.rules, broken, views, rule_views)
    else:
        globs, specs = {}, {}
        for rule in spec.rules:
            try:
                globs[rule.index] = compile_glob(rule.pattern.text)
            except PatternError:
                continue
            if rule.index not in broken:
                fsdp = views.fsdp_of(rule_views[rule.index]) if views else None
                specs[rule.index] = rule_spec(rule, fsdp)
    ignore_globs: dict[int, Glob] = {}
    for i, ig in enumerate(spec.ignores):
        try:
            ignore_globs[i] = compile_glob(ig.pattern.text)
        except PatternError:
            continue
    res = Resolved(
        spec,
        manifest,
        mesh,
        mesh_error,
        globs,
        specs,
        ignore_globs,
        {},
        {},
        frozenset(broken),
        mesh_error_code,
        mesh_error_hint=mesh_error_hint,
        views=views,
        view_meshes=meshes,
        rule_views=rule_views,
    )
    if manifest is None:
        return res
    _match_all(res)
    _match_ties(res)
    if mesh is not None:
        _layouts(res)
    _place_stages(res)
    return res


class _TableRules(Mapping[int, _V]):
    """Per rule of a rule table whose pattern compiles and that is not left out, a value
    worked out when read (:func:`_table_globs`); a large spec holds no object per rule."""

    __slots__ = ("_make", "_n", "_out")

    def __init__(self, n: int, out: frozenset[int], make: Callable[[int], _V]) -> None:
        self._n, self._out, self._make = n, out, make

    def __getitem__(self, index: int) -> _V:
        if not isinstance(index, int) or not 0 <= index < self._n or index in self._out:
            raise KeyError(index)
        return self._make(index)

    def __len__(self) -> int:
        return self._n - len(self._out)

    def __iter__(self) -> Iterator[int]:
        out = self._out
        return (i for i in range(self._n) if i not in out)


def _table_globs(
    table: ir.RuleTable,
    broken: set[int],
    views: Views | None,
    rule_views: Mapping[int, str],
) -> tuple[Mapping[int, Glob], Mapping[int, RuleSpec]]:
    """``resolve``'s globs and rule specs of a rule table: the same as of its rules, read
    from the columns when asked for."""
    failed = set()
    for i in range(len(table)):
        try:
            compile_glob(table.pattern_text(i))
        except PatternError:
            failed.add(i)
    left_out = frozenset(failed)

    def spec_of(i: int) -> RuleSpec:
        fsdp = views.fsdp_of(rule_views[i]) if views else None
        return rule_spec(table.shapes[table.shape_of(i)], fsdp, table.pattern_text(i))

    globs = _TableRules(len(table), left_out, lambda i: compile_glob(table.pattern_text(i)))
    return globs, _TableRules(len(table), left_out | frozenset(broken), spec_of)


def _place_stages(res: Resolved) -> None:
    """Place the manifest's parameters on the mesh's stages (``res.stages``), or say why
    they cannot be placed at this size (``res.stage_error``)."""
    try:
        res.pipeline = pipeline_spec(res.spec)
    except PatternError:
        return
    p = res.pipeline
    if p is None or res.mesh is None or res.manifest is None or p.axis not in res.mesh.names:
        return
    try:
        res.stages = plan(
            p,
            [f for f, _ in res.params],
            res.mesh.size(p.axis),
            buffers=[f for f, _ in res.buffers],
            tied_to=tied_to(res.manifest),
        )
    except StageError as e:
        res.stage_error = e
        return
    except PatternError:  # reported by the pipeline block's checks (SS090)
        return
    # Layouts know their stage: other stages' ranks hold none of the parameter, and its
    # DTensor spans the mesh without the pipeline axis.
    # A tied weight lives on its source's stage and its alias's.
    staged: dict[tuple[int, tuple[int, ...]], ParamLayout] = {}  # shared per stage set
    for fqn, m in res.stored:
        if m.layout is not None:
            stages = res.stages.stages_of(fqn)
            key = (id(m.layout), stages)
            if key not in staged:
                staged[key] = dataclasses.replace(m.layout, stage_axis=p.axis, stages=stages)
            m.layout = staged[key]
    sources = dict(p.ties)
    for alias, m in res.tie_matches.items():
        if m.layout is not None:
            stages = res.stages.stages_of(sources[alias])
            m.layout = dataclasses.replace(m.layout, stage_axis=p.axis, stages=stages)


def tied_to(manifest: Manifest | None) -> dict[str, str]:
    """The manifest's tied parameters: name -> the first name of the same tensor."""
    if manifest is None:
        return {}
    return {e.fqn: e.tied_to for e in manifest.params if e.tied_to is not None}


def _match_ties(res: Resolved) -> None:
    """The rules of every tie alias (the whole model holds the tied weight once), matched
    by the alias's own name on its source's manifest entry; a manifest that lists the alias
    tied to the source (as ``shardspec manifest`` writes a tied model) gives its entry."""
    try:
        p = pipeline_spec(res.spec)
    except PatternError:
        return
    if p is None:
        return
    for alias, source in p.ties:
        m = res.matches.get(source)
        if m is None or m.entry.kind != "param":
            continue
        own = res.matches.get(alias)
        if own is not None:
            if own.entry.tied_to == source:
                res.tie_matches[alias] = own
            continue
        res.tie_matches[alias] = _match_one(
            res, Entry(fqn=alias, shape=m.entry.shape, dtype=m.entry.dtype)
        )


def _match_all(res: Resolved) -> None:
    assert res.manifest is not None
    ordered = sorted(res.globs.items(), key=lambda kv: kv[1].key, reverse=True)
    rules = [(index, g.regex.match, g.key) for index, g in ordered]
    ignores = [(i, g.regex.match) for i, g in res.ignore_globs.items()]
    shared: dict[tuple[tuple[str, str], ...], dict[str, str]] = {}
    for entry in res.manifest.entries:  # parameters, buffers (placed as parameters are), ...
        res.matches[entry.fqn] = _match_one(res, entry, rules, ignores, shared)


def _match_one(res: Resolved, entry: Entry, rules=None, ignores=None, shared=None) -> Match:
    """``entry`` and the rules that match its name, best first. ``shared``: one captures
    dict per distinct value (read only; a million entries have a few hundred); its tuples
    of rule indices are shared too (:func:`~shardspec.core.patterns.shared`)."""
    if rules is None:
        ordered = sorted(res.globs.items(), key=lambda kv: kv[1].key, reverse=True)
        rules = [(index, g.regex.match, g.key) for index, g in ordered]
    if ignores is None:
        ignores = [(i, g.regex.match) for i, g in res.ignore_globs.items()]
    fqn = entry.fqn
    m = Match(entry)
    for i, match in ignores:
        if match(fqn):
            m.ignored_by = i
            break
    if entry.kind in ("param", "buffer"):
        best_key = None
        candidates: list[int] = []
        tied: list[int] = []
        for index, match, key in rules:
            found = match(fqn)
            if found is None:
                continue
            candidates.append(index)
            if best_key is None:
                best_key = key
                captures = found.groupdict()
                if shared is not None:
                    captures = shared.setdefault(tuple(captures.items()), captures)
                m.winner, m.captures = index, captures
            elif key == best_key:
                tied.append(index)
        m.candidates, m.tied = one(tuple(candidates)), one(tuple(tied))
    return m


def _layouts(res: Resolved) -> None:
    # Count the modules behind each name-indexed dim: distinct capture values per rule.
    values: dict[int, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for m in res.matches.values():
        if m.winner is None or m.ignored_by is not None or m.winner not in res.rule_specs:
            continue
        for v in res.rule_specs[m.winner].name_indexed:
            values[m.winner][v].add(m.captures.get(v, ""))
    for index, per_dim in values.items():
        res.name_indexed_counts[index] = {d: len(vals) for d, vals in per_dim.items()}
    # Parameters of one rule with one shape share a layout object: build it once.
    # A buffer no rule matches is whole on every rank (its layout has no rule: key None).
    built: dict[tuple[int | None, tuple[int, ...]], ParamLayout | LayoutError] = {}
    for m in [*res.matches.values(), *res.tie_matches.values()]:
        default = m.buffer and m.winner is None
        if m.ignored_by is not None or (not default and m.winner not in res.rule_specs):
            continue
        key = (m.winner, m.entry.shape)
        got = built.get(key)
        if got is None:
            if m.winner is None:
                rs, counts = WHOLE, None
            else:
                rs, counts = res.rule_specs[m.winner], res.name_indexed_counts.get(m.winner)
            mesh = res.mesh_of_rule(m.winner)
            assert mesh is not None
            sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
            try:
                got = build_layout(rs, m.entry.shape, sizes, counts)
            except LayoutError as e:
                got = e
            built[key] = got
        if isinstance(got, LayoutError):
            m.layout_error = got
        else:
            m.layout = got
