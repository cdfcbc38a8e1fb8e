"""What ``shardspec explain SPEC FQN`` finds out about one parameter, as typed values: the
rules that match it and why one wins, its layout, where its pipeline stage is, every rank's
shard, and where a Hugging Face checkpoint keeps it. :mod:`shardspec.explain.render` turns
them into text; nothing here formats output."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from enum import Enum

from shardspec.api import display_path, lint_specs
from shardspec.checks.keys import component_key, spec_key_layout
from shardspec.core.hfmap import Source
from shardspec.core.layout import (
    HeadCut,
    Mesh,
    ParamLayout,
    Placement,
    Ranges,
    RankShard,
    component_indices,
    dim_indices,
    dtensor_mesh,
    dtensor_placements,
    local_indices,
    sample_boxes,
    sampled_table,
    storage_units,
)
from shardspec.core.stages import claims
from shardspec.core.stages import layer_of as stage_layer_of
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.findings.suggest import closest_few
from shardspec.frontend import ir
from shardspec.inputs.hfmanifest import HFManifest
from shardspec.inputs.manifest import Entry
from shardspec.resolve.params import Match, Resolved

# The rows of the per-rank table explain shows unless `--ranks` says otherwise: a mesh of
# a million ranks would otherwise print a million rows (and take a minute to).
ROWS = 64
# The storage units whose Hugging Face sources explain lists (then a count of the rest).
HF_UNITS = 8

# The precedence criteria, in the order they decide (see core.patterns' keys).
CRITERIA = (
    "more literal segments",
    "fewer '**'",
    "more partial segments",
    "more literal characters",
)


# ----------------------------------------------------------------------------- values


@dataclass(frozen=True)
class Refusal:
    """Why explain shows nothing: findings (with the sources their lines come from) and
    the exit status (2: the input cannot be processed; 1: no such parameter)."""

    diagnostics: tuple[Diagnostic, ...]
    sources: dict[str, str] = field(repr=False)
    status: int


class Verdict(str, Enum):
    """How a matching rule fares against the others."""

    WINS = "wins"
    TIE = "TIE"
    LOSES = "loses"


@dataclass(frozen=True)
class Candidate:
    """A rule that matches the parameter."""

    rule: int  # index into the spec's rules
    line: int
    pattern: str
    key: tuple[int, int, int, int]  # its precedence key
    verdict: Verdict


@dataclass(frozen=True)
class RuleChoice:
    """The rules that match, best first, and why the first wins: ``criterion`` is the first
    precedence criterion on which it beats ``runner_up`` (None for both: the only rule that
    matches; None with a runner-up: a tie)."""

    candidates: tuple[Candidate, ...]
    tied: bool
    runner_up: str | None = None  # the second rule's pattern
    criterion: str | None = None


@dataclass(frozen=True)
class Ignored:
    """The ``ignore`` line that drops the parameter."""

    pattern: str
    line: int


class StyleSource(Enum):
    STATED = "stated"
    DERIVED = "derived"
    UNDERIVABLE = "underivable"  # sharded over a model-parallel axis, no style derives
    NONE = "none"  # not sharded over a model-parallel axis


@dataclass(frozen=True)
class Style:
    """What parallelize does with the module holding the parameter. ``words``: the stated
    style as written (kind, input, output, dtensor), or the derived kind; ``module`` and
    ``dim``: the module kind and the sharded dimension it was derived from."""

    source: StyleSource
    words: tuple[str, ...] = ()
    line: int = 0  # STATED: where
    module: str | None = None
    dim: str | None = None
    # Refused by lint (SS038, the same decision): why torch's style does not fit the
    # module's class, and what to do instead.
    refused: str | None = None
    refused_hint: str | None = None


class HeadsVerdict(Enum):
    INDIVISIBLE = "indivisible"  # the head size does not divide the dimension (SS035)
    CUT = "cut"  # a model-parallel shard cuts a head (SS034)
    WHOLE = "whole"  # every shard holds whole heads
    UNSPLIT = "unsplit"  # no model-parallel axis splits it


@dataclass(frozen=True)
class Heads:
    """A dimension with ``heads``: its head sizes (per component, or the dimension's own
    name) and whether a model-parallel shard cuts one."""

    dim: str
    sizes: tuple[tuple[str, int], ...]
    verdict: HeadsVerdict
    axes: tuple[str, ...]  # the axes the forward computes on
    cut: HeadCut | None = None
    cut_axis_size: int = 0


@dataclass(frozen=True)
class LayoutFacts:
    """The parameter's global layout and how the runtime holds it."""

    mesh: Mesh
    layout: ParamLayout
    heads: tuple[Heads, ...]
    local: tuple[str, ...]  # axes whose shard the module holds
    dtensor_mesh: tuple[str, ...]
    placements: tuple[Placement, ...] | None  # None: a rule shards it over the stage axis
    style: Style


@dataclass(frozen=True)
class Stage:
    """The pipeline stage holding the parameter and why: ``layer`` of the ``split`` (with
    the stage model's own name when it renames), or a ``first``/``last`` claim."""

    stage: int
    n_stages: int
    axis: str
    layer: str | None = None
    split: str | None = None
    local_name: str | None = None
    claim: str | None = None
    copies: tuple[tuple[int, str], ...] = ()  # (stage, tie alias) holding a copy
    every: bool = False  # a buffer no declaration covers: every stage holds it
    off_stage: tuple[int, ...] = ()  # the first ranks of other stages
    off_stage_count: int = 0  # how many ranks other stages have


@dataclass(frozen=True)
class RankRow:
    """One rank's shard (a name-indexed dim: this module's global index) and, per fused
    component, its indices of that component."""

    shard: RankShard
    components: tuple[tuple[str, Ranges], ...]


@dataclass(frozen=True)
class RankTable:
    """The rows shown; ``name_indexed``: per name-indexed dim, the module's index within its
    rank's block; ``total``, ``shapes``: every rank on the stage, and each local shape
    with its count (only when the rows leave some out)."""

    rows: tuple[RankRow, ...]
    name_indexed: tuple[tuple[str, int], ...]
    total: int = 0
    shapes: tuple[tuple[tuple[int, ...], int], ...] = ()
    asked: bool = False  # the rows are what --ranks asked for

    @property
    def more(self) -> int:
        return max(0, self.total - len(self.rows))


@dataclass(frozen=True)
class HFSource:
    """One Hugging Face source of a storage unit, with the map line giving it."""

    source: Source
    line: int


@dataclass(frozen=True)
class HFUnit:
    """A storage unit and where a Hugging Face checkpoint has it: ``kept`` (not in the
    checkpoint) or its sources (none: no map line produces it, SS071)."""

    name: str
    shape: tuple[int, ...]
    kept: bool
    sources: tuple[HFSource, ...] = ()
    error: str | None = None  # a map line that cannot name its HF tensor (lint: SS070)


@dataclass(frozen=True)
class HFFacts:
    units: tuple[HFUnit, ...]  # the first HF_UNITS
    more: int  # units left out


@dataclass(frozen=True)
class ViewsFacts:
    """A folded spec's views: each view's mesh, the parameter's view, and the coordinate of
    each shown rank in every view (rank r has r's row-major coordinate in each)."""

    meshes: tuple[tuple[str, Mesh, str | None], ...]  # (view, its mesh, its fsdp axis)
    view: str | None  # the parameter's (None: no rule places it: the default view)
    coords: tuple[tuple[int, tuple[tuple[int, ...], ...]], ...]  # rank, coordinate per view


def views_facts(res: Resolved, m: Match, ranks: range | None) -> ViewsFacts | None:
    """The views of a spec that has named meshes, for explain (None: one unnamed mesh)."""
    if not res.spec.views or res.views is None or not res.view_meshes:
        return None
    meshes = tuple((v, res.view_meshes[v], res.views.fsdp_of(v)) for v in res.views.names)
    world = meshes[0][1].world
    shown = range(min(ROWS, world)) if ranks is None else range(ranks.start, min(ranks.stop, world))
    coords = tuple(
        (r, tuple(mesh.coord_of(r) for _, mesh, _ in meshes)) for r in itertools.islice(shown, ROWS)
    )
    view = res.rule_views.get(m.winner) if m.winner is not None else res.views.default
    return ViewsFacts(meshes, view, coords)


@dataclass(frozen=True)
class Explanation:
    """Everything explain shows about parameter ``fqn`` of spec ``spec_path``. ``alias``:
    the name asked for, when it is a pipeline tie's alias of ``fqn``. Sections past the
    first that does not apply are None (ignored: no rules; no layout: no table)."""

    spec_path: str
    fqn: str
    entry: Entry
    alias: str | None = None
    ignored: Ignored | None = None
    rules: RuleChoice | None = None
    no_layout: str | None = None  # why there is no layout
    views: ViewsFacts | None = None  # a spec with named meshes (views)
    layout: LayoutFacts | None = None
    stage: Stage | None = None
    table: RankTable | None = None
    hf: HFFacts | None = None
    # The spec's checkpoint key layout (`checkpoint keys`) and the keys a checkpoint stores
    # the parameter under in it (None: not placed).
    checkpoint: tuple[str, tuple[str, ...]] | None = None
    findings: tuple[Diagnostic, ...] = ()  # the spec's errors
    sources: dict[str, str] | None = field(default=None, repr=False)

    @property
    def buffer(self) -> bool:
        """A persistent buffer (whole on every rank where no rule matches it)."""
        return self.entry.kind == "buffer"

    @property
    def status(self) -> int:
        """1 when the parameter has no rule (a buffer: no layout), else 0."""
        if self.ignored is not None:
            return 0
        return 1 if (self.rules is None and not self.buffer) or self.layout is None else 0


# ----------------------------------------------------------------------------- computing


def explain_facts(
    path: str, fqn: str, sizes: dict[str, int], world: int | None, ranks: range | None = None
) -> Explanation | Refusal:
    """What explain shows about ``fqn`` in spec ``path``, at mesh sizes ``sizes`` and world
    ``world``. ``ranks``: the table's rows (default: the first ROWS ranks on the
    parameter's stage)."""
    results, outcome = lint_specs([path], sizes, world)
    shown, res = results[0]
    if res is None or outcome.input_error:
        return Refusal(tuple(outcome.diagnostics), outcome.sources, 2)
    if res.manifest is None:
        return Refusal((no_manifest(shown),), outcome.sources, 2)
    found = find_parameter(res, fqn)
    if isinstance(found, Diagnostic):
        return Refusal((found,), outcome.sources, 1)
    name, m = found
    x = Explanation(shown, name, m.entry, fqn if name != fqn else None, sources=outcome.sources)
    if m.ignored_by is not None:
        ig = res.spec.ignores[m.ignored_by]
        return replace(x, ignored=Ignored(ig.pattern.text, ig.span.line))
    if not m.candidates and not m.buffer:
        return x
    if m.candidates:  # (a buffer no rule matches is whole on every rank)
        x = replace(x, rules=rule_choice(res, m))
    mesh = res.mesh_for(m)
    if m.layout is None or mesh is None:
        return replace(x, no_layout=str(m.layout_error or res.mesh_error))
    return replace(
        x,
        views=views_facts(res, m, ranks),
        layout=layout_facts(res, m, mesh, m.layout),
        stage=stage_facts(res, name, mesh, m.layout),
        table=rank_table(m, mesh, m.layout, ranks),
        hf=hf_facts(res, name, m, mesh, m.layout),
        checkpoint=checkpoint_facts(res, name, m.layout),  # (a tie alias: its source)
        findings=tuple(d for d in outcome.diagnostics if d.is_error),
    )


def checkpoint_facts(res: Resolved, fqn: str, layout: ParamLayout) -> tuple[str, tuple[str, ...]]:
    """The spec's key layout and the keys a checkpoint stores ``fqn`` under in it."""
    comps = [c for c, _ in storage_units(layout) if c is not None]
    keys = [component_key(res, fqn, fqn, comps, c) for c in comps]
    return spec_key_layout(res.spec), tuple(dict.fromkeys(k for k, _ in keys)) or (fqn,)


def no_manifest(shown: str, command: str = "explain", hint: str = "") -> Diagnostic:
    """SS004: ``command`` needs the spec to name a manifest (``hint``: what else helps)."""
    return diag(
        "SS004",
        f"{command} needs a manifest, and {shown} names none",
        Span(shown, 1, 1),
        'add `manifest "model.json"` (made by `shardspec manifest`)' + hint,
    )


def find_parameter(res: Resolved, fqn: str) -> tuple[str, Match] | Diagnostic:
    """The parameter ``fqn`` names (a pipeline tie's alias: its source) and its match, or
    SS004 with the names it may have meant."""
    assert res.manifest is not None
    ties = dict(res.pipeline.ties) if res.pipeline is not None else {}
    if fqn not in res.matches and ties.get(fqn) in res.matches:
        fqn = ties[fqn]
    m = res.matches.get(fqn)
    if m is not None:
        return fqn, m
    where = display_path(res.manifest.path)
    close = closest_few(fqn, list(res.matches), n=3, cutoff=0.5)
    hint = f"did you mean {', '.join(close)}?" if close else f"the manifest's names are in {where}"
    return diag(
        "SS004", f"{fqn!r} is not in the manifest {where}", Span("<command line>", 1, 1), hint
    )


def rule_choice(res: Resolved, m: Match) -> RuleChoice:
    """The rules matching ``m``'s parameter, best first, and why the first wins."""
    spec = res.spec
    candidates = tuple(
        Candidate(
            i,
            spec.rules[i].span.line,
            spec.rules[i].pattern.text,
            res.globs[i].key,
            Verdict.WINS if i == m.winner else (Verdict.TIE if i in m.tied else Verdict.LOSES),
        )
        for i in m.candidates
    )
    if len(candidates) == 1:
        return RuleChoice(candidates, bool(m.tied))
    winner, runner_up = candidates[0], candidates[1]
    criterion = next(
        (label for label, x, y in zip(CRITERIA, winner.key, runner_up.key, strict=True) if x != y),
        None,
    )
    return RuleChoice(candidates, bool(m.tied), runner_up.pattern, criterion)


def layout_facts(res: Resolved, m: Match, mesh: Mesh, layout: ParamLayout) -> LayoutFacts:
    """The layout of ``m``'s parameter (or buffer), its heads, and its DTensor and style."""
    if m.winner is None:  # a buffer no rule matches: whole on every rank
        return LayoutFacts(
            mesh,
            layout,
            (),
            (),
            dtensor_mesh(layout, mesh).names,
            dtensor_placements(layout, mesh),
            Style(StyleSource.NONE),
        )
    return LayoutFacts(
        mesh,
        layout,
        heads_facts(res, m.winner, mesh, layout),
        tuple(res.rule_specs[m.winner].local),
        dtensor_mesh(layout, mesh).names,
        # Over the pipeline axis (SS090) a parameter has no DTensor: its stage holds it.
        None if layout.stage_axis in layout.axes else dtensor_placements(layout, mesh),
        _refusal(res, m, style_facts(res, m.winner)),
    )


def _refusal(res: Resolved, m: Match, style: Style) -> Style:
    """``style`` with what lint refuses of it (SS038): torch's colwise or rowwise style on
    a module whose class runs a forward of its own, decided on the module's weight."""
    from shardspec.checks.tensor_parallel import refused_style
    from shardspec.core.styles import custom_module_hint

    owner, _, leaf = m.entry.fqn.rpartition(".")
    weight = m if leaf == "weight" else res.matches.get(f"{owner}.weight")
    refused = refused_style(res, weight) if weight is not None else None
    if refused is None:
        return style
    if weight is not m:  # the module's style is its weight's
        assert weight is not None and weight.winner is not None
        style = style_facts(res, weight.winner)
    return replace(style, refused=refused[2], refused_hint=custom_module_hint(lint=True))


def style_facts(res: Resolved, rule_index: int) -> Style:
    """What parallelize does with the module holding the parameter: the stated style, or
    the one derived from the module's kind and the placements."""
    from shardspec.checks.layouts import rule_styles

    rule = next(r for r in res.spec.rules if r.index == rule_index)
    st = rule.style
    if st is not None:
        words = [st.kind.text]
        if st.input is not None:
            words.append(f"input {st.input.text}")
        if st.output is not None:
            words.append(f"output {st.output.text}")
        if st.dtensor:
            words.append("dtensor")
        return Style(StyleSource.STATED, tuple(words), st.span.line)
    _fqn, derived, module, dim = rule_styles(res).get(rule_index, ("", "", None, None))
    if derived in ("colwise", "rowwise"):
        return Style(StyleSource.DERIVED, (derived,), module=module, dim=dim)
    if derived == "?":
        return Style(StyleSource.UNDERIVABLE, module=module)
    return Style(StyleSource.NONE)


def heads_facts(
    res: Resolved, rule_index: int, mesh: Mesh, layout: ParamLayout
) -> tuple[Heads, ...]:
    """Per dimension with ``heads``, its head sizes and whether a model-parallel shard cuts
    one (what SS034 checks)."""
    from shardspec.checks.heads import rule_heads
    from shardspec.checks.layouts import compute_axes, indivisible_heads
    from shardspec.core.layout import head_cut

    heads = rule_heads(res)[0].get(rule_index)
    if heads is None:
        return ()
    fsdp = res.fsdp_of_rule(rule_index)  # its view's
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    out = []
    for d in layout.dims:
        given = heads.of(d.name)
        if not given:
            continue
        named = tuple((c or d.name, h) for c, h in given.items())
        axes = compute_axes(d, fsdp)
        cut = head_cut(d, axes, sizes, given)
        if indivisible_heads(d, heads.sizes[d.name]):
            out.append(Heads(d.name, named, HeadsVerdict.INDIVISIBLE, axes))
        elif cut is not None:
            out.append(Heads(d.name, named, HeadsVerdict.CUT, axes, cut, sizes[cut.axis]))
        else:
            verdict = HeadsVerdict.WHOLE if axes else HeadsVerdict.UNSPLIT
            out.append(Heads(d.name, named, verdict, axes))
    return tuple(out)


def stage_facts(res: Resolved, fqn: str, mesh: Mesh, layout: ParamLayout) -> Stage | None:
    """The pipeline stage holding ``fqn``, why, and which ranks hold none of it (None
    without a pipeline)."""
    sp, p = res.stages, res.pipeline
    if layout.stage_axis is None or sp is None or p is None:
        return None
    stage = sp.stage.get(fqn, layout.stages[0])
    layer = stage_layer_of(p, fqn) if p.split is not None else None
    claim = next(iter(claims(p, fqn)), None)
    copies = tuple(
        (st, a)
        for a, src in p.ties
        if src == fqn and (st := sp.tie_stage.get(a)) is not None and st != stage
    )
    return Stage(
        stage,
        sp.n_stages,
        p.axis,
        layer=layer,
        split=p.split if layer is not None else None,
        local_name=sp.local_name(fqn) if layer is not None and p.local_names else None,
        claim=claim if layer is None else None,
        copies=copies,
        every=sp.buffer_stages.get(fqn, ()) == tuple(range(sp.n_stages)) and sp.n_stages > 1,
        off_stage=tuple(_off_stage(layout, mesh)),
        off_stage_count=_off_stage_count(layout, mesh),
    )


def _off_stage(layout: ParamLayout, mesh: Mesh, limit: int = 8) -> list[int]:
    """The first ``limit`` ranks of other pipeline stages than the parameter's."""
    boxes = [b for b in sample_boxes((layout,), mesh) if not layout.on_stage(mesh, b.corner)]
    return list(itertools.islice(heapq.merge(*(b.ranks(mesh) for b in boxes)), limit))


def _off_stage_count(layout: ParamLayout, mesh: Mesh) -> int:
    n = mesh.size(layout.stage_axis)  # type: ignore[arg-type]
    return mesh.world // n * (n - len(set(layout.stages)))


def name_indexed_indices(m: Match, layout: ParamLayout) -> dict[int, int]:
    """Per name-indexed dim (by position), the module's index within its rank's block (the
    captured index): the module is that index past its rank's first."""
    return {
        i: int(m.captures[d.name])
        for i, d in enumerate(layout.dims)
        if d.name_indexed and m.captures.get(d.name, "").isdigit()
    }


def rank_table(m: Match, mesh: Mesh, layout: ParamLayout, ranks: range | None) -> RankTable:
    """The rows of the ranks asked for (else the first ROWS on the parameter's stage) and,
    when they leave some out, every local shape with its count."""
    indexed = name_indexed_indices(m, layout)
    units = [(c, d) for c, d in storage_units(layout) if c is not None and d is not None]
    rows = []
    for rank in shown_ranks(layout, mesh, ranks):
        coord = mesh.coord_of(rank)
        indices = list(local_indices(layout, mesh, coord))
        for i, j in indexed.items():
            if indices[i]:
                g = indices[i][0][0] + j
                indices[i] = ((g, g + 1),)
        comps = []
        for comp, d in units:
            fusion = layout.dims[d].fusion
            assert fusion is not None
            comps.append((comp, component_indices(fusion, indices[d], comp)))
        rows.append(RankRow(RankShard(rank, coord, tuple(indices)), tuple(comps)))
    named = tuple((layout.dims[i].name, j) for i, j in indexed.items())
    table = RankTable(tuple(rows), named, asked=ranks is not None)
    return _with_summary(table, layout, mesh)


def shown_ranks(layout: ParamLayout, mesh: Mesh, ranks: range | None) -> list[int]:
    """The ranks of the table: those asked for, else the first ROWS on the stage."""
    # An asked-for range is cut to the mesh first: `--ranks 0-99999999999` must not walk
    # ranks that do not exist.
    wanted = range(mesh.world) if ranks is None else range(ranks.start, min(ranks.stop, mesh.world))
    on = (r for r in wanted if layout.on_stage(mesh, mesh.coord_of(r)))
    return list(on) if ranks is not None else list(itertools.islice(on, ROWS))


def _with_summary(table: RankTable, layout: ParamLayout, mesh: Mesh) -> RankTable:
    """``table`` with what it leaves out: how many ranks, and every local shape with its
    count (from the sampled mesh, not a walk)."""
    boxes = [(t, b) for t, b in sampled_table(layout, mesh) if layout.on_stage(mesh, t.coord)]
    total = sum(b.size for _, b in boxes)
    if total <= len(table.rows):
        return table
    shapes: dict[tuple[int, ...], int] = {}
    for t, b in boxes:
        shapes[t.shape] = shapes.get(t.shape, 0) + b.size
    return replace(table, total=total, shapes=tuple(sorted(shapes.items(), reverse=True)))


def hf_facts(res: Resolved, fqn: str, m: Match, mesh: Mesh, layout: ParamLayout) -> HFFacts | None:
    """Where each storage unit of ``fqn`` comes from in a Hugging Face checkpoint (None
    without an hf block). A module indexed by name is its global indices (one per rank)."""
    if res.spec.hf is None:
        return None
    glob = res.globs.get(m.winner) if m.winner is not None else None
    found = glob.regex.match(fqn) if glob is not None else None
    spans = [found.span(d.name) for d in layout.dims if d.name_indexed] if found else []
    indexed = name_indexed_indices(m, layout)
    mine = None
    if indexed and len(spans) == len(indexed):
        mine = set(_global_names(fqn, layout, mesh, indexed, spans))
    return _hf_units(res.spec.hf, fqn, layout, spans, mine, res.hf_manifest)


def _global_names(
    fqn: str,
    layout: ParamLayout,
    mesh: Mesh,
    indexed: dict[int, int],
    spans: list[tuple[int, int]],
) -> Iterator[str]:
    """``fqn`` with each name-indexed capture replaced by the module's global index, once
    per rank (that holds one)."""
    for t in _name_indexed_shards(layout, mesh, indexed):
        name: list[str] = []
        last = 0
        for (a, b), (i, j) in zip(spans, sorted(indexed.items()), strict=True):
            if not t[i]:
                break
            name += [fqn[last:a], str(t[i][0][0] + j)]
            last = b
        else:
            yield "".join([*name, fqn[last:]])


def _name_indexed_shards(
    layout: ParamLayout, mesh: Mesh, indexed: dict[int, int]
) -> Iterable[dict]:
    """Each rank's indices of the name-indexed dims (the others left out): one per
    combination of the coordinates of those dims' axes, not one per rank."""
    axes = sorted({a for i in indexed for a in layout.dims[i].axes}, key=mesh.names.index)
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    for combo in itertools.product(*(range(sizes[a]) for a in axes)):
        coord = dict(zip(axes, combo, strict=True))
        yield {i: dim_indices(layout.dims[i], sizes, coord) for i in indexed}


def _hf_units(
    block: ir.HFBlock,
    fqn: str,
    layout: ParamLayout,
    spans: list[tuple[int, int]],
    mine: set[str] | None,
    hfm: HFManifest | None = None,
) -> HFFacts:
    """The sources of the first HF_UNITS storage units of ``fqn`` (a name-indexed module:
    those in ``mine``); ``hfm``: the HF manifest, for the sizes ``pad`` lines pad."""
    from shardspec.core.hfmap import fused_of, unit_names
    from shardspec.resolve.hf import build_hfmap

    hfmap = build_hfmap(block, hfm)
    units = unit_names(fqn, layout.dims, spans)
    fused = fused_of(layout.dims)
    if mine is not None:
        units = [u for u in units if u[0] in mine or u[0].rsplit(".", 1)[0] in mine]
    out = []
    for name, shape in units[:HF_UNITS]:
        if hfmap.kept(name):
            out.append(HFUnit(name, shape, True))
            continue
        try:
            found = hfmap.sources(name, shape, fused)
        except ValueError as e:  # a capture only one side of a map line has (SS070)
            out.append(HFUnit(name, shape, False, error=str(e)))
            continue
        sources = tuple(HFSource(s, hfmap.rules[s.rule].line) for s in found)
        out.append(HFUnit(name, shape, False, sources))
    return HFFacts(tuple(out), max(0, len(units) - HF_UNITS))
