"""The text of ``shardspec explain``, from :mod:`shardspec.explain.facts`' values."""

from __future__ import annotations

from shardspec.core.layout import Dim, Placement, Ranges, Shard, StridedShard
from shardspec.core.patterns import describe_key
from shardspec.explain.facts import (
    ROWS,
    Explanation,
    Heads,
    HeadsVerdict,
    HFFacts,
    HFSource,
    LayoutFacts,
    RankTable,
    Refusal,
    RuleChoice,
    Stage,
    Style,
    StyleSource,
    ViewsFacts,
)
from shardspec.findings.diagnostics import attach_sources, render_all_text


def render_text(x: Explanation | Refusal) -> str:
    """What ``shardspec explain`` prints: findings for a refusal, else the explanation."""
    if isinstance(x, Refusal):
        return render_all_text(attach_sources(x.diagnostics, x.sources))
    lines = _head_lines(x)
    if x.rules is not None:
        lines += _rule_lines(x.spec_path, x.rules)
    if x.no_layout is not None:
        lines.append(f"  no layout: {x.no_layout}")
    if x.views is not None:
        lines += _views_lines(x.views)
    if x.layout is not None:
        layout = _layout_lines(x.spec_path, x.layout, buffer=x.buffer)
        if x.views is not None:  # the mesh is the parameter's view's
            layout[0] = layout[0].replace("  mesh:", f"  mesh (view {x.views.view}):", 1)
        lines += layout
        if x.stage is not None:
            lines.append(_stage_line(x.stage))
        if x.table is not None:
            lines += _table_lines(x.layout, x.table)
    if x.checkpoint is not None:
        key_layout, stored = x.checkpoint
        lines.append(f"  checkpoint keys ({key_layout}): {', '.join(stored)}")
    if x.hf is not None:
        lines += _hf_lines(x.spec_path, x.hf)
    if x.findings:
        lines.append("")
        lines.append(render_all_text(attach_sources(x.findings, x.sources or {})).rstrip())
    return "\n".join(lines) + "\n"


def _head_lines(x: Explanation) -> list[str]:
    """The name asked for (a tie's alias says so), the shape and dtype, and an ignore."""
    lines = []
    if x.alias is not None:
        lines.append(
            f"{x.alias} is tied to {x.fqn} (pipeline tie): its stage holds a copy under "
            f"this name, cut as {x.fqn} is below, stored once under {x.fqn}"
        )
    if x.entry.kind == "extra_state":
        lines.append(f"{x.fqn}  (extra state)")
    else:
        kind = "  (persistent buffer)" if x.buffer else ""
        lines.append(f"{x.fqn}  {list(x.entry.shape)} {x.entry.dtype}".rstrip() + kind)
    if x.ignored is not None:
        lines.append(
            f"  ignored by `ignore {x.ignored.pattern}` ({x.spec_path}:{x.ignored.line}): not "
            "converted or saved"
        )
    elif x.rules is None and x.buffer:
        lines.append("  matched by no rule: whole on every rank, as buffers are by default")
    elif x.rules is None:
        lines.append("  matched by no rule (SS040)")
    return lines


def _rule_lines(shown: str, rules: RuleChoice) -> list[str]:
    lines = ["  rules that match, by precedence:"]
    for c in rules.candidates:
        lines.append(
            f"    {c.verdict.value:5} {shown}:{c.line}  param {c.pattern}  ({describe_key(c.key)})"
        )
    if rules.tied:
        lines.append("  equal precedence: this is an error (SS043)")
    elif rules.runner_up is None:
        lines.append("  why: it is the only rule that matches")
    elif rules.criterion is None:
        lines.append("  why: equal precedence")
    else:
        lines.append(
            f"  why: it has {rules.criterion} than `{rules.runner_up}` (precedence never "
            "depends on file order)"
        )
    return lines


def _views_lines(v: ViewsFacts) -> list[str]:
    """Every view's mesh (the parameter's marked), and the shown ranks' coordinates in
    each: rank r has r's row-major coordinate in every view."""
    lines = ["  views (one world; rank r has r's row-major coordinate in each):"]
    for name, mesh, fsdp in v.meshes:
        sizes = ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes, strict=True))
        mark = "   <- this parameter's view" if name == v.view else ""
        lines.append(f"    {name}: {sizes}" + (f"; fsdp {fsdp}" if fsdp else "") + mark)
    width = max(len(name) for name, _, _ in v.meshes)
    cols = [max(width, 2 * len(mesh.names) + 1) for _, mesh, _ in v.meshes]
    head = "  ".join(f"{name:<{w}}" for (name, _, _), w in zip(v.meshes, cols, strict=True))
    lines.append(f"    {'rank':>4}  {head}")
    for rank, coords in v.coords:
        row = "  ".join(
            f"{'(' + ','.join(map(str, c)) + ')':<{w}}" for c, w in zip(coords, cols, strict=True)
        )
        lines.append(f"    {rank:>4}  {row}".rstrip())
    return lines


def _layout_lines(shown: str, f: LayoutFacts, *, buffer: bool = False) -> list[str]:
    mesh = f.mesh
    sizes = ", ".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.sizes, strict=True))
    lines = [f"  mesh: {sizes}", f"  global dims: {'; '.join(map(_dim_text, f.layout.dims))}"]
    lines += [_heads_line(h) for h in f.heads]
    if f.local:
        lines.append(f"  local axes (the module holds its shard): {', '.join(f.local)}")
    if buffer:
        held = "its local shard" if f.local else "the whole tensor"
        who = "every rank of its pipeline stage" if f.layout.stage_axis else "every rank"
        lines.append(
            f"  a plain tensor, not a DTensor: {who} holds {held} (FSDP2 and torch's "
            "styles leave buffers so)"
        )
        lines.append("  checkpoints, load_hf and export_hf store it as they store parameters")
        return lines
    if f.placements is None:
        lines.append("  DTensor: none (a rule shards it over the pipeline axis: SS090)")
    else:
        lines.append(
            f"  DTensor: mesh ({', '.join(f.dtensor_mesh)}), "
            f"placements ({', '.join(map(_placement_text, f.placements))})"
        )
    lines.append(f"  tensor-parallel style: {_style_text(shown, f.style)}")
    if f.style.refused is not None:
        lines.append(f"    refused by lint (SS038): its module {f.style.refused}")
        lines.append(f"    what to do: {f.style.refused_hint}")
    return lines


def _dim_text(d: Dim) -> str:
    text = f"{d.name}={d.size}"
    if d.axes:
        text += " over " + (d.axes[0] if len(d.axes) == 1 else f"({', '.join(d.axes)})")
    if d.fusion:
        comps = ", ".join(f"{n} {s}" for n, s in d.fusion.components)
        text += (
            f" [fused: {d.fusion.groups} groups of {comps}]"
            if d.fusion.groups > 1
            else f" [fused: {comps}{' squeezed' if d.fusion.squeezed else ''}]"
        )
    if d.name_indexed:
        text += " [indexed by module name]"
    return text


def _placement_text(p: Placement) -> str:
    """A placement as DTensor writes it: ``Replicate()``, ``Shard(0)``,
    ``_StridedShard(0, sf=2)``."""
    if isinstance(p, Shard):
        return f"Shard({p.dim})"
    if isinstance(p, StridedShard):
        return f"_StridedShard({p.dim}, sf={p.split_factor})"
    return "Replicate()"


def _heads_line(h: Heads) -> str:
    what = ", ".join(f"{c} {size}" for c, size in h.sizes)
    if h.verdict is HeadsVerdict.INDIVISIBLE:
        verdict = "the size does not divide it (SS035)"
    elif h.verdict is HeadsVerdict.CUT:
        assert h.cut is not None
        cut = h.cut
        verdict = f"{cut.axis}={h.cut_axis_size} cuts head {cut.head} at index {cut.index} (SS034)"
    elif h.verdict is HeadsVerdict.WHOLE:
        verdict = f"every shard over {', '.join(h.axes)} holds whole heads"
    else:
        verdict = "no model-parallel axis splits it"
    return f"  heads: {what}: {verdict}"


def _style_text(shown: str, s: Style) -> str:
    if s.source is StyleSource.STATED:
        return " ".join(s.words) + f" (stated, {shown}:{s.line})"
    if s.source is StyleSource.DERIVED:
        name = {"linear": "Linear", "embedding": "Embedding"}.get(s.module or "", s.module)
        article = "an" if str(name)[:1] in "AEIOU" else "a"
        return f"{s.words[0]} (derived: {article} {name} sharded on {s.dim!r})"
    if s.source is StyleSource.UNDERIVABLE:
        return f"none derives ({s.module}); parallelize refuses it without a style"
    return "none (not sharded over a model-parallel axis)"


def _stage_line(s: Stage) -> str:
    if s.every:
        return (
            f"  pipeline stage: every one of the {s.n_stages} on {s.axis} (no first, last or "
            "split pattern covers it: every stage model keeps it; stored once, by stage 0)"
        )
    if s.layer is not None:
        why = f"layer {s.layer} of split {s.split}"
        if s.local_name is not None:
            why += f"; the stage model names it {s.local_name}"
    else:
        why = f"{s.claim} stage"
    if s.copies:
        copies = ", ".join(f"stage {st} holds a copy as {a}" for st, a in s.copies)
        why += f"; tied: {copies} (stored once, under this name)"
    line = f"  pipeline stage: {s.stage} of {s.n_stages} on {s.axis} ({why})"
    if s.off_stage:
        listed = rank_list(list(s.off_stage), s.off_stage_count)
        line += f"; ranks {listed} (other stages) hold none of it"
    return line


def rank_list(ranks: list[int], count: int | None = None) -> str:
    """``0-3`` for a run of ranks, else a comma list; ``count`` ranks in all, of which
    ``ranks`` are the first."""
    count = len(ranks) if count is None else count
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        if count == len(ranks):
            return f"{ranks[0]}-{ranks[-1]}"
    text = ", ".join(map(str, ranks))
    return text + (f" ... ({count} ranks)" if count > len(ranks) else "")


def _ranges(r: Ranges) -> str:
    if not r:
        return "-"
    return ",".join(f"{a}:{b}" for a, b in r)


def _table_lines(f: LayoutFacts, table: RankTable) -> list[str]:
    """The per-rank table (after a note on a name-indexed module), and what it leaves out."""
    width = 3 * len(f.mesh.names) + 2
    lines = []
    if table.name_indexed:
        names = ", ".join(f"{name} = its rank's first + {j}" for name, j in table.name_indexed)
        lines.append(f"  this module on each rank: {names} (the rows below)")
    lines.append("")
    lines.append(
        f"  {'rank':>4}  {'coord':<{width}}  {'local shape':<14} "
        "global offset   global indices per dim"
    )
    for row in table.rows:
        t = row.shard
        coord = "(" + ",".join(str(c) for c in t.coord) + ")"
        offset = "-" if t.empty else str(list(t.offset))
        idx = " x ".join(_ranges(r) for r in t.indices)
        lines.append(f"  {t.rank:>4}  {coord:<{width}}  {list(t.shape)!s:<14} {offset:<15} {idx}")
        for comp, r in row.components:
            lines.append(f"  {'':>4}  {'':<{width}}    {comp}: {_ranges(r)}")
    if table.more:
        counts = "; ".join(f"{list(s)} on {n}" for s, n in table.shapes)
        asked = "" if table.asked else f" (--ranks A-B shows others, {ROWS} at a time or more)"
        lines.append(f"  ... {table.more} more ranks{asked}")
        lines.append(f"  local shapes over all {table.total} ranks: {counts}")
    return lines


def _hf_lines(shown: str, hf: HFFacts) -> list[str]:
    """Where each storage unit comes from in a Hugging Face checkpoint."""
    lines = ["", "  Hugging Face (the hf block):"]
    for unit in hf.units:
        if unit.kept:
            lines.append(f"    {unit.name}: kept (not in the checkpoint)")
        elif unit.error is not None:
            lines.append(f"    {unit.name}: {unit.error}")
        elif not unit.sources:
            lines.append(f"    {unit.name}: produced by no map line (SS071)")
        for src in unit.sources:
            lines.append(f"    {unit.name} {list(unit.shape)} <- {_source_text(shown, src)}")
    if hf.more:
        lines.append(f"    ... and {hf.more} more units")
    return lines


def _source_text(shown: str, s: HFSource) -> str:
    src = s.source
    keys = src.keys[0] if len(src.keys) == 1 else f"{src.keys[0]} ... {src.keys[-1]}"
    tail = "".join(f", {t}" for t in src.transforms)
    if src.split is not None:
        sp = src.split
        if sp.groups == 1:
            keys += f"[{sp.start}:{sp.start + sp.size} of dim {sp.dim}]"
        else:  # `grouped`: the part's rows of every group
            per, block = sp.size // sp.groups, sp.total // sp.groups
            keys += f"[{sp.start}:{sp.start + per} of each of {sp.groups} groups of {block}"
            keys += f" of dim {sp.dim}]"
    count = f" ({len(src.keys)} tensors, stacked)" if src.stacked else ""
    return f"{keys} {list(src.shape)}{count}  ({shown}:{s.line}{tail})"
