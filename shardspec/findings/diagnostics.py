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


def source_lines(text: str) -> list[str]:
    """``text`` split at ``\\n`` only (as the parser and JSON count lines; unlike
    ``str.splitlines``, which also splits at form feeds and other separators), without
    each line's ``\\r``."""
    return [line.removesuffix("\r") for line in text.split("\n")]


def attach_sources(diags: Iterable[Diagnostic], sources: dict[str, str]) -> list[Diagnostic]:
    """Give each diagnostic the text of the line it points at, when the source is known."""
    lines = {f: source_lines(text) for f, text in sources.items()}
    out = []
    for d in diags:
        src = lines.get(d.span.file)
        line = src[d.span.line - 1] if src and 0 < d.span.line <= len(src) else None
        out.append(Diagnostic(d.code, d.name, d.severity, d.message, d.span, d.hint, line))
    return out


def caret_line(d: Diagnostic) -> str | None:
    """The marker under ``d.source_line``: carets from the span's start to its end on that
    line. A span that runs onto later lines is marked to the end of its first line (not
    counting trailing blanks), followed by ``...``; an empty span, or one that starts past
    the end of the line (the end of the file), gets one caret. Tabs in the source line are
    kept in the marker's indent so the carets line up however the tabs are shown."""
    if d.source_line is None:
        return None
    line = d.source_line
    start = max(1, d.span.col)
    if start > len(line) + 1:
        start = len(line) + 1
    multi = d.span.end_line is not None and d.span.end_line > d.span.line
    if multi:
        end = max(start + 1, len(line.rstrip()) + 1)
    elif d.span.end_col is not None and d.span.end_col > start:
        end = min(d.span.end_col, max(start + 1, len(line) + 1))
    else:
        end = start + 1
    indent = "".join(ch if ch == "\t" else " " for ch in line[: start - 1])
    return indent + "^" * (end - start) + (" ..." if multi else "")


def render_text(d: Diagnostic) -> str:
    """``file:line:col: severity CODE [name]: message``, the source line, a caret, a hint."""
    head = f"{d.span}: {d.severity.value} {d.code} [{d.name}]: {d.message}"
    parts = [head]
    marker = caret_line(d)
    if d.source_line is not None and marker is not None:
        num = str(d.span.line)
        pad = " " * len(num)
        parts.append(f" {num} | {d.source_line}".rstrip())
        parts.append(f" {pad} | {marker}")
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
