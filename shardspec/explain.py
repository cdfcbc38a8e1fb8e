"""``shardspec explain SPEC FQN``: which rule places a parameter, why it wins, and every
rank's local shape and global offset."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable

from shardspec.api import display_path, lint_specs
from shardspec.core.layout import (
    Mesh,
    ParamLayout,
    Placement,
    RankShard,
    Shard,
    StridedShard,
    component_indices,
    dim_indices,
    dtensor_mesh,
    dtensor_placements,
    local_indices,
    sample_boxes,
    sampled_table,
    storage_units,
)
from shardspec.core.patterns import describe_key
from shardspec.core.stages import claims
from shardspec.core.stages import layer_of as stage_layer_of
from shardspec.findings.diagnostics import attach_sources, render_all_text
from shardspec.frontend import ir


def _ptext(p: Placement) -> str:
    """A placement as DTensor writes it: ``Replicate()``, ``Shard(0)``,
    ``_StridedShard(0, sf=2)``."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, StridedShard):
        return f"_StridedShard({p.dim}, sf={p.split_factor})"
    return "Replicate()"


def _ranges(r) -> str:
    if not r:
        return "-"
    return ",".join(f"{a}:{b}" for a, b in r)


def _style_text(res, rule_index: int) -> str:
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
        return " ".join(words) + f" (stated, {res.spec.path}:{st.span.line})"
    _fqn, derived, module, dim = rule_styles(res).get(rule_index, ("", "", None, None))
    if derived in ("colwise", "rowwise"):
        name = {"linear": "Linear", "embedding": "Embedding"}.get(module or "", module)
        article = "an" if str(name)[:1] in "AEIOU" else "a"
        return f"{derived} (derived: {article} {name} sharded on {dim!r})"
    if derived == "?":
        return f"none derives ({module}); parallelize refuses it without a style"
    return "none (not sharded over a model-parallel axis)"


def _why(res, winner: int, runner_up: int) -> str:
    """The first precedence criterion on which the winner beats the runner-up."""
    a, b = res.globs[winner].key, res.globs[runner_up].key
    first = res.spec.rules[runner_up].pattern.text
    labels = (
        "more literal segments",
        "fewer '**'",
        "more partial segments",
        "more literal characters",
    )
    for label, x, y in zip(labels, a, b, strict=True):
        if x != y:
            return f"it has {label} than `{first}` (precedence never depends on file order)"
    return "equal precedence"  # pragma: no cover - ties are reported above


def explain(
    path: str, fqn: str, sizes: dict[str, int], world: int | None, ranks: range | None = None
) -> tuple[str, int]:
    """The text of ``shardspec explain`` and its exit status. ``ranks``: the table's rows
    (default: the first ROWS ranks on the parameter's stage, then a summary)."""
    results, outcome = lint_specs([path], sizes, world)
    shown, res = results[0]
    if res is None or outcome.input_error:
        return render_all_text(attach_sources(outcome.diagnostics, outcome.sources)), 2
    lines: list[str] = []
    spec = res.spec
    if res.manifest is None:
        return (
            f"{shown}:1:1: error SS004 [bad-argument]: explain needs a manifest, and "
            f"{shown} names none\n"
            '  hint: add `manifest "model.json"` (made by `shardspec manifest`)\n'
        ), 2
    ties = dict(res.pipeline.ties) if res.pipeline is not None else {}
    alias_note = None
    if fqn not in res.matches and ties.get(fqn) in res.matches:
        # A pipeline tie's alias: the whole model holds the weight under its source's name.
        alias_note = (
            f"{fqn} is tied to {ties[fqn]} (pipeline tie): its stage holds a copy under "
            f"this name, cut as {ties[fqn]} is below, stored once under {ties[fqn]}"
        )
        fqn = ties[fqn]
    m = res.matches.get(fqn)
    if m is None:
        import difflib

        close = difflib.get_close_matches(fqn, list(res.matches), n=3, cutoff=0.5)
        hint = (
            f"did you mean {', '.join(close)}?"
            if close
            else f"the manifest's names are in {display_path(res.manifest.path)}"
        )
        return (
            f"<command line>:1:1: error SS004 [bad-argument]: {fqn!r} is not in the manifest "
            f"{display_path(res.manifest.path)}\n  hint: {hint}\n"
        ), 1
    if alias_note is not None:
        lines.append(alias_note)
    if m.entry.kind == "extra_state":
        lines.append(f"{fqn}  (extra state)")
    else:
        lines.append(f"{fqn}  {list(m.entry.shape)} {m.entry.dtype}".rstrip())
    if m.ignored_by is not None:
        ig = spec.ignores[m.ignored_by]
        lines.append(
            f"  ignored by `ignore {ig.pattern.text}` ({shown}:{ig.span.line}): not "
            "converted or saved"
        )
        return "\n".join(lines) + "\n", 0
    if not m.candidates:
        lines.append("  matched by no rule (SS040)")
        return "\n".join(lines) + "\n", 1
    lines.append("  rules that match, by precedence:")
    for i in m.candidates:
        rule = spec.rules[i]
        mark = "wins" if i == m.winner else ("TIE" if i in m.tied else "loses")
        lines.append(
            f"    {mark:5} {shown}:{rule.span.line}  param {rule.pattern.text}  "
            f"({describe_key(res.globs[i].key)})"
        )
    if m.tied:
        lines.append("  equal precedence: this is an error (SS043)")
    if len(m.candidates) == 1:
        lines.append("  why: it is the only rule that matches")
    elif not m.tied:
        lines.append(f"  why: {_why(res, m.candidates[0], m.candidates[1])}")
    if m.layout is None or res.mesh is None:
        err = m.layout_error or res.mesh_error
        lines.append(f"  no layout: {err}")
        return "\n".join(lines) + "\n", 1
    mesh, layout = res.mesh, m.layout
    rs = res.rule_specs[m.winner]  # type: ignore[index]
    sizes = ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes, strict=True))
    lines.append(f"  mesh: {sizes}")
    dims = []
    for d in layout.dims:
        text = f"{d.name}={d.size}"
        if d.axes:
            text += " over " + (d.axes[0] if len(d.axes) == 1 else f"({', '.join(d.axes)})")
        if d.fusion:
            comps = ", ".join(f"{n} {s}" for n, s in d.fusion.components)
            text += (
                f" [fused: {d.fusion.groups} groups of {comps}]"
                if d.fusion.groups > 1
                else f" [fused: {comps}]"
            )
        if d.virtual:
            text += " [indexed by module name]"
        dims.append(text)
    lines.append(f"  global dims: {'; '.join(dims)}")
    lines.extend(_heads_lines(res, m.winner, layout))  # type: ignore[arg-type]
    if rs.local:
        lines.append(f"  local axes (the module holds its shard): {', '.join(rs.local)}")
    sub = dtensor_mesh(layout, mesh)
    ps = dtensor_placements(layout, mesh)
    lines.append(
        "  DTensor: mesh ("
        + ", ".join(sub.names)
        + "), placements ("
        + ", ".join(_ptext(p) for p in ps)
        + ")"
    )
    lines.append(f"  tensor-parallel style: {_style_text(res, m.winner)}")
    off_stage: list[int] = []
    if layout.stage_axis is not None and res.stages is not None and res.pipeline is not None:
        sp, p = res.stages, res.pipeline
        stage = sp.stage.get(fqn, layout.stages[0])
        if p.split is not None and stage_layer_of(p, fqn) is not None:
            why = f"layer {stage_layer_of(p, fqn)} of split {p.split}"
            if p.local_names:
                why += f"; the stage model names it {sp.local_name(fqn)}"
        else:
            why = f"{claims(p, fqn)[0]} stage"
        off_stage = _off_stage(layout, mesh)
        listed = _rank_list(off_stage, _off_stage_count(layout, mesh))
        others = f"; ranks {listed} (other stages) hold none of it"
        copies = [
            f"stage {st} holds a copy as {a}"
            for a, src in p.ties
            if src == fqn and (st := sp.tie_stage.get(a)) is not None and st != stage
        ]
        if copies:
            why += "; tied: " + ", ".join(copies) + " (stored once, under this name)"
        lines.append(
            f"  pipeline stage: {stage} of {sp.n_stages} on {p.axis} ({why})"
            + (others if off_stage else "")
        )
    lines.append("")
    header = f"  {'rank':>4}  {'coord':<{3 * len(mesh.names) + 2}}  {'local shape':<14} "
    header += "global offset   global indices per dim"
    lines.append(header)
    units = storage_units(layout)
    # A name-indexed dim: this module is one index of its rank's block (block start + the
    # captured index), which is also its global index in checkpoints.
    virtual = {
        i: int(m.captures[d.name])
        for i, d in enumerate(layout.dims)
        if d.virtual and m.captures.get(d.name, "").isdigit()
    }
    if virtual:
        names = ", ".join(
            f"{layout.dims[i].name} = its rank's first + {j}" for i, j in virtual.items()
        )
        lines.insert(-2, f"  this module on each rank: {names} (the rows below)")
    shown_ranks = _shown(layout, mesh, ranks)
    for rank in shown_ranks:
        coord = mesh.coord_of(rank)
        t = RankShard(rank, coord, local_indices(layout, mesh, coord))
        indices = list(t.indices)
        for i, j in virtual.items():
            if indices[i]:
                g = indices[i][0][0] + j
                indices[i] = ((g, g + 1),)
        t = type(t)(t.rank, t.coord, tuple(indices))
        coord = "(" + ",".join(str(c) for c in t.coord) + ")"
        offset = "-" if t.empty else str(list(t.offset))
        idx = " x ".join(_ranges(r) for r in t.indices)
        lines.append(
            f"  {t.rank:>4}  {coord:<{3 * len(mesh.names) + 2}}  "
            f"{list(t.shape)!s:<14} {offset:<15} {idx}"
        )
        for comp, d in units:
            if comp is None or d is None:
                continue
            fusion = layout.dims[d].fusion
            assert fusion is not None
            lines.append(
                f"  {'':>4}  {'':<{3 * len(mesh.names) + 2}}    {comp}: "
                f"{_ranges(component_indices(fusion, t.indices[d], comp))}"
            )
    lines += _more_ranks(layout, mesh, shown_ranks, ranks)
    if spec.hf is not None:
        found = res.globs[m.winner].regex.match(fqn) if m.winner in res.globs else None
        spans = [found.span(d.name) for d in layout.dims if d.virtual] if found else []
        # A module indexed by name is one global index per rank (the rows above).
        mine = None
        if virtual and len(spans) == len(virtual):
            mine = set()
            for t in _virtual_shards(layout, mesh, virtual):
                name, last = [], 0
                for (a, b), (i, j) in zip(spans, sorted(virtual.items()), strict=True):
                    if not t[i]:
                        break
                    name += [fqn[last:a], str(t[i][0][0] + j)]
                    last = b
                else:
                    mine.add("".join([*name, fqn[last:]]))
        lines += _hf_lines(spec.hf, fqn, layout, spans, shown, mine)
    findings = [d for d in outcome.diagnostics if d.is_error]
    if findings:
        lines.append("")
        lines.append(render_all_text(attach_sources(findings, outcome.sources)).rstrip())
    return "\n".join(lines) + "\n", 0


def _heads_lines(res, rule_index: int, layout) -> list[str]:
    """Per dimension with ``heads``, its head sizes and whether a model-parallel shard cuts
    one (what SS034 checks)."""
    from shardspec.checks.heads import rule_heads
    from shardspec.checks.layouts import compute_axes, indivisible_heads
    from shardspec.core.layout import head_cut

    heads = rule_heads(res)[0].get(rule_index)
    if heads is None or res.mesh is None:
        return []
    fsdp = res.spec.fsdp.text if res.spec.fsdp else None
    sizes = dict(zip(res.mesh.names, res.mesh.sizes, strict=True))
    out = []
    for d in layout.dims:
        given = heads.of(d.name)
        if not given:
            continue
        what = ", ".join(f"{c or d.name} {h}" for c, h in given.items())
        axes = compute_axes(d, fsdp)
        cut = head_cut(d, axes, sizes, given)
        if indivisible_heads(d, heads.sizes[d.name]):
            verdict = "the size does not divide it (SS035)"
        elif cut is not None:
            verdict = (
                f"{cut.axis}={sizes[cut.axis]} cuts head {cut.head} at index {cut.index} (SS034)"
            )
        elif axes:
            verdict = f"every shard over {', '.join(axes)} holds whole heads"
        else:
            verdict = "no model-parallel axis splits it"
        out.append(f"  heads: {what}: {verdict}")
    return out


# The rows of the per-rank table explain prints unless `--ranks` says otherwise: a mesh of
# a million ranks would otherwise print a million rows (and take a minute to).
ROWS = 64


def _rank_list(ranks: list[int], count: int | None = None) -> str:
    """``0-3`` for a run of ranks, else a comma list; ``count`` ranks in all, of which
    ``ranks`` are the first."""
    count = len(ranks) if count is None else count
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        if count == len(ranks):
            return f"{ranks[0]}-{ranks[-1]}"
    text = ", ".join(map(str, ranks))
    return text + (f" ... ({count} ranks)" if count > len(ranks) else "")


def _off_stage(layout: ParamLayout, mesh: Mesh, limit: int = 8) -> list[int]:
    """The first ``limit`` ranks of other pipeline stages than the parameter's."""
    boxes = [b for b in sample_boxes((layout,), mesh) if not layout.on_stage(mesh, b.corner)]
    return list(itertools.islice(heapq.merge(*(b.ranks(mesh) for b in boxes)), limit))


def _off_stage_count(layout: ParamLayout, mesh: Mesh) -> int:
    n = mesh.size(layout.stage_axis)  # type: ignore[arg-type]
    return mesh.world // n * (n - len(set(layout.stages)))


def _shown(layout: ParamLayout, mesh: Mesh, ranks: range | None) -> list[int]:
    """The ranks of the table: those asked for, else the first ROWS on the stage."""
    # An asked-for range is cut to the mesh first: `--ranks 0-99999999999` must not walk
    # ranks that do not exist.
    wanted = range(mesh.world) if ranks is None else range(ranks.start, min(ranks.stop, mesh.world))
    on = (r for r in wanted if layout.on_stage(mesh, mesh.coord_of(r)))
    return list(on) if ranks is not None else list(itertools.islice(on, ROWS))


def _more_ranks(
    layout: ParamLayout, mesh: Mesh, shown: list[int], ranks: range | None
) -> list[str]:
    """What the table leaves out: how many ranks, and every local shape with its count."""
    boxes = [(t, b) for t, b in sampled_table(layout, mesh) if layout.on_stage(mesh, t.coord)]
    total = sum(b.size for _, b in boxes)
    if total <= len(shown):
        return []
    shapes: dict[tuple[int, ...], int] = {}
    for t, b in boxes:
        shapes[t.shape] = shapes.get(t.shape, 0) + b.size
    counts = "; ".join(f"{list(s)} on {n}" for s, n in sorted(shapes.items(), reverse=True))
    asked = "" if ranks is not None else f" (--ranks A-B shows others, {ROWS} at a time or more)"
    return [
        f"  ... {total - len(shown)} more ranks{asked}",
        f"  local shapes over all {total} ranks: {counts}",
    ]


def _virtual_shards(layout: ParamLayout, mesh: Mesh, virtual: dict[int, int]) -> Iterable[tuple]:
    """Each rank's indices of the name-indexed dims (the others left out): one per
    combination of the coordinates of those dims' axes, not one per rank."""
    axes = sorted({a for i in virtual for a in layout.dims[i].axes}, key=mesh.names.index)
    sizes = dict(zip(mesh.names, mesh.sizes, strict=True))
    for combo in itertools.product(*(range(sizes[a]) for a in axes)):
        coord = dict(zip(axes, combo, strict=True))
        yield {i: dim_indices(layout.dims[i], sizes, coord) for i in virtual}


def _hf_lines(
    block: ir.HFBlock,
    fqn: str,
    layout: ParamLayout,
    spans: list[tuple[int, int]],
    shown: str,
    mine: set[str] | None,
) -> list[str]:
    """Where each storage unit of ``fqn`` comes from in a Hugging Face checkpoint. A module
    indexed by name is the global indices in ``mine`` (one per rank)."""
    from shardspec.core.hfmap import fused_of, unit_names
    from shardspec.resolve.hf import build_hfmap

    hfmap = build_hfmap(block)
    units = unit_names(fqn, layout.dims, spans)
    fused = fused_of(layout.dims)
    if mine is not None:
        units = [u for u in units if u[0] in mine or u[0].rsplit(".", 1)[0] in mine]
    lines = ["", "  Hugging Face (the hf block):"]
    for name, shape in units[:8]:
        if hfmap.kept(name):
            lines.append(f"    {name}: kept (not in the checkpoint)")
            continue
        found = hfmap.sources(name, shape, fused)
        if not found:
            lines.append(f"    {name}: produced by no map line (SS071)")
            continue
        for src in found:
            rule = hfmap.rules[src.rule]
            keys = src.keys[0] if len(src.keys) == 1 else f"{src.keys[0]} ... {src.keys[-1]}"
            tail = "".join(f", {t}" for t in src.transforms)
            if src.split is not None:
                sp = src.split
                keys += f"[{sp.start}:{sp.start + sp.size} of dim {sp.dim}]"
            count = f" ({len(src.keys)} tensors, stacked)" if src.stacked else ""
            lines.append(
                f"    {name} {list(shape)} <- {keys} {list(src.shape)}{count}"
                f"  ({shown}:{rule.line}{tail})"
            )
    if len(units) > 8:
        lines.append(f"    ... and {len(units) - 8} more units")
    return lines
