"""Checks on which rule places which parameter (need a manifest)."""

from __future__ import annotations

from collections import defaultdict
from functools import cached_property

from shardspec.core.patterns import Glob, describe_key
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.findings.suggest import CUTOFF, likeness
from shardspec.resolve.params import Resolved

MAX_CLOSE = 20000  # distinct parameter names (layer numbers as *) a typo is compared with
MAX_BUCKET = 1000  # of them, those differing from a pattern in one given segment


def entry_span(res: Resolved, fqn: str) -> Span:
    """Where parameter ``fqn`` stands in the model manifest."""
    assert res.manifest is not None
    line, col = res.manifest.position(fqn)
    return Span(res.manifest.path, line, col, line, col + len(fqn) + 2)


def _more(names: list[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def check_unmatched(res: Resolved) -> list[Diagnostic]:
    """SS040: every parameter has a rule or an ignore, every extra state an ignore."""
    out = []
    for fqn, m in sorted(res.matches.items()):
        if m.ignored_by is not None or m.winner is not None or m.buffer:
            continue  # (a buffer no rule matches is whole on every rank)
        if m.entry.kind == "extra_state":
            out.append(
                diag(
                    "SS040",
                    f"extra state {fqn!r} is matched by no ignore rule",
                    entry_span(res, fqn),
                    "extra state cannot be sharded; add an "
                    "ignore rule such as `ignore **._extra_state`",
                )
            )
        else:
            shape = list(m.entry.shape)
            out.append(
                diag(
                    "SS040",
                    f"parameter {fqn!r} {shape} is matched by no rule",
                    entry_span(res, fqn),
                    "add a `param` rule for it (or an `ignore` "
                    "if it must not be converted or saved)",
                )
            )
    return out


def check_unused(res: Resolved) -> list[Diagnostic]:
    """SS041 for rules and ignores that match nothing, SS042 for rules that never win."""
    out = []
    candidates: set[int] = set()
    winners: dict[int, int] = defaultdict(int)
    beaten_by: dict[int, int] = {}
    only_ignored: dict[int, int] = {}  # rule -> an ignore that takes a parameter it matches
    # A pipeline tie's alias is a parameter of its stage: a rule for it is used. So is a
    # rule for a buffer, unless the manifest is of format 1, where a "buffer" may be a
    # key that a state-dict hook writes (the hint says so).
    legacy = res.manifest is not None and res.manifest.from_state_dict
    for m in [*res.matches.values(), *res.tie_matches.values()]:
        if legacy and m.buffer:
            continue
        if m.ignored_by is not None:
            for c in m.candidates:
                only_ignored.setdefault(c, m.ignored_by)
            continue
        candidates.update(m.candidates)
        if m.winner is not None:
            winners[m.winner] += 1
            for c in m.candidates:
                if c != m.winner and c not in m.tied:
                    beaten_by.setdefault(c, m.winner)
    used_ignores = {m.ignored_by for m in res.matches.values() if m.ignored_by is not None}
    names = _Names(res)
    # An ignore also applies to entries no rule can place: buffers, and the keys that
    # state-dict hooks write (a checkpoint of state_dict() holds them).
    for i, g in res.ignore_globs.items():
        if i not in used_ignores and any(g.regex.match(f) for f, _ in names.others):
            used_ignores.add(i)
    for rule in res.spec.rules:
        if rule.index not in res.globs or rule.index in res.broken:
            continue
        if rule.index not in candidates and rule.index in only_ignored:
            ig = res.spec.ignores[only_ignored[rule.index]]
            out.append(
                diag(
                    "SS041",
                    f"rule {rule.pattern.text!r} matches only ignored parameters "
                    f"(`ignore {ig.pattern.text}`, line {ig.span.line})",
                    rule.pattern.span,
                    "an ignore takes precedence over every rule: delete the rule, or "
                    "narrow the ignore",
                )
            )
        elif rule.index not in candidates:
            out.append(
                diag(
                    "SS041",
                    f"rule {rule.pattern.text!r} matches no parameter",
                    rule.pattern.span,
                    names.hint(rule.pattern.text, res.globs[rule.index]),
                )
            )
        elif winners[rule.index] == 0 and rule.index in beaten_by:
            other = res.spec.rules[beaten_by[rule.index]]
            out.append(
                diag(
                    "SS042",
                    f"rule {rule.pattern.text!r} never wins: "
                    f"{other.pattern.text!r} (line {other.span.line}) takes precedence "
                    "for every parameter it matches",
                    rule.pattern.span,
                    "delete it, or make its pattern more specific "
                    "(precedence: literal segments, then fewer '**', then partial "
                    "segments, then literal characters)",
                )
            )
    for i, ig in enumerate(res.spec.ignores):
        if i in res.ignore_globs and i not in used_ignores:
            out.append(
                diag(
                    "SS041",
                    f"ignore {ig.pattern.text!r} matches nothing",
                    ig.pattern.span,
                    "delete it if those entries no longer exist",
                )
            )
    return out


class _Names:
    """What SS041's hints compare a pattern with, computed once per check."""

    def __init__(self, res: Resolved) -> None:
        self.res = res

    @cached_property
    def others(self) -> list[tuple[str, str]]:
        """The manifest's names that are no parameter and no extra state, each with what
        it is: ``"buffer"``, ``"hook"`` (a key a state-dict hook writes, format 2), or
        ``"legacy"`` (a buffer of a format-1 manifest, built from ``state_dict()``, which
        may be a state-dict hook's key)."""
        manifest = self.res.manifest
        assert manifest is not None
        kind = "legacy" if manifest.from_state_dict else "buffer"
        # (Rules match a format-2 manifest's buffers: a rule for one is used.)
        out = [(e.fqn, kind) for e in manifest.entries if e.kind == "buffer"]
        if manifest.state_dict is not None:
            out += [(k.fqn, "hook") for k in manifest.state_dict.added()]
        return out

    @cached_property
    def by_rest(self) -> dict[tuple[int, tuple[str, ...]], list[str]]:
        """Distinct parameter names with layer numbers written ``*`` (at most MAX_CLOSE),
        under (position, their other segments) for each position: what a pattern with a
        typo in one segment is looked up in."""
        manifest = self.res.manifest
        assert manifest is not None
        out: dict[tuple[int, tuple[str, ...]], list[str]] = defaultdict(list)
        for name in sorted({_generalized(e.fqn) for e in manifest.params})[:MAX_CLOSE]:
            segs = tuple(name.split("."))
            for i in range(len(segs)):
                out[(i, segs[:i] + segs[i + 1 :])].append(name)
        return out

    def hint(self, pattern: str, glob: Glob) -> str:
        """SS041's hint for a rule that matches no parameter: the names it does match that
        exist only in ``state_dict()`` (a state-dict hook's key, a format-1 manifest's
        "buffer"), and the rule for the parameter behind a hook's key; or, for what looks
        like a typo, the closest parameter names."""
        # (A rule that matches a buffer is used: no buffer comes up here.)
        hits = [(f, kind) for f, kind in self.others if kind != "buffer" and glob.regex.match(f)]
        hits.sort(key=lambda hit: hit[1] != "hook")  # a hook's key says the most
        n = len(hits) - 1
        more = f" (and {n} more such {_plural(n, 'name')})" if n else ""
        if hits and hits[0][1] == "hook":
            return self._hook_hint(pattern, hits[0][0], more)
        if hits:
            return (
                f"`{hits[0][0]}`{more} is in the manifest, but not as a parameter; the "
                "manifest is of format 1, built from state_dict(), where a state-dict hook's "
                "key looks like a buffer: rebuild it with `shardspec manifest` (it lists the "
                "parameters as the model holds them and reports the hooks) and write the "
                "rule for the parameter, or delete the rule if it is a buffer"
            )
        close = _closest(pattern, self.by_rest)
        if close:
            return (
                f"did you mean `{'`, `'.join(close)}`? no parameter has a name like it; "
                "delete the rule if the parameters do not exist"
            )
        return (
            "check the pattern against the manifest; delete the rule if the parameters do not exist"
        )

    def _hook_hint(self, pattern: str, fqn: str, more: str) -> str:
        section = self.res.manifest.state_dict  # type: ignore[union-attr]
        key = next(k for k in section.added() if k.fqn == fqn)  # type: ignore[union-attr]
        by = f"a state-dict hook of {key.module}" if key.module else "the model's state_dict()"
        origin = ""
        if key.from_:
            origin = f", from the {_plural(len(key.from_), 'parameter')} {', '.join(key.from_)}"
        fix = (
            f"write the rule for `{_rule_for(pattern, fqn, key.from_[0])}`"
            if len(key.from_) == 1
            else "write rules for the parameters the manifest's entries list"
        )
        return (
            f"`{fqn}`{more} exists only in state_dict() (written by {by}{origin}); rules "
            f"match parameters as the model holds them: {fix}"
        )


def _closest(pattern: str, by_rest: dict[tuple[int, tuple[str, ...]], list[str]]) -> list[str]:
    """The parameter names (layer numbers written ``*``) that differ from ``pattern`` in
    one segment only, that segment close to the pattern's (:func:`likeness` at least
    :data:`CUTOFF`): the closest, and a second only when it is about as close. ``by_rest``
    indexes the names by (position, the other segments), so each pattern costs a lookup per
    segment."""
    segs = tuple(pattern.split("."))
    scored = []
    for i, seg in enumerate(segs):
        for name in by_rest.get((i, segs[:i] + segs[i + 1 :]), [])[:MAX_BUCKET]:
            other = name.split(".")[i]
            ratio = likeness(seg, other)
            if ratio >= CUTOFF:
                scored.append((-ratio, name))
    scored.sort()
    return [n for r, n in scored[:2] if -r >= -scored[0][0] - 0.03]


def _plural(n: int, word: str) -> str:
    return word if n == 1 else word + "s"


def _rule_for(pattern: str, key: str, param: str) -> str:
    """The pattern for ``param`` that ``pattern`` (which matched the hook key ``key``)
    would be: the pattern's segments over the part ``key`` and ``param`` share, then
    ``param``'s own (``layers.*.attention.wq.weight`` -> ``layers.*.attention.qkv_linear
    .wqkv.weight``). Without a segment-for-segment reading, ``param`` with its layer
    numbers as ``*``."""
    segs, ks, ps = pattern.split("."), key.split("."), param.split(".")
    if "**" in segs or len(segs) != len(ks):
        return _generalized(param)
    common = 0
    while common < min(len(ks), len(ps)) and ks[common] == ps[common]:
        common += 1
    return ".".join(segs[:common] + ps[common:])


def _generalized(fqn: str) -> str:
    return ".".join("*" if s.isdigit() else s for s in fqn.split("."))


def check_ambiguous(res: Resolved) -> list[Diagnostic]:
    """SS043: no parameter is matched by two best rules of equal precedence."""
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for fqn, m in sorted(res.matches.items()):
        if m.ignored_by is None and m.winner is not None and m.tied:
            tie = (m.winner, *m.tied)
            groups[tie].append(fqn)
    out = []
    for indices, fqns in sorted(groups.items()):
        rules = [res.spec.rules[i] for i in indices]
        later = max(rules, key=lambda r: r.index)
        others = ", ".join(
            f"{r.pattern.text!r} (line {r.span.line})" for r in rules if r is not later
        )
        key = describe_key(res.globs[later.index].key)
        out.append(
            diag(
                "SS043",
                f"rules {others} and {later.pattern.text!r} have equal "
                f"precedence and both match {_more(fqns)}",
                later.pattern.span,
                f"both have {key}; make one more specific (file order never decides)",
            )
        )
    return out


def check_buffers(res: Resolved) -> list[Diagnostic]:
    """SS087: a rule shards a persistent buffer over a mesh axis at run time. FSDP2 and
    torch's tensor-parallel styles leave buffers as plain tensors, whole on every rank (or
    the local shard a module holds), so no rank would hold the shard the rule describes."""
    legacy = res.manifest is not None and res.manifest.from_state_dict
    # A format-1 manifest's rule that matches buffers only is SS041's (said once).
    used: set[int] = set()
    if legacy:
        used = {c for m in res.matches.values() if m.entry.kind == "param" for c in m.candidates}
    found: dict[int, list[tuple[str, tuple[str, ...]]]] = defaultdict(list)
    for fqn, m in res.buffers:
        if m.winner is None or m.layout is None or (legacy and m.winner not in used):
            continue
        axes = tuple(a for d in m.layout.dims for a in d.axes if a not in m.layout.local)
        if axes:
            found[m.winner].append((fqn, axes))
    out = []
    for index, hits in sorted(found.items()):
        rule = res.spec.rules[index]
        fsdp = res.fsdp_of_rule(index)
        fqn, axes = hits[0]
        stated = {a.text for s in rule.shards for a in s.axes}
        by_default = fsdp in axes and fsdp not in stated
        what = ", ".join(f"{a} (the fsdp default)" if a == fsdp and by_default else a for a in axes)
        more = f" (and {len(hits) - 1} more)" if len(hits) > 1 else ""
        fix = (
            f"write `param {rule.pattern.text} [...] replicate` (whole on every rank, as a "
            "buffer no rule matches is)"
            + (f", or `replicate {fsdp}`" if by_default else "")
            + "; `local AXIS` if the module holds its shard; `checkpoint shard DIM over AXIS` "
            "to split only what checkpoints store"
        )
        if legacy:
            fix = (
                "the manifest is of format 1, built from state_dict(), where a state-dict "
                "hook's key looks like a buffer: rebuild it with `shardspec manifest`; if it "
                "is a buffer, " + fix
            )
        out.append(
            diag(
                "SS087",
                f"buffer {fqn!r}{more} is sharded over {what} by rule "
                f"{rule.pattern.text!r}, but FSDP2 and torch's tensor-parallel styles keep "
                "buffers whole on every rank",
                rule.pattern.span,
                fix,
            )
        )
    return out


COVERAGE_CHECKS = (check_unmatched, check_unused, check_ambiguous, check_buffers)
