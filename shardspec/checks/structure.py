"""Checks that need only the spec: mesh, axes, dimension names, fusions, patterns.

Each returns its diagnostics and adds the index of every rule it finds unsound to
``broken``, so later stages skip that rule instead of tripping over it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Sequence

from shardspec.core.patterns import PatternError, compile_glob
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.findings.suggest import did_you_mean
from shardspec.frontend import ir
from shardspec.frontend.ir import rules_to_check
from shardspec.resolve.views import captures_key


def check_mesh(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS010: a mesh exists, and its axes (each view's) are distinct, sized at least 1, one
    `*` at most.

    Sizes against the world size are checked once the mesh is resolved (see ``run``).
    """
    out: list[Diagnostic] = []
    if spec.mesh is None:
        out.append(
            diag(
                "SS010",
                "the spec declares no mesh",
                Span(spec.path, 1, 1),
                "add `mesh over N ranks { dp_shard: *  tp: 2 }`",
            )
        )
        return out
    for mesh in spec.views or (spec.mesh,):
        out.extend(_check_one_mesh(mesh))
    return out


def _check_one_mesh(mesh: ir.MeshDecl) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    counts = Counter(a.name.text for a in mesh.axes)
    seen: set[str] = set()
    for a in mesh.axes:
        if counts[a.name.text] > 1 and a.name.text in seen:
            out.append(
                diag(
                    "SS010",
                    f"mesh axis {a.name.text!r} is declared twice",
                    a.name.span,
                    "each axis appears once, outer to inner",
                )
            )
        seen.add(a.name.text)
        if a.size == 0:
            out.append(
                diag(
                    "SS010", f"mesh axis {a.name.text!r} has size 0", a.span, "sizes are at least 1"
                )
            )
    rest = [a for a in mesh.axes if a.size is None]
    for a in rest[1:]:
        out.append(
            diag(
                "SS010",
                f"mesh axis {a.name.text!r} also takes the rest of the world",
                a.span,
                f"only one axis can be `*`; {rest[0].name.text!r} already is",
            )
        )
    if not mesh.axes:
        out.append(
            diag(
                "SS010",
                "the mesh has no axes",
                mesh.span,
                "declare at least one axis, e.g. `dp_shard: *`",
            )
        )
    return out


def _each(
    rules: Sequence[ir.Rule],
    one: Callable[[ir.Rule], list[Diagnostic]],
    broken: set[int] | None,
    key: Callable[[ir.RuleTable, int], Hashable] | None = None,
) -> list[Diagnostic]:
    """What ``one`` finds in each rule, in order (rules it finds something in are added
    to ``broken``, unless None); of a rule table, only the rules of shapes (and ``key``s)
    whose first rule ``one`` finds something in are read (:func:`ir.rules_to_check`)."""
    out: list[Diagnostic] = []
    for rule in rules_to_check(rules, lambda r: bool(one(r)), key):
        found = one(rule)
        if found and broken is not None:
            broken.add(rule.index)
        out += found
    return out


def _unknown_axis(a: ir.Name, axes: list[str]) -> Diagnostic:
    """SS011 for an axis name the mesh does not declare, with the closest declared one."""
    return diag("SS011", f"unknown mesh axis {a.text!r}", a.span, did_you_mean(a.text, axes))


def _axes(spec: ir.Spec) -> list[str]:
    """Every mesh axis: the mesh's, or every view's (a shared axis once)."""
    meshes = spec.views if spec.views else (spec.mesh,) if spec.mesh else ()
    return list(dict.fromkeys(a.name.text for m in meshes for a in m.axes))


def check_fsdp(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS011: the FSDP axis (each view's) is a mesh axis."""
    axes = _axes(spec)
    return [
        diag(
            "SS011",
            f"fsdp axis {f.text!r} is not a mesh axis",
            f.span,
            did_you_mean(f.text, axes),
        )
        for f in spec.fsdps
        if spec.mesh is not None and f.text not in axes
    ]


_PATTERN_SYNTAX = (
    "segments are separated by single dots; `*` matches one segment, `**` any number, "
    "`{a,b}` one of the alternatives, `{name}` one segment captured as name"
)


def check_patterns(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS044: every rule and ignore pattern compiles."""
    out = []
    patterns: list[tuple[ir.Pattern, int | None]] = []
    rules = spec.rules
    if isinstance(rules, ir.RuleTable):  # a rule's node only where its pattern is bad
        for i in range(len(rules)):
            try:
                compile_glob(rules.pattern_text(i))
            except PatternError:
                patterns.append((rules[i].pattern, i))
    else:
        patterns += [(r.pattern, r.index) for r in rules]
    patterns += [(ig.pattern, None) for ig in spec.ignores]
    for pattern, index in patterns:
        try:
            compile_glob(pattern.text)
        except PatternError as e:
            if index is not None:
                broken.add(index)
            out.append(
                diag("SS044", f"bad pattern {pattern.text!r}: {e}", pattern.span, _PATTERN_SYNTAX)
            )
    return out


def check_rule_names(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """Dimensions, axes, local and replicate lists of every rule."""
    axes = _axes(spec)
    known_axes = set(axes)

    def one(rule: ir.Rule) -> list[Diagnostic]:
        out: list[Diagnostic] = []
        dims = [d.text for d in rule.dims]
        if not rule.dims_given and not rule.replicate_all:
            out.append(
                diag(
                    "SS021",
                    "the rule does not name the parameter's dimensions",
                    rule.pattern.span,
                    "write `param PATTERN [dim, ...] { ... }`; only "
                    "`param PATTERN replicate` may leave them out",
                )
            )
        seen_dims: set[str] = set()
        for d in rule.dims:
            if d.text in seen_dims:
                out.append(
                    diag(
                        "SS022",
                        f"dimension {d.text!r} is named twice",
                        d.span,
                        "give every dimension its own name",
                    )
                )
            seen_dims.add(d.text)
        used: dict[str, str] = {}  # axis -> dim it shards
        sharded_dims: set[str] = set()
        for s in rule.shards:
            if s.dim.text not in dims and rule.dims_given:
                out.append(
                    diag(
                        "SS020",
                        f"unknown dimension {s.dim.text!r}",
                        s.dim.span,
                        did_you_mean(s.dim.text, dims),
                    )
                )
            if s.dim.text in sharded_dims:
                out.append(
                    diag(
                        "SS012",
                        f"dimension {s.dim.text!r} is sharded by two statements",
                        s.span,
                        "list every axis of a dimension in one `shard DIM over (OUTER, INNER)`",
                    )
                )
            sharded_dims.add(s.dim.text)
            for a in s.axes:
                if spec.mesh is not None and a.text not in known_axes:
                    out.append(_unknown_axis(a, axes))
                elif a.text in used:
                    message = (
                        f"axis {a.text!r} is used twice in one placement: "
                        f"it already shards dimension {used[a.text]!r}"
                        if used[a.text] != s.dim.text
                        else f"axis {a.text!r} is listed twice for dimension {s.dim.text!r}"
                    )
                    out.append(
                        diag(
                            "SS012",
                            message,
                            a.span,
                            "a mesh axis shards at most one dimension of a tensor once",
                        )
                    )
                used.setdefault(a.text, s.dim.text)
        for a in rule.replicate:
            if spec.mesh is not None and a.text not in known_axes:
                out.append(_unknown_axis(a, axes))
            elif a.text in used:
                out.append(
                    diag(
                        "SS012",
                        f"axis {a.text!r} is both replicated and sharding "
                        f"dimension {used[a.text]!r}",
                        a.span,
                        "drop it from `replicate` or from the `shard` statement",
                    )
                )
        for a in rule.local:
            if spec.mesh is not None and a.text not in known_axes:
                out.append(_unknown_axis(a, axes))
            elif a.text not in used:
                out.append(
                    diag(
                        "SS026",
                        f"local axis {a.text!r} shards no dimension of this rule",
                        a.span,
                        "a local axis must appear in a `shard` statement",
                    )
                )
        local = {a.text for a in rule.local}
        for s in rule.shards:
            names = [a.text for a in s.axes]
            for k, axis in enumerate(names):
                before = [b for b in names[:k] if b not in local]
                if axis in local and before:
                    out.append(
                        diag(
                            "SS026",
                            f"local axis {axis!r} comes after non-local axis "
                            f"{before[0]!r} on dimension {s.dim.text!r}",
                            s.axes[k].span,
                            "the module holds a whole block of its local axes: list "
                            "them first (outermost)",
                        )
                    )
        return out

    return _each(spec.rules, one, broken)


def check_fusions(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS020, SS052: fused dimensions exist, are fused once, and name their components well.

    Component sizes against the tensor need shapes; :mod:`shardspec.core.layout` checks those
    (SS050, SS051).
    """

    def one(rule: ir.Rule) -> list[Diagnostic]:
        out: list[Diagnostic] = []
        dims = [d.text for d in rule.dims]
        fused: set[str] = set()
        for f in rule.fusions:
            if f.dim.text not in dims and rule.dims_given:
                out.append(
                    diag(
                        "SS020",
                        f"unknown dimension {f.dim.text!r}",
                        f.dim.span,
                        did_you_mean(f.dim.text, dims),
                    )
                )
            if f.dim.text in fused:
                out.append(
                    diag(
                        "SS052",
                        f"dimension {f.dim.text!r} is fused twice",
                        f.span,
                        "describe all components in one `fuse` statement",
                    )
                )
            fused.add(f.dim.text)
            names = [c.name.text for c in f.components]
            for c in f.components:
                if names.count(c.name.text) > 1:
                    out.append(
                        diag(
                            "SS052",
                            f"component {c.name.text!r} is named twice",
                            c.name.span,
                            "component names must differ",
                        )
                    )
                    break
            sized = [c.size is not None for c in f.components]
            if any(sized) and not all(sized):
                c = f.components[sized.index(False)]
                out.append(
                    diag(
                        "SS052",
                        f"component {c.name.text!r} has no size while others have one",
                        c.span,
                        "give every component a size, or none (equal parts)",
                    )
                )
            if len(f.components) < 2 and not f.groups:
                out.append(
                    diag(
                        "SS052",
                        "a fusion needs at least two components",
                        f.span,
                        "list the components, e.g. `fuse ffn as gate, up`",
                    )
                )
            if f.groups is not None and f.groups < 1:
                out.append(
                    diag(
                        "SS052",
                        "the group count must be at least 1",
                        f.span,
                        "write `fuse DIM as N groups of ...` with N >= 1, or leave out "
                        "`N groups of` for one group",
                    )
                )
        if len({f.dim.text for f in rule.fusions}) > 1:
            first = rule.fusions[0]
            other = next(f for f in rule.fusions if f.dim.text != first.dim.text)
            out.append(
                diag(
                    "SS052",
                    f"dimensions {first.dim.text!r} and {other.dim.text!r} are both fused; "
                    "a parameter has at most one fused dimension",
                    other.span,
                    "a checkpoint stores a fused parameter per component of one dimension; "
                    "split the parameter, or fuse one dimension only",
                )
            )
        return out

    return _each(spec.rules, one, broken)


def _sub_span(pattern: ir.Pattern, text: str) -> Span:
    """The span of ``text`` inside a pattern (the whole pattern if it is not there)."""
    at = pattern.text.find(text)
    sp = pattern.span
    if at < 0:
        return sp
    return Span(sp.file, sp.line, sp.col + at, sp.line, sp.col + at + len(text))


def check_name_indexed(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """Dimensions indexed by a capture in the pattern (per-expert local modules)."""

    def one(rule: ir.Rule) -> list[Diagnostic]:
        out: list[Diagnostic] = []
        try:
            glob = compile_glob(rule.pattern.text)
        except PatternError:
            return out
        dims = {d.text: d for d in rule.dims}
        local = {a.text for a in rule.local}
        for cap in glob.captures:
            if cap not in dims:
                out.append(
                    diag(
                        "SS027",
                        f"capture {{{cap}}} names no dimension of the rule",
                        _sub_span(rule.pattern, "{" + cap + "}"),
                        f"add {cap!r} to the dimension list (it "
                        "indexes the modules), or write `*` to match any segment",
                    )
                )
        for s in rule.shards:
            if s.dim.text in glob.captures:
                nonlocal_axes = [a for a in s.axes if a.text not in local]
                for a in nonlocal_axes:
                    out.append(
                        diag(
                            "SS027",
                            f"dimension {s.dim.text!r} is indexed by module "
                            f"name, so it can only be sharded over local axes, not "
                            f"{a.text!r}",
                            a.span,
                            f"add `local {a.text}`: each rank builds only the modules it owns",
                        )
                    )
        for f in rule.fusions:
            if f.dim.text in glob.captures:
                out.append(
                    diag(
                        "SS027",
                        f"dimension {f.dim.text!r} is indexed by module name and cannot be fused",
                        f.dim.span,
                        "each module is one index of the dimension, not a component: "
                        "drop the `fuse`",
                    )
                )
        return out

    return _each(spec.rules, one, broken, captures_key)


STRUCTURE_CHECKS_BASE = (
    check_mesh,
    check_fsdp,
    check_patterns,
    check_rule_names,
    check_fusions,
    check_name_indexed,
)


def check_checkpoint_placements(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """``checkpoint shard DIM over AXIS``: only over axes the parameter is replicated on at
    run time (the FSDP default counts), never a local axis or a name-indexed dimension."""
    from shardspec.resolve.params import rule_spec
    from shardspec.resolve.views import rule_fsdp

    out: list[Diagnostic] = []
    axes = _axes(spec)
    fsdps = rule_fsdp(spec)
    for rule in rules_to_check(spec.rules, lambda r: bool(r.checkpoint_shards)):
        if not rule.checkpoint_shards:
            continue
        fsdp = fsdps.get(rule.index)
        bad = len(out)
        dims = [d.text for d in rule.dims]
        if rule.checkpoint_replicate is not None:
            out.append(
                diag(
                    "SS028",
                    "`checkpoint replicate` and `checkpoint shard` contradict each other",
                    rule.checkpoint_replicate,
                    "keep one: `checkpoint replicate` keeps the runtime chunks",
                )
            )
        try:
            runtime = rule_spec(rule, fsdp)
        except PatternError:
            continue
        used = {a: d for d, ax in runtime.shard for a in ax}
        local = {a.text for a in rule.local}
        seen: set[str] = set()
        for s in rule.checkpoint_shards:
            if s.dim.text not in dims:
                out.append(
                    diag(
                        "SS020",
                        f"unknown dimension {s.dim.text!r}",
                        s.dim.span,
                        did_you_mean(s.dim.text, dims),
                    )
                )
            elif s.dim.text in runtime.name_indexed:
                out.append(
                    diag(
                        "SS028",
                        f"dimension {s.dim.text!r} is indexed by module name; "
                        "a checkpoint cannot split it",
                        s.dim.span,
                        "split another dimension",
                    )
                )
            for a in s.axes:
                if spec.mesh is not None and a.text not in axes:
                    out.append(_unknown_axis(a, axes))
                elif a.text in local:
                    out.append(
                        diag(
                            "SS028",
                            f"axis {a.text!r} is local to this parameter",
                            a.span,
                            "a checkpoint split uses axes the parameter is replicated on",
                        )
                    )
                elif a.text in used:
                    how = (
                        " (the fsdp default)"
                        if a.text == fsdp
                        and not any(a.text in [x.text for x in sh.axes] for sh in rule.shards)
                        else ""
                    )
                    out.append(
                        diag(
                            "SS028",
                            f"axis {a.text!r} already shards dimension "
                            f"{used[a.text]!r} at run time{how}",
                            a.span,
                            "a checkpoint split uses axes the parameter is replicated "
                            "on at run time",
                        )
                    )
                elif a.text in seen:
                    out.append(
                        diag(
                            "SS012",
                            f"axis {a.text!r} is used twice in the checkpoint placement",
                            a.span,
                            "use each axis once",
                        )
                    )
                seen.add(a.text)
        if len(out) > bad:
            broken.add(rule.index)
    return out


def check_styles(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS029: a `style` line names known styles and layouts, once per rule, and fits the
    rule's placements (colwise/rowwise: one dimension over a model-parallel axis)."""
    from shardspec.core.styles import EXPERT_PARALLEL, HEADS, KINDS, LAYOUTS, mp_dims
    from shardspec.resolve.params import rule_spec
    from shardspec.resolve.views import rule_fsdp

    fsdps = rule_fsdp(spec)

    def one(rule: ir.Rule) -> list[Diagnostic]:
        out: list[Diagnostic] = []
        st = rule.style
        fsdp = fsdps.get(rule.index)
        if st is None:
            return out
        for extra in rule.extra_styles:
            out.append(
                diag("SS029", "a rule states one style", extra.span, "keep one `style` line")
            )
        kind = st.kind.text
        if kind not in KINDS:
            out.append(
                diag(
                    "SS029",
                    f"unknown style {kind!r}",
                    st.kind.span,
                    did_you_mean(kind, list(KINDS), listed_as="styles"),
                )
            )
            return out
        for what, name in (("input", st.input), ("output", st.output)):
            if name is None:
                continue
            if kind == "sequence_parallel" and what == "input" and name.text == HEADS:
                continue  # per-head activations cut by heads (q/k norms)
            if kind == "sequence_parallel":
                out.append(
                    diag(
                        "SS029",
                        f"style sequence_parallel takes no {what} layout {name.text!r}",
                        name.span,
                        "`style sequence_parallel` cuts tokens; `style sequence_parallel "
                        "input heads` cuts per-head activations [..., heads, head_dim] by heads",
                    )
                )
            elif kind in ("none", EXPERT_PARALLEL):
                out.append(
                    diag(
                        "SS029",
                        f"style {kind} takes no {what} layout",
                        name.span,
                        "layouts belong to colwise and rowwise styles",
                    )
                )
            elif name.text not in LAYOUTS:
                out.append(
                    diag(
                        "SS029",
                        f"unknown activation layout {name.text!r}",
                        name.span,
                        did_you_mean(name.text, list(LAYOUTS), listed_as="layouts"),
                    )
                )
        if kind in ("none", EXPERT_PARALLEL) or not rule.dims_given:
            return out  # (expert_parallel: SS106)
        try:
            runtime = rule_spec(rule, fsdp)
        except PatternError:
            return out
        dims = [d for d in runtime.dims if d not in runtime.name_indexed]
        sharded = mp_dims(dict(runtime.shard), dims, fsdp, set(runtime.local))
        if kind == "sequence_parallel" and sharded:
            out.append(
                diag(
                    "SS029",
                    f"sequence parallelism needs the parameter replicated over the "
                    f"model-parallel axes, but {dims[sharded[0]]!r} is sharded",
                    st.kind.span,
                    "drop the `shard` line, or state colwise or rowwise",
                )
            )
        elif kind in ("colwise", "rowwise") and len(sharded) != 1:
            what = "no dimension is" if not sharded else "several dimensions are"
            out.append(
                diag(
                    "SS029",
                    f"style {kind}: {what} sharded over a model-parallel axis",
                    st.kind.span,
                    f"{kind} needs exactly one dimension sharded over the tensor-parallel "
                    "axis (`shard out over tp`)",
                )
            )
        return out

    return _each(spec.rules, one, None, captures_key)


STRUCTURE_CHECKS = (*STRUCTURE_CHECKS_BASE, check_checkpoint_placements, check_styles)
