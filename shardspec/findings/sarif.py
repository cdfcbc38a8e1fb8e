"""Findings as SARIF 2.1.0 (``shardspec lint --format sarif``), for GitHub code scanning
and other SARIF viewers.

One run: the tool (``shardspec``, its version, and every code of the registry as a rule,
with its summary, why, examples and the anchor of its entry in ``docs/checks.md``), and one
result per finding, its location relative to the working directory (``%SRCROOT%``).
Findings that a ``# shardspec: ignore[...]`` comment silences are results too, each with
an in-source suppression, as SARIF asks, so that viewers can show them as suppressed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import quote

from shardspec import __version__
from shardspec.findings.codes import CHECKS, Check
from shardspec.findings.diagnostics import Diagnostic, Severity

SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
SRCROOT = "%SRCROOT%"
CATALOGUE = "docs/checks.md"

_LEVEL = {Severity.ERROR: "error", Severity.WARNING: "warning"}


def project_uri() -> str | None:
    """The project's home page from the installed package's metadata (``[project.urls]``),
    or ``None`` when it names none."""
    from importlib.metadata import PackageNotFoundError, metadata

    try:
        meta = metadata("shardspec")
    except PackageNotFoundError:  # pragma: no cover - run from a checkout without install
        return None
    for entry in meta.get_all("Project-URL") or ():
        label, _, url = entry.partition(",")
        if label.strip().lower() in ("homepage", "repository", "source", "documentation"):
            return url.strip().rstrip("/")
    home = meta.get_all("Home-page") or ()
    return home[0].rstrip("/") if home else None


def anchor(check: Check) -> str:
    """The anchor of ``check``'s heading (``## SS001 syntax-error``) in docs/checks.md, as
    GitHub and most Markdown renderers make it."""
    return re.sub(r"[^a-z0-9 _-]", "", f"{check.code} {check.name}".lower()).replace(" ", "-")


def _rule(check: Check, base: str | None) -> dict:
    doc = f"{CATALOGUE}#{anchor(check)}"
    examples = ""
    if check.bad:
        examples += f"\n\nBad:\n\n```\n{check.bad}\n```"
    if check.good:
        examples += f"\n\nGood:\n\n```\n{check.good}\n```"
    return {
        "id": check.code,
        "name": check.name,
        "shortDescription": {"text": check.summary},
        "fullDescription": {"text": check.why},
        "helpUri": f"{base}/{doc}" if base else doc,
        "help": {
            "text": f"{check.summary} {check.why}",
            "markdown": f"**{check.summary}** {check.why}{examples}",
        },
        "defaultConfiguration": {"level": _LEVEL[check.severity]},
        "properties": {"tags": ["needs-manifest"] if check.needs_manifest else []},
    }


def artifact(path: str, root: Path) -> dict | None:
    """The ``artifactLocation`` of ``path``: relative to ``root`` (``%SRCROOT%``) where it
    lies under it, else an absolute ``file:`` URI; ``None`` for a place that is no file
    (``<command line>``)."""
    if path.startswith("<") and path.endswith(">"):
        return None
    p = Path(path)
    absolute = p if p.is_absolute() else root / p
    try:
        rel = Path(os.path.normpath(absolute)).relative_to(root)
    except ValueError:
        return {"uri": Path(os.path.normpath(absolute)).as_uri()}
    return {"uri": quote(rel.as_posix()), "uriBaseId": SRCROOT}


def _result(d: Diagnostic, rule_index: dict[str, int], root: Path, silenced: bool) -> dict:
    text = d.message + (f"\nhint: {d.hint}" if d.hint else "")
    out: dict = {
        "ruleId": d.code,
        "level": _LEVEL[d.severity],
        "message": {"text": text},
    }
    if d.code in rule_index:
        out["ruleIndex"] = rule_index[d.code]
    where = artifact(d.span.file, root)
    if where is not None:
        region: dict = {"startLine": max(1, d.span.line), "startColumn": max(1, d.span.col)}
        if d.span.end_line is not None and d.span.end_line > d.span.line:
            region["endLine"] = d.span.end_line
        if d.span.end_col is not None and (
            d.span.end_line not in (None, d.span.line) or d.span.end_col > region["startColumn"]
        ):
            region["endColumn"] = d.span.end_col
        if d.source_line is not None:
            region["snippet"] = {"text": d.source_line}
        out["locations"] = [{"physicalLocation": {"artifactLocation": where, "region": region}}]
    if silenced:
        out["suppressions"] = [{"kind": "inSource"}]  # a `# shardspec: ignore[...]` comment
    return out


def render_sarif(
    diags: Iterable[Diagnostic],
    silenced: Iterable[Diagnostic] = (),
    *,
    root: str | Path | None = None,
    successful: bool = True,
) -> str:
    """The SARIF 2.1.0 log of ``diags`` (and of the ``silenced`` findings, as suppressed
    results), locations relative to ``root`` (default: the working directory);
    ``successful``: whether every input could be processed."""
    base = Path(os.path.abspath(root if root is not None else os.getcwd()))
    info = project_uri()
    rule_index = {c.code: i for i, c in enumerate(CHECKS)}
    driver: dict = {
        "name": "shardspec",
        "version": __version__,
        "semanticVersion": __version__,
        "rules": [_rule(c, info) for c in CHECKS],
    }
    if info:
        driver["informationUri"] = info
    results = [_result(d, rule_index, base, False) for d in diags]
    results += [_result(d, rule_index, base, True) for d in silenced]
    log = {
        "$schema": SCHEMA_URI,
        "version": "2.1.0",
        "runs": [
            {
                "tool": {"driver": driver},
                "invocations": [{"executionSuccessful": successful}],
                "originalUriBaseIds": {SRCROOT: {"uri": base.as_uri() + "/"}},
                "columnKind": "unicodeCodePoints",
                "results": results,
            }
        ],
    }
    return json.dumps(log, indent=2) + "\n"
