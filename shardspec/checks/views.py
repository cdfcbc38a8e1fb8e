"""Checks on views (named meshes: several factorizations of one world) and on the
expert-parallel style: SS100-SS108.

Spec-only checks take ``(spec, broken)`` like the structure checks; the rest read the
resolved facts (sizes, and with a manifest the parameters and their modules).
"""

from __future__ import annotations

import itertools
from collections import defaultdict

from shardspec.core.layout import Mesh
from shardspec.core.styles import EXPERT_PARALLEL, TENSOR_PARALLEL_KINDS, cuts_tokens
from shardspec.core.views import Views
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.findings.suggest import did_you_mean
from shardspec.frontend import ir
from shardspec.frontend.ir import rules_to_check
from shardspec.resolve.params import Resolved
from shardspec.resolve.views import named_views, rule_fsdp, views_of

# Views are compared rank by rank up to this world size (SS108); beyond it, a sample.
_RANKS_CHECKED = 1 << 16


def check_view_declarations(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS100: an unnamed mesh beside views, two views of one name. SS101: views whose
    stated world sizes differ. SS102: shared axes that are not one prefix of every view
    (same order, same sizes). SS103: an FSDP axis per view, own and once. SS105: the
    pipeline axis is shared by every view."""
    if not spec.views:
        return []
    out: list[Diagnostic] = []
    seen: dict[str, ir.MeshDecl] = {}
    for m in spec.views:
        if m.name is None:
            out.append(
                diag(
                    "SS100",
                    "an unnamed mesh beside named meshes (views)",
                    m.span,
                    "name it (`mesh dense { ... }`), or fold its axes into a view: a spec has "
                    "one unnamed mesh or views only",
                )
            )
            continue
        if m.name.text in seen:
            out.append(
                diag(
                    "SS100",
                    f"view {m.name.text!r} is declared twice",
                    m.name.span,
                    f"the first is at line {seen[m.name.text].span.line}; give each view "
                    "a name of its own",
                )
            )
        seen.setdefault(m.name.text, m)
    worlds = [m for m in seen.values() if m.world is not None]
    for m in worlds[1:]:
        if m.world != worlds[0].world:
            out.append(
                diag(
                    "SS101",
                    f"view {m.name.text!r} is over {m.world} ranks, but view "  # type: ignore[union-attr]
                    f"{worlds[0].name.text!r} over {worlds[0].world}",  # type: ignore[union-attr]
                    m.span,
                    "every view factors the same ranks: state one world size (or one `over` only)",
                )
            )
    views = views_of(spec)
    assert views is not None
    out.extend(_shared_axes(list(seen.values()), views))
    out.extend(_fsdp_axes(spec, list(seen.values()), views))
    if spec.pipeline is not None:
        axis = spec.pipeline.axis
        lacking = [m for m in seen.values() if axis.text not in {a.name.text for a in m.axes}]
        if lacking and len(lacking) < len(seen):
            out.append(
                diag(
                    "SS105",
                    f"pipeline axis {axis.text!r} is not an axis of view {lacking[0].name.text!r}",  # type: ignore[union-attr]
                    axis.span,
                    f"declare {axis.text} first in every view: each stage holds its dense "
                    "and expert parameters on the same ranks",
                )
            )
    return out


def _shared_axes(meshes: list[ir.MeshDecl], views: Views) -> list[Diagnostic]:
    """SS102: shared axes come first in every view that has them, in one order, with one
    size."""
    out = []
    shared = set(views.shared)
    order = [a for a in views.all_axes if a in shared]
    sizes: dict[str, ir.AxisDecl] = {}
    for m in meshes:
        mine = [a for a in m.axes if a.name.text in shared]
        prefix = m.axes[: len(mine)]
        own = [a.name.text for a in m.axes if a.name.text not in shared]
        for i, a in enumerate(mine):
            if a is not prefix[i]:
                owners = ", ".join(repr(v) for v in views.views_of(a.name.text))
                out.append(
                    diag(
                        "SS102",
                        f"axis {a.name.text!r} is declared in views {owners}, but view "
                        f"{m.name.text!r} declares it after its own axis {own[0]!r}",  # type: ignore[union-attr]
                        a.name.span,
                        "axes shared by views (pp, dp_replicate) come first, outermost; "
                        "give a view's own axes names no other view uses",
                    )
                )
                break
        else:
            want = [a for a in order if a in {x.name.text for x in mine}]
            if [a.name.text for a in mine] != want:
                out.append(
                    diag(
                        "SS102",
                        f"view {m.name.text!r} orders its shared axes "  # type: ignore[union-attr]
                        f"{', '.join(a.name.text for a in mine)}, another view {', '.join(want)}",
                        mine[0].name.span,
                        "shared axes come in the same order in every view",
                    )
                )
        for a in mine:
            prev = sizes.setdefault(a.name.text, a)
            if prev.size != a.size:
                out.append(
                    diag(
                        "SS102",
                        f"shared axis {a.name.text!r} has size {_size_text(a)} here, "
                        f"{_size_text(prev)} at line {prev.span.line}",
                        a.span,
                        "a shared axis has one size in every view",
                    )
                )
    return out


def _size_text(a: ir.AxisDecl) -> str:
    return "*" if a.size is None else str(a.size)


def _fsdp_axes(spec: ir.Spec, meshes: list[ir.MeshDecl], views: Views) -> list[Diagnostic]:
    """SS103: each view's FSDP axis is one of its own axes, given once; with any, every
    view has one."""
    out = []
    shared = set(views.shared)
    given: dict[str, ir.Name] = {}
    for f in spec.fsdps:
        owners = views.views_of(f.text)
        if not owners:
            continue  # SS011
        if f.text in shared:
            out.append(
                diag(
                    "SS103",
                    f"fsdp axis {f.text!r} is shared by views {', '.join(map(repr, owners))}",
                    f.span,
                    "each view has an FSDP axis of its own (torchtitan's fsdp and efsdp): "
                    "name an axis only one view declares",
                )
            )
            continue
        view = owners[0]
        if view in given:
            out.append(
                diag(
                    "SS103",
                    f"view {view!r} has two fsdp axes, {given[view].text!r} and {f.text!r}",
                    f.span,
                    "give each view one `fsdp AXIS`",
                )
            )
            continue
        given[view] = f
    if given:
        for m in meshes:
            assert m.name is not None
            if m.name.text not in given:
                own = [a.name.text for a in m.axes if a.name.text not in shared]
                out.append(
                    diag(
                        "SS103",
                        f"view {m.name.text!r} has no fsdp axis, but view "
                        f"{next(iter(given))!r} has one",
                        m.name.span,
                        f"add `fsdp AXIS` naming one of view {m.name.text!r}'s own axes"
                        + (f" ({', '.join(own)})" if own else "")
                        + ": FSDP2 shards each view's parameters over its own axis",
                    )
                )
    return out


def check_rule_views(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS104: a rule's view: ``view NAME`` names a view, once, and agrees with the axes the
    rule names; a rule names the own axes of one view only. Such rules are broken."""
    out: list[Diagnostic] = []
    views = views_of(spec)

    def one(rule: ir.Rule) -> list[Diagnostic]:
        found = []
        for extra in rule.extra_views:
            found.append(diag("SS104", "a rule states one view", extra.span, "keep one `view`"))
        stated = rule.view
        if stated is not None and (views is None or not spec.views):
            found.append(
                diag(
                    "SS104",
                    f"`view {stated.text}`, but the spec has one unnamed mesh",
                    stated.span,
                    "views are named meshes (`mesh expert { efsdp: *  ep: 2 }`); without "
                    "them every rule is on the mesh: drop the `view` line",
                )
            )
        elif stated is not None and views is not None and stated.text not in views.names:
            found.append(
                diag(
                    "SS104",
                    f"unknown view {stated.text!r}",
                    stated.span,
                    did_you_mean(stated.text, list(views.names), listed_as="views"),
                )
            )
        elif views is not None and spec.views:
            named = named_views(views, rule)
            if len(named) > 1:
                (v1, a1), (v2, a2) = list(named.items())[:2]
                found.append(
                    diag(
                        "SS104",
                        f"the rule names axis {a1.text!r} of view {v1!r} and axis "
                        f"{a2.text!r} of view {v2!r}",
                        a2.span,
                        "a parameter lives on one view: use that view's axes only (an "
                        "expert's tensor parallelism takes an axis of the expert view, etp)",
                    )
                )
            elif stated is not None and named and stated.text not in named:
                (v1, a1) = next(iter(named.items()))
                found.append(
                    diag(
                        "SS104",
                        f"`view {stated.text}`, but axis {a1.text!r} is an axis of view {v1!r}",
                        stated.span,
                        f"state `view {v1}`, or use view {stated.text!r}'s axes",
                    )
                )
        return found

    for rule in rules_to_check(spec.rules, lambda r: bool(one(r))):
        found = one(rule)
        if found:
            broken.add(rule.index)
            out.extend(found)
    return out


def check_expert_rules(spec: ir.Spec, broken: set[int]) -> list[Diagnostic]:
    """SS106 (the rule alone): ``style expert_parallel`` cuts the tensor's first dimension
    over one axis first (the EP axis), not the view's FSDP axis nor a shared axis."""
    out: list[Diagnostic] = []
    views = views_of(spec)
    fsdps = rule_fsdp(spec)
    for rule in rules_to_check(spec.rules, _ep_style):
        st = rule.style
        if st is None or st.kind.text != EXPERT_PARALLEL or rule.index in broken:
            continue
        if not rule.dims_given:
            continue
        ep = expert_axis(rule, fsdps.get(rule.index))
        if ep is None:
            first = next((d.text for d in rule.dims), "expert")
            out.append(
                diag(
                    "SS106",
                    f"style expert_parallel: the first dimension {first!r} is not cut over "
                    "an expert-parallel axis",
                    st.kind.span,
                    f"shard the stacked experts over the EP axis: `shard {first} over ep`",
                )
            )
            continue
        fsdp = fsdps.get(rule.index)
        shared = set(views.shared) if views is not None else set()
        if ep.text == fsdp or ep.text in shared:
            what = "the view's FSDP axis" if ep.text == fsdp else "an axis views share"
            out.append(
                diag(
                    "SS106",
                    f"style expert_parallel: EP axis {ep.text!r} is {what}",
                    ep.span,
                    "experts are dispatched over an axis of their own (ep); FSDP2 shards "
                    "them over the expert view's fsdp axis after it",
                )
            )
    return out


def _ep_style(rule: ir.Rule) -> bool:
    st = rule.style
    return st is not None and st.kind.text == EXPERT_PARALLEL


def expert_axis(rule: ir.Rule, fsdp: str | None) -> ir.Name | None:
    """The EP axis of an expert rule: the first axis that cuts the tensor's first
    dimension, when it is no local axis nor the FSDP axis."""
    from shardspec.core.patterns import PatternError, compile_glob

    try:
        captures = compile_glob(rule.pattern.text).captures
    except PatternError:
        return None
    first = next((d.text for d in rule.dims if d.text not in captures), None)
    local = {a.text for a in rule.local}
    for s in rule.shards:
        if s.dim.text == first and s.axes and s.axes[0].text not in local:
            return s.axes[0] if s.axes[0].text != fsdp or len(s.axes) == 1 else None
    return None


# --------------------------------------------------------------------------- resolved


def check_view_sizes(res: Resolved) -> list[Diagnostic]:
    """SS101: views that do not factor one world (their sizes, after overrides)."""
    spec = res.spec
    if not spec.views or res.mesh_error is None or res.mesh_error_code != "SS010":
        return []
    where = spec.views[0]
    for m in spec.views:
        if m.name is not None and f"view {m.name.text!r}" in res.mesh_error:
            where = m
            break
    return [
        diag(
            "SS101",
            res.mesh_error,
            where.span,
            res.mesh_error_hint
            or "every view factors the same ranks: make each view's axes multiply to one world "
            "size (`over N ranks` on any view, or `-D world=N`)",
        )
    ]


def _expert_modules(res: Resolved) -> dict[str, list[tuple[str, int]]]:
    """Every module one of whose parameters has ``style expert_parallel``: its parameters
    (name, winning rule) in the manifest."""
    rules = res.spec.rules
    by_owner: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for fqn, m in res.params:
        by_owner[fqn.rpartition(".")[0]].append((fqn, m.winner))  # type: ignore[arg-type]
    return {
        owner: params
        for owner, params in by_owner.items()
        if any(_is_expert(rules[r]) for _, r in params)
    }


def _ep_sound(res: Resolved, rule: ir.Rule) -> bool:
    """Whether an expert rule's EP axis passed the rule's own checks (SS106)."""
    fsdp = res.fsdp_of_rule(rule.index)
    ep = expert_axis(rule, fsdp)
    shared = res.views.shared if res.views is not None else ()
    return ep is not None and ep.text != fsdp and ep.text not in shared


def _is_expert(rule: ir.Rule) -> bool:
    return rule.style is not None and rule.style.kind.text == EXPERT_PARALLEL


def check_expert_modules(res: Resolved) -> list[Diagnostic]:
    """SS106 (the module): every parameter of an expert-parallel module has the style, one
    EP axis and one expert count, which the EP axis divides."""
    out: list[Diagnostic] = []
    rules = res.spec.rules
    reported: set[tuple[int, ...]] = set()
    for owner, params in sorted(_expert_modules(res).items()):
        key = tuple(sorted({r for _, r in params}))
        if key in reported:
            continue
        plain = [(f, r) for f, r in params if not _is_expert(rules[r])]
        found: Diagnostic | None = None
        if any(not _ep_sound(res, rules[r]) for f, r in params if (f, r) not in plain):
            continue  # reported rule by rule
        if plain:
            f, r = plain[0]
            found = diag(
                "SS106",
                f"{f} has no style expert_parallel, but its module {owner} does",
                rules[r].pattern.span,
                "every parameter of a stacked-experts module is dispatched together: state "
                "`style expert_parallel` on each",
            )
        else:
            eps = {}
            for f, r in params:
                name = expert_axis(rules[r], res.fsdp_of_rule(r))
                m = res.matches[f]
                eps[f] = (name.text if name else None, m.entry.shape[0] if m.entry.shape else None)
            (f0, (ep0, n0)), *rest = sorted(eps.items())
            for f, (ep, n) in rest:
                if (ep, n) != (ep0, n0):
                    r = dict(params)[f]
                    found = diag(
                        "SS106",
                        f"{f} is cut over {ep} with {n} experts, but {f0} over {ep0} with "
                        f"{n0}: one module's experts are one set",
                        rules[r].pattern.span,
                        "give every parameter of the module the same EP axis and expert count",
                    )
                    break
            mesh = res.mesh_of_rule(params[0][1])
            if found is None and ep0 and n0 and mesh is not None and ep0 in mesh.names:
                size = mesh.size(ep0)
                if n0 % size:
                    r = dict(params)[f0]
                    found = diag(
                        "SS106",
                        f"{f0}: {n0} experts do not divide over {ep0} (size {size})",
                        rules[r].pattern.span,
                        "each EP rank owns the same number of whole experts: choose an EP "
                        "size that divides the expert count",
                    )
        if found is not None:
            reported.add(key)
            out.append(found)
    return out


def _tensor_parallel_axes(res: Resolved) -> dict[str, dict[str, int]]:
    """Per view, the axes that a tensor-parallel rule (colwise, rowwise, stated or
    derived, or sequence_parallel) cuts over, each with one such rule."""
    from shardspec.checks.layouts import rule_styles

    derived = rule_styles(res)
    out: dict[str, dict[str, int]] = defaultdict(dict)
    for _, m in res.params:
        rule = res.spec.rules[m.winner]  # type: ignore[index]
        kind = rule.style.kind.text if rule.style is not None else None
        kind = kind or derived.get(m.winner, ("", ""))[1]  # type: ignore[arg-type]
        if kind not in TENSOR_PARALLEL_KINDS or m.layout is None:
            continue
        fsdp = res.fsdp_of_rule(m.winner)
        view = res.rule_views.get(m.winner, "")  # type: ignore[arg-type]
        for d in m.layout.tensor_dims():
            for a in d.axes:
                if a != fsdp and a not in m.layout.local:
                    out[view].setdefault(a, m.winner)  # type: ignore[arg-type]
    return out


def _sequence_parallel_views(res: Resolved) -> set[str]:
    """The views whose activations a `style sequence_parallel` rule cuts by tokens (not
    `input heads`, which cuts per-head activations by heads)."""
    return {
        res.rule_views.get(r.index, "")
        for r in res.spec.rules
        if r.style is not None
        and cuts_tokens({"kind": r.style.kind.text, "input": r.style.input and r.style.input.text})
    }


def check_expert_axes(res: Resolved) -> list[Diagnostic]:
    """SS107: the EP axis is cut by no tensor-parallel rule; SS108: the ranks of one EP
    group hold different tokens in every other view."""
    if res.mesh is None or res.views is None:
        return []
    out: list[Diagnostic] = []
    tp = _tensor_parallel_axes(res)
    sp_views = _sequence_parallel_views(res)
    done: set[tuple[str, str]] = set()
    for _, params in sorted(_expert_modules(res).items()):
        rule = next(res.spec.rules[r] for _, r in params if _is_expert(res.spec.rules[r]))
        view = res.rule_views.get(rule.index, "")
        axis = expert_axis(rule, res.fsdp_of_rule(rule.index))
        if axis is None or not _ep_sound(res, rule):
            continue  # SS106
        ep = axis
        if (view, ep.text) in done:
            continue
        done.add((view, ep.text))
        other = tp.get(view, {}).get(ep.text)
        if other is not None:
            out.append(
                diag(
                    "SS107",
                    f"EP axis {ep.text!r} is also the tensor-parallel axis of "
                    f"{res.spec.rules[other].pattern.text}: experts would be dispatched over "
                    "ranks that hold the same tokens cut by features",
                    ep.span,
                    "declare an expert view (`mesh expert { efsdp: *  ep: N }`) with an EP "
                    "axis of its own, and keep tp for the dense view's rules",
                )
            )
            continue
        out.extend(_ep_tokens(res, view, ep, tp, sp_views))
    return out


def _ep_tokens(
    res: Resolved, view: str, ep: ir.Name, tp: dict[str, dict[str, int]], sp_views: set[str]
) -> list[Diagnostic]:
    """SS108: in every other view, the ranks of an EP group differ in a data axis (one no
    tensor-parallel rule cuts over), so that they hold different tokens; a view whose
    activations are sequence-parallel (a `style sequence_parallel` rule) cuts tokens over
    its tensor-parallel axes too."""
    emesh = res.view_meshes.get(view)
    if emesh is None or ep.text not in emesh.names:
        return []
    for other, dmesh in res.view_meshes.items():
        if other == view or other in sp_views:
            continue
        cut = set(tp.get(other, {}))
        data = [i for i, a in enumerate(dmesh.names) if a not in cut]
        clash = _same_tokens(emesh, dmesh, emesh.names.index(ep.text), data)
        if clash is not None:
            r1, r2 = clash
            c1, c2 = dmesh.coord_of(r1), dmesh.coord_of(r2)
            diff = [a for a, x, y in zip(dmesh.names, c1, c2, strict=True) if x != y]
            return [
                diag(
                    "SS108",
                    f"ranks {r1} and {r2} are in one EP group over {ep.text!r}, but view "
                    f"{other!r} gives them the same tokens (they differ only in "
                    f"{', '.join(diff)}, which tensor-parallel rules cut by features)",
                    ep.span,
                    f"order view {view!r} so that {ep.text} takes ranks of the data axes of "
                    f"view {other!r} (fsdp, dp_replicate), e.g. put {ep.text} before the "
                    f"expert view's fsdp axis; or make the activations of view {other!r} "
                    "sequence-parallel (`style sequence_parallel` on its norms), as "
                    "torchtitan does when ep borrows tp: each tp rank then routes its own "
                    "slice of the sequence (parallelize applies it with MoESequenceParallel "
                    "on the MoE block; verify checks a trainer's own)",
                )
            ]
    return []


def _same_tokens(
    emesh: Mesh, dmesh: Mesh, ep_index: int, data: list[int]
) -> tuple[int, int] | None:
    """Two ranks of one EP group (ranks differing only in ``emesh``'s axis ``ep_index``)
    with one coordinate on ``dmesh``'s ``data`` axes; None when there are none."""
    others = [range(s) if i != ep_index else range(1) for i, s in enumerate(emesh.sizes)]
    for base in itertools.islice(itertools.product(*others), _RANKS_CHECKED):
        seen: dict[tuple[int, ...], int] = {}
        for k in range(emesh.sizes[ep_index]):
            coord = list(base)
            coord[ep_index] = k
            rank = emesh.rank_of(coord)
            d = dmesh.coord_of(rank)
            key = tuple(d[i] for i in data)
            if key in seen:
                return seen[key], rank
            seen[key] = rank
    return None


VIEW_SPEC_CHECKS = (check_view_declarations, check_rule_views, check_expert_rules)
VIEW_RESOLVED_CHECKS = (check_expert_modules, check_expert_axes)
