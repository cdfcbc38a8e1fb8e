"""Checks on which rule places which parameter (need a manifest)."""

from __future__ import annotations

from collections import defaultdict

from shardspec.checks.registry import diag
from shardspec.diagnostics import Diagnostic, Span
from shardspec.patterns import describe_key
from shardspec.resolve import Resolved


def _entry_span(res: Resolved, fqn: str) -> Span:
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
        if m.ignored_by is not None or m.winner is not None:
            continue
        if m.entry.kind == "extra_state":
            out.append(
                diag(
                    "SS040",
                    f"extra state {fqn!r} is matched by no ignore rule",
                    _entry_span(res, fqn),
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
                    _entry_span(res, fqn),
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
    # A pipeline tie's alias is a parameter of its stage: a rule for it is used.
    for m in [*res.matches.values(), *res.tie_matches.values()]:
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
                    "check the pattern against the manifest; "
                    "delete the rule if the parameters do not exist",
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


def check_ambiguous(res: Resolved) -> list[Diagnostic]:
    """SS043: no parameter is matched by two best rules of equal precedence."""
    groups: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for fqn, m in sorted(res.matches.items()):
        if m.ignored_by is None and m.winner is not None and m.tied:
            groups[(m.winner, *m.tied)].append(fqn)
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


COVERAGE_CHECKS = (check_unmatched, check_unused, check_ambiguous)
