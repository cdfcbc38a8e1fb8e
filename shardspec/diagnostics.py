"""Findings for people: ``Diagnostic`` plus text and JSON renderers.

Every finding, from a syntax error to a rule that matches nothing, travels this path. It
carries a stable code, a severity, a one-line message, a hint, and a span that points into
a source text (the spec, a manifest, or the command line).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True)
class Span:
    """A place in a source text. Lines and columns are 1-based; ``end_col`` is exclusive."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}"


@dataclass(frozen=True)
class Diagnostic:
    code: str
    name: str
    severity: Severity
    message: str
    span: Span
    hint: str = ""
    source_line: str | None = None  # filled by ``attach_sources``

    @property
    def is_error(self) -> bool:
        return self.severity is Severity.ERROR

    def sort_key(self) -> tuple:
        return (self.span.file, self.span.line, self.span.col, self.code, self.message)

    def to_dict(self) -> dict:
        return {
            "code": self.code,
            "name": self.name,
            "severity": self.severity.value,
            "message": self.message,
            "hint": self.hint,
            "file": self.span.file,
            "line": self.span.line,
            "col": self.span.col,
            "end_line": self.span.end_line,
            "end_col": self.span.end_col,
        }


def attach_sources(diags: Iterable[Diagnostic], sources: dict[str, str]) -> list[Diagnostic]:
    """Give each diagnostic the text of the line it points at, when the source is known."""
    lines = {f: text.splitlines() for f, text in sources.items()}
    out = []
    for d in diags:
        src = lines.get(d.span.file)
        line = src[d.span.line - 1] if src and 0 < d.span.line <= len(src) else None
        out.append(Diagnostic(d.code, d.name, d.severity, d.message, d.span, d.hint, line))
    return out


def render_text(d: Diagnostic) -> str:
    """``file:line:col: severity CODE [name]: message``, the source line, a caret, a hint."""
    head = f"{d.span}: {d.severity.value} {d.code} [{d.name}]: {d.message}"
    parts = [head]
    if d.source_line is not None:
        num = str(d.span.line)
        pad = " " * len(num)
        line = d.source_line.expandtabs(1)
        width = 1
        if d.span.end_line in (None, d.span.line) and d.span.end_col:
            width = max(1, d.span.end_col - d.span.col)
        width = min(width, max(1, len(line) - d.span.col + 1))
        parts.append(f" {num} | {line}")
        parts.append(f" {pad} | {' ' * (d.span.col - 1)}{'^' * width}")
    if d.hint:
        parts.append(f"  hint: {d.hint}")
    return "\n".join(parts)


def render_all_text(diags: list[Diagnostic]) -> str:
    if not diags:
        return ""
    body = "\n\n".join(render_text(d) for d in diags)
    n_err = sum(d.is_error for d in diags)
    n_warn = len(diags) - n_err
    return f"{body}\n\n{n_err} error(s), {n_warn} warning(s)\n"


def render_json(diags: list[Diagnostic]) -> str:
    return json.dumps([d.to_dict() for d in diags], indent=2) + "\n"
