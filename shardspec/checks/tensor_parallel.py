"""Checks of tensor parallelism across modules (need a manifest that records module kinds,
classes and ties):

* SS036: within a block, a colwise module's local columns reach no rowwise module, or a
  rowwise module reads columns no colwise module cut (``qkv_proj`` replicated over tp,
  ``o_proj`` sharded over it).
* SS037: a tied parameter (one tensor, two modules) sharded over a model-parallel axis of
  size > 1, which ``parallelize`` refuses.
* SS038: torch's colwise or rowwise style on a module whose class runs a forward of its own.
* SS109: a per-head norm (a ``[head_dim]`` weight beside projections cut over tp by heads)
  replicated over tp without `style sequence_parallel input heads`: its gradient is a
  per-rank part that nothing sums.
* SS115: sequence parallelism half declared: in a view whose norms are
  `style sequence_parallel`, a rowwise module without `output sequence`, or a token
  embedding that is not `rowwise output sequence`, writes the residual stream whole.

A *block* is the smallest module holding two or more Linear or Embedding modules (an
attention, an MLP; the model itself for the embedding and the head): the check reasons from
the manifest's module kinds and the placements, not from names, so it does not guess which
module feeds which. A block is right over an axis when its modules are all replicated over
it, or colwise modules feed rowwise ones. Modules that hold local shards over the axis
(Megatron style), run their own forward (``style none``) or are neither Linear nor
Embedding take part in ways lint cannot see: their block is not checked over that axis.
With views, a module takes part only in the verdicts over its own view's axes: one on the
expert view is no reader of the dense view's tp cut.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from shardspec.core.styles import (
    EMBEDDING,
    HEADS,
    LINEAR,
    custom_module_hint,
    derive,
    runs_torch_forward,
    why_not_torch,
)
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend import ir
from shardspec.resolve.params import Match, Resolved

# What a module is to its block over one axis.
PRODUCER, CONSUMER, REPLICATED, EXEMPT = "producer", "consumer", "replicated", "exempt"
NEUTRAL = "neutral"  # cut, with whole activations in and out (`output replicate`)


@dataclass(slots=True)
class _Module:
    """A module holding placed parameters: its kind, its weight's rule and, per
    model-parallel axis, what it is to its block (modules alike share one ``roles``)."""

    name: str
    kind: str | None
    rule: int
    roles: dict[str, str]  # axis -> role (absent: replicated)
    dtensor: bool = False  # a producer whose output stays a DTensor
    view_axes: frozenset[str] | None = None  # its rule's view's axes (None: no views)

    def on(self, axis: str) -> bool:
        """Whether the module is laid out on a mesh with ``axis``: with views, a module on
        another view neither cuts nor reads the axis's cut (it can be sharded only over
        its own view's axes), so it takes no part in the axis's verdict."""
        return self.view_axes is None or axis in self.view_axes


def _owner(fqn: str) -> tuple[str, str]:
    owner, _, leaf = fqn.rpartition(".")
    return owner, leaf


def _mp_axes(m: Match, fsdp: str | None) -> dict[str, int]:
    """Model-parallel axis -> the tensor dimension of ``m``'s parameter it shards (local
    axes and the fsdp axis left out)."""
    assert m.layout is not None
    return {
        a: i
        for i, d in enumerate(m.layout.tensor_dims())
        for a in d.axes
        if a != fsdp and a not in m.layout.local
    }


def _style(res: Resolved, m: Match, fsdp: str | None) -> tuple[str | None, str | None]:
    """(the colwise/rowwise style the module of parameter ``m`` gets, stated or derived,
    or None; the style the spec states, or None)."""
    assert m.winner is not None
    st = res.spec.rules[m.winner].style
    stated = st.kind.text if st is not None else None
    dims = set(_mp_axes(m, fsdp).values())
    derived = derive(m.entry.module, "weight", dims.pop()) if len(dims) == 1 else None
    if stated is not None and derived is not None and stated != derived:
        return None, stated  # a style the placements contradict (SS032)
    style = stated or derived
    return (style if style in ("colwise", "rowwise") else None), stated


def _modules(res: Resolved) -> dict[str, _Module]:
    """Every module holding a placed parameter, with its role per model-parallel axis.
    Modules whose parameters share rules, layouts and kinds (every layer's) share roles,
    worked out once."""
    params: dict[str, dict[str, Match]] = defaultdict(dict)
    for fqn, m in res.matches.items():
        if m.layout is not None and m.winner is not None and m.ignored_by is None:
            if m.entry.kind == "param":
                owner, _, leaf = fqn.rpartition(".")
                params[owner][leaf] = m
    out: dict[str, _Module] = {}
    known: dict[tuple, tuple[dict[str, str], bool]] = {}
    view_axes = (
        {v: frozenset(axes) for v, axes in res.views.axes}
        if res.views is not None and len(res.views.names) > 1
        else {}
    )
    for owner, leaves in params.items():
        weight = leaves.get("weight")
        first = weight or next(iter(leaves.values()))
        key = tuple([(leaf, m.winner, id(m.layout), m.entry.module) for leaf, m in leaves.items()])
        if key not in known:
            known[key] = _roles(res, leaves, res.fsdp_of_rule(first.winner))
        roles, dtensor = known[key]
        kind = weight.entry.module if weight is not None else None
        out[owner] = _Module(
            owner,
            kind,
            first.winner,  # type: ignore[arg-type]
            roles,
            dtensor,
            view_axes.get(res.rule_views.get(first.winner)) if view_axes else None,  # type: ignore[arg-type]
        )
    return out


def _roles(
    res: Resolved, leaves: dict[str, Match], fsdp: str | None
) -> tuple[dict[str, str], bool]:
    """(model-parallel axis -> role, whether a producer's output stays a DTensor) of the
    module holding ``leaves`` (its parameters by leaf name)."""
    roles: dict[str, str] = {}
    weight = leaves.get("weight")
    kind = weight.entry.module if weight is not None else None
    local = {a for m in leaves.values() if m.layout is not None for a in m.layout.local}
    sharded = {a for m in leaves.values() for a in _mp_axes(m, fsdp)} - local
    roles.update((a, EXEMPT) for a in local)
    if weight is None or kind not in (LINEAR, EMBEDDING):
        roles.update((a, EXEMPT) for a in sharded)
        return roles, False
    style, _ = _style(res, weight, fsdp)
    st = res.spec.rules[weight.winner].style  # type: ignore[index]
    cut = _mp_axes(weight, fsdp)
    dtensor = False
    for a in sharded:
        if style is None or a not in cut:
            roles[a] = EXEMPT  # its own forward, or a bias cut alone (SS032)
            continue
        default_in = "features" if style == "rowwise" and kind == LINEAR else "replicate"
        default_out = "features" if style == "colwise" else "replicate"
        inp = st.input.text if st is not None and st.input is not None else default_in
        outp = st.output.text if st is not None and st.output is not None else default_out
        if style == "colwise" and outp == "features":
            roles[a] = PRODUCER
            dtensor = st is not None and st.dtensor
        elif style == "rowwise" and inp == "features":
            roles[a] = CONSUMER
        else:
            roles[a] = NEUTRAL
    return roles, dtensor


def _blocks(modules: dict[str, _Module]) -> dict[str, list[_Module]]:
    """Block name -> its modules: each module's nearest enclosing module that holds two or
    more Linear or Embedding modules (modules of a model with fewer belong to none).

    Counts saturate at 2: a module enclosing two members makes every module around it a
    candidate too, so each member's walk up stops at the first such module, and the work
    is about one step per module."""
    count: dict[str, int] = {}  # enclosing module -> members inside, up to 2
    for name, mod in modules.items():
        if mod.kind not in (LINEAR, EMBEDDING):
            continue
        while name:
            name = name.rpartition(".")[0]
            before = count.get(name, 0)
            if before >= 2:
                break
            count[name] = before + 1
    out: dict[str, list[_Module]] = defaultdict(list)
    for name, mod in modules.items():
        while name:
            name = name.rpartition(".")[0]
            if count.get(name, 0) >= 2:
                out[name].append(mod)
                break
    return out


def _names(block: str, mods: list[_Module], limit: int = 4) -> str:
    rel = [m.name[len(block) + 1 :] if block else m.name for m in mods]
    shown = ", ".join(rel[:limit])
    return shown + (f" and {len(rel) - limit} more" if len(rel) > limit else "")


def _are(mods: list[_Module]) -> str:
    return "is" if len(mods) == 1 else "are"


def _verdicts(mods: list[_Module], sizes: dict[str, int]) -> list[tuple[str, str]]:
    """(axis, PRODUCER or CONSUMER) for each model-parallel axis of size > 1 over which a
    block's cut output reaches no rowwise module (PRODUCER) or a rowwise module reads
    input nobody cut (CONSUMER)."""
    out = []
    for axis in sorted({a for m in mods for a in m.roles if sizes[a] > 1}):
        roles = [(m, m.roles.get(axis, REPLICATED)) for m in mods if m.on(axis)]
        if any(r == EXEMPT for _, r in roles):
            continue
        producers = [m for m, r in roles if r == PRODUCER]
        consumers = any(r == CONSUMER for _, r in roles)
        if consumers and not producers:
            out.append((axis, CONSUMER))
        elif any(not m.dtensor for m in producers) and not consumers:
            out.append((axis, PRODUCER))
    return out


def check_unpaired_cuts(res: Resolved) -> list[Diagnostic]:
    """SS036: per block and model-parallel axis of size > 1, colwise modules whose
    output stays cut and rowwise modules that read cut input come together."""
    if res.mesh is None:
        return []
    sizes = res.axis_sizes
    rules = res.spec.rules
    if not any(m.entry.module in (LINEAR, EMBEDDING) for m in res.matches.values()):
        return []  # no module kinds recorded (an older manifest), or no Linear at all
    modules = _modules(res)
    if not any(
        sizes[a] > 1 and r in (PRODUCER, CONSUMER)
        for m in modules.values()
        for a, r in m.roles.items()
    ):
        return []  # no output stays cut, and no input is read cut
    # Blocks alike (every layer's attention) share a verdict, worked out once.
    verdicts: dict[tuple, list[tuple[str, str]]] = {}
    found: dict[tuple, str] = {}  # finding -> the first block (by name) that shows it
    counts: dict[tuple, int] = defaultdict(int)
    blocks = _blocks(modules)
    for block, mods in blocks.items():
        alike = tuple((m.rule, m.kind, id(m.roles), m.dtensor) for m in mods)
        if alike not in verdicts:
            verdicts[alike] = _verdicts(mods, sizes)
        for axis, kind in verdicts[alike]:
            key = (axis, kind, tuple(sorted((m.rule, m.roles.get(axis, "")) for m in mods)))
            counts[key] += 1
            found[key] = min(found.get(key, block), block)
    out = []
    for key, block in found.items():
        axis, n = key[0], sizes[key[0]]
        mods = sorted(blocks[block], key=lambda m: m.name)
        roles = [(m, m.roles.get(axis, REPLICATED)) for m in mods if m.on(axis)]
        producers = [m for m, r in roles if r == PRODUCER]
        consumers = [m for m, r in roles if r == CONSUMER]
        whole = [m for m, r in roles if r == REPLICATED and m.kind in (LINEAR, EMBEDDING)]
        more = f" (and {counts[key] - 1} more like it)" if counts[key] > 1 else ""
        where = f"in {block or 'the model'}{more}"
        if key[1] == CONSUMER:
            rest = f": {_names(block, whole)} {_are(whole)} replicated over {axis}" if whole else ""
            message = (
                f"{where}, {_names(block, consumers)} "
                f"{'reads its' if len(consumers) == 1 else 'read their'} input as features cut "
                f"over {axis} (rowwise, size {n}), but no module there cuts its output that "
                f"way{rest}"
            )
            hint = (
                f"shard the out dimension of {_names(block, whole)} over {axis} too (colwise), "
                f"or keep {_names(block, consumers)} replicated over {axis}"
                if whole
                else f"keep {_names(block, consumers)} replicated over {axis}, or state "
                "`input replicate` where the input is whole"
            )
            span = rules[consumers[0].rule].pattern.span
        else:
            rest = (
                f": {_names(block, whole)} {_are(whole)} replicated over {axis} and would read "
                "a rank's columns as the whole"
                if whole
                else f": the output leaves {block or 'the model'} cut"
            )
            message = (
                f"{where}, {_names(block, producers)} "
                f"{'cuts its' if len(producers) == 1 else 'cut their'} output on the features "
                f"over {axis} (colwise, size {n}), but no module there reads features cut "
                f"that way{rest}"
            )
            rowwise = (
                f"shard the in dimension of {_names(block, whole)} over {axis} (rowwise), "
                if whole
                else ""
            )
            hint = (
                f"{rowwise}keep {_names(block, producers)} replicated over {axis}, or gather "
                "the output with `style colwise output replicate` (`dtensor` hands it on as a "
                "DTensor, for loss parallelism)"
            )
            span = rules[producers[0].rule].pattern.span
        out.append(diag("SS036", message, span, hint))
    return out


def check_tied_sharded(res: Resolved) -> list[Diagnostic]:
    """SS037: a tied parameter (the manifest's ``tied_to``) sharded over a model-parallel
    axis of size > 1, unless a pipeline puts its two names on different stages."""
    if res.mesh is None or res.manifest is None:
        return []
    sizes = res.axis_sizes
    out = []
    reported: set[tuple[int | None, ...]] = set()
    for entry in res.manifest.params:
        if entry.tied_to is None:
            continue
        alias, source = entry.fqn, entry.tied_to
        sp = res.stages
        where = (sp.stage_of(alias), sp.stage_of(source)) if sp is not None else (None, None)
        if None not in where and where[0] != where[1]:
            continue  # two tensors, one per stage (a pipeline tie's alias and its source)
        cut: list[tuple[Match, list[str]]] = []
        for name in (source, alias):
            m = res.matches.get(name)
            if m is None or m.layout is None or m.winner is None or m.ignored_by is not None:
                continue
            axes = sorted(a for a in _mp_axes(m, res.fsdp_of_rule(m.winner)) if sizes[a] > 1)
            if axes:
                cut.append((m, axes))
        if not cut:
            continue
        key = tuple(res.matches[n].winner if n in res.matches else None for n in (source, alias))
        if key in reported:
            continue
        reported.add(key)
        m, axes = cut[0]
        shown = ", ".join(f"{a} (size {sizes[a]})" for a in axes)
        assert m.winner is not None
        out.append(
            diag(
                "SS037",
                f"{alias} is tied to {source} (one tensor used by two modules), and "
                f"{m.entry.fqn} is sharded over {shown}: torch's styles cut the weight for "
                "each module apart, which parts the tie, so parallelize refuses the model",
                res.spec.rules[m.winner].pattern.span,
                f"keep the tied weight replicated over {', '.join(axes)} (`replicate "
                f"{', '.join(axes)}`), untie the weights in the model, or put the two "
                "modules on different pipeline stages; distribute, load_hf and export_hf keep "
                "the tie (a spec for checkpoint conversion may suppress this warning)",
            )
        )
    return out


def refused_style(res: Resolved, m: Match) -> tuple[str, bool, str] | None:
    """What SS038 refuses of the module holding ``m``'s parameter (its weight, a Linear
    or Embedding of a class that runs a forward of its own, recorded by the manifest):
    (torch's colwise or rowwise style it gets, whether the rule states it, why torch's
    style does not fit); None when nothing is refused. ``shardspec explain`` says the same."""
    forward = m.entry.forward_class
    if m.layout is None or m.winner is None or forward is None or runs_torch_forward(forward):
        return None
    if _owner(m.entry.fqn)[1] != "weight" or m.entry.module not in (LINEAR, EMBEDDING):
        return None
    style, stated = _style(res, m, res.fsdp_of_rule(m.winner))
    if style is None:
        return None
    return style, stated is not None, why_not_torch(m.entry.cls or forward, forward, style)


def check_custom_modules(res: Resolved) -> list[Diagnostic]:
    """SS038: torch's colwise/rowwise style (stated or derived) on a module whose class
    runs a forward of its own (manifests that record classes only)."""
    first: dict[int, tuple[Match, str, bool, str]] = {}
    count: dict[int, int] = defaultdict(int)
    for _fqn, m in res.params:
        refused = refused_style(res, m)
        if refused is None:
            continue
        assert m.winner is not None
        count[m.winner] += 1
        first.setdefault(m.winner, (m, *refused))
    out = []
    for rule_index, (m, style, stated, why) in sorted(first.items()):
        rule: ir.Rule = res.spec.rules[rule_index]
        more = f" (and {count[rule_index] - 1} more like it)" if count[rule_index] > 1 else ""
        how = "stated" if stated else "derived from its placements"
        span = rule.style.kind.span if stated and rule.style is not None else rule.pattern.span
        out.append(
            diag(
                "SS038",
                f"{m.entry.fqn}{more} gets torch's {style} style ({how}), but its module {why}",
                span,
                custom_module_hint(lint=True),
            )
        )
    return out


def _head_cuts(res: Resolved) -> dict[str, dict[tuple[str, int], str]]:
    """Per module, the parameters of its children cut by heads: module -> (model-parallel
    axis of size > 1, head size) -> the first such parameter (by name). ``q_proj.weight``
    of ``attn`` with ``heads out 16`` and ``shard out over tp`` gives
    ``{"attn": {("tp", 16): "attn.q_proj.weight"}}``."""
    from shardspec.checks.heads import rule_heads

    heads, _ = rule_heads(res)  # (SS035: reported by the heads checks)
    out: dict[str, dict[tuple[str, int], str]] = defaultdict(dict)
    if not heads:
        return out
    sizes = res.axis_sizes
    for fqn, m in res.params:
        if m.winner not in heads or m.layout is None:
            continue
        fsdp = res.fsdp_of_rule(m.winner)
        block = _owner(_owner(fqn)[0])[0]
        for d in m.layout.tensor_dims():
            for a in d.axes:
                if a == fsdp or a in m.layout.local or sizes.get(a, 1) < 2:
                    continue
                for size in set(heads[m.winner].of(d.name).values()):
                    out[block].setdefault((a, size), fqn)
    return out


def _per_head_style(rule: ir.Rule) -> bool:
    st = rule.style
    return (
        st is not None
        and st.kind.text == "sequence_parallel"
        and st.input is not None
        and st.input.text == HEADS
    )


def check_head_norms(res: Resolved) -> list[Diagnostic]:
    """SS109: a one-dimensional parameter (a per-head q/k norm's weight) replicated over a
    model-parallel axis, whose size is the head size of a sibling module's parameter cut
    over that axis by heads, without `style sequence_parallel input heads`: each rank's
    gradient of it is its heads' part only, and nothing sums it over the axis."""
    if res.mesh is None or res.manifest is None:
        return []
    cuts = _head_cuts(res)
    if not cuts:
        return []
    first: dict[int, tuple[str, str, str, int]] = {}
    count: dict[int, int] = defaultdict(int)
    for fqn, m in res.params:
        assert m.winner is not None
        if m.layout is None or m.entry.module in (LINEAR, EMBEDDING):
            continue
        dims = m.layout.tensor_dims()
        siblings = cuts.get(_owner(_owner(fqn)[0])[0])
        if len(dims) != 1 or not siblings or _per_head_style(res.spec.rules[m.winner]):
            continue
        mesh = res.mesh_for(m)
        own = set(dims[0].axes)
        for (axis, size), proj in sorted(siblings.items()):
            if size == dims[0].size and axis not in own and mesh and axis in mesh.names:
                count[m.winner] += 1
                first.setdefault(m.winner, (fqn, proj, axis, size))
                break
    out = []
    for rule_index, (fqn, proj, axis, size) in sorted(first.items()):
        rule: ir.Rule = res.spec.rules[rule_index]
        more = f" (and {count[rule_index] - 1} more like it)" if count[rule_index] > 1 else ""
        out.append(
            diag(
                "SS109",
                f"{fqn}{more} is replicated over {axis}, and its size {size} is the head "
                f"size of {proj}, which is cut over {axis} by heads: a per-head norm reads "
                f"only its {axis} rank's heads, so each rank's gradient of it is a part, and "
                "without a style nothing sums the parts (the replicas drift apart)",
                rule.pattern.span,
                "add `style sequence_parallel input heads` to its rule (torch's "
                "SequenceParallel on the heads dimension sums the gradient over "
                f"{axis}); if it is not read per head, suppress this finding",
            )
        )
    return out


def check_sequence_parallel(res: Resolved) -> list[Diagnostic]:
    """SS115: in a view where a `style sequence_parallel` rule cuts the activations by
    tokens, a module that writes the residual stream whole: a rowwise module (stated or
    derived) without `output sequence`, or a token embedding that is not `rowwise output
    sequence`. The sequence-parallel norms read their input as the rank's slice of the
    sequence (torch's SequenceParallel annotates it `Shard(1)`), so a whole one is taken
    for a slice: the sequence comes out tp times too long, or wrong."""
    if res.mesh is None or res.manifest is None:
        return []
    from shardspec.checks.layouts import rule_styles
    from shardspec.core.styles import cuts_tokens

    sp: dict[str, ir.Rule] = {}
    matched = {m.winner for _, m in res.params}
    for rule in res.spec.rules:
        if rule.index not in matched:  # a rule that places nothing (SS041) asks nothing
            continue
        st = rule.style
        if st is not None and cuts_tokens(
            {"kind": st.kind.text, "input": st.input.text if st.input is not None else None}
        ):
            sp.setdefault(res.rule_views.get(rule.index, ""), rule)
    if not sp:
        return []
    derived = rule_styles(res)
    out: list[Diagnostic] = []
    for index, (fqn, kind, module, _) in sorted(derived.items()):
        rule = res.spec.rules[index]
        norm = sp.get(res.rule_views.get(index, ""))
        if norm is None or module not in (LINEAR, EMBEDDING):
            continue
        st = rule.style
        stated = st.kind.text if st is not None else None
        if stated == "none" or (stated is None and kind == "?"):
            continue  # the module's own forward: lint cannot see what it writes
        style = stated or kind
        output = st.output.text if st is not None and st.output is not None else None
        if output == "sequence":
            continue
        if style == "rowwise":
            what = f"{fqn} is rowwise without `output sequence`: its output is whole"
        elif module == EMBEDDING and style != "colwise":
            what = f"the token embedding {fqn} is not cut over tp: its output is whole"
        else:
            continue
        line = norm.pattern.span.line
        out.append(
            diag(
                "SS115",
                f"{what} on every rank, but `style sequence_parallel` (line {line}) reads "
                "the residual stream as each rank's slice of the sequence: a whole tensor "
                "would be taken for a slice",
                (st.kind.span if st is not None else rule.pattern.span),
                "state `style rowwise output sequence` (for the embedding: `shard vocab "
                "over tp` too), as Megatron's and torchtitan's sequence parallelism "
                "do; or drop `style sequence_parallel` from the norms",
            )
        )
    return out


TENSOR_PARALLEL_CHECKS = (
    check_unpaired_cuts,
    check_tied_sharded,
    check_custom_modules,
    check_head_norms,
    check_sequence_parallel,
)
