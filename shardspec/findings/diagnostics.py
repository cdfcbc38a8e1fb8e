"""Findings for people: ``Diagnostic`` plus text and JSON renderers.

Every finding, from a syntax error to a rule that matches nothing, travels this path. It
carries a stable code, a severity, a one-line message, a hint, and a span that points into
a source text (the spec, a manifest, or the command line).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

# What a finding quotes is capped, whatever the input: a name (any run of non-blank
# characters) to MAX_WORD characters, a message or hint to MAX_MESSAGE, the source line
# shown under it to MAX_LINE around the caret. A 50 MB name costs a line, not 50 MB.
MAX_WORD = 200
MAX_MESSAGE = 4000
MAX_LINE = 160
_LONG_WORD = re.compile(rf"(?<!\S)\S{{{MAX_WORD + 1},}}")


def clip(text: str, limit: int = MAX_WORD) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and end around a
    note of how many characters were left out (about ``limit`` characters in all)."""
    if len(text) <= limit:
        return text
    head = max(1, limit * 2 // 3)
    tail = max(1, limit - head - 40)
    return f"{text[:head]}[... {len(text) - head - tail} more characters ...]{text[-tail:]}"


def clip_words(text: str) -> str:
    """``text`` with every name longer than :data:`MAX_WORD` clipped (:func:`clip`), and
    the whole clipped to :data:`MAX_MESSAGE` characters."""
    if len(text) > MAX_WORD:
        text = _LONG_WORD.sub(lambda m: clip(m.group()), text)
    return clip(text, MAX_MESSAGE)


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"


@dataclass(frozen=True, slots=True)
class Span:
    """A place in a source text. Lines and columns are 1-based; ``end_col`` is exclusive."""

    file: str
    line: int
    col: int
    end_line: int | None = None
    end_col: int | None = None

    def __str__(self) -> str:
        # A file name as given on the command line can be any length: quote it capped.
        return f"{clip(self.file)}:{self.line}:{self.col}"


@dataclass(frozen=True, slots=True)
class Diagnostic:
    code: str
    name: str
    severity: Severity
    message: str
    span: Span
    hint: str = ""
    source_line: str | None = None  # filled by ``attach_sources``

    def __post_init__(self) -> None:
        # Whatever built the message, what it quotes is capped (text and JSON alike).
        object.__setattr__(self, "message", clip_words(self.message))
        object.__setattr__(self, "hint", clip_words(self.hint))

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


def lines_at(text: str, numbers: Iterable[int]) -> dict[int, str]:
    """The lines of ``text`` numbered ``numbers`` (1-based; numbers past the end left
    out), without their ``\\r``, found without splitting all of ``text``. Lines end at
    ``\\n`` only, as the parser and JSON count them (``str.splitlines`` also splits at form
    feeds and other separators)."""
    wanted = sorted({n for n in numbers if n > 0})
    out: dict[int, str] = {}
    line, pos = 1, 0
    for n in wanted:
        while line < n:
            nl = text.find("\n", pos)
            if nl < 0:
                return out
            line, pos = line + 1, nl + 1
        end = text.find("\n", pos)
        out[n] = text[pos : end if end >= 0 else len(text)].removesuffix("\r")
    return out


def attach_sources(diags: Iterable[Diagnostic], sources: dict[str, str]) -> list[Diagnostic]:
    """Give each diagnostic the text of the line it points at, when the source is known."""
    diags = list(diags)
    wanted: dict[str, set[int]] = {}
    for d in diags:
        if d.span.file in sources:
            wanted.setdefault(d.span.file, set()).add(d.span.line)
    lines = {f: lines_at(sources[f], numbers) for f, numbers in wanted.items()}
    out = []
    for d in diags:
        line = lines.get(d.span.file, {}).get(d.span.line)
        out.append(Diagnostic(d.code, d.name, d.severity, d.message, d.span, d.hint, line))
    return out


def _marked(d: Diagnostic) -> tuple[str, str] | None:
    """The source line as shown and the marker under it (see :func:`caret_line`)."""
    if d.source_line is None:
        return None
    line = d.source_line
    start = min(max(1, d.span.col), len(line) + 1)
    goes_on = d.span.end_line is not None and d.span.end_line > d.span.line
    if goes_on:
        end = max(start + 1, len(line.rstrip()) + 1)
    elif d.span.end_col is not None and d.span.end_col > start:
        end = min(d.span.end_col, max(start + 1, len(line) + 1))
    else:
        end = start + 1
    if len(line) > MAX_LINE:  # a window around the start, marked where it was cut
        lo = max(0, min(start - 1 - MAX_LINE // 4, len(line) - MAX_LINE))
        hi = lo + MAX_LINE
        if end > hi + 1:
            end, goes_on = hi + 1, True
        left = "... " if lo else ""
        line = left + line[lo:hi] + (" ..." if hi < len(line) else "")
        start, end = start - lo + len(left), end - lo + len(left)
    indent = "".join(ch if ch == "\t" else " " for ch in line[: start - 1])
    return line, indent + "^" * (end - start) + (" ..." if goes_on else "")


def caret_line(d: Diagnostic) -> str | None:
    """The marker under the source line as :func:`render_text` shows it: carets from the
    span's start to its end on that line. A span that runs onto later lines is marked to
    the end of its first line (not counting trailing blanks), followed by ``...``; an empty
    span, or one that starts past the end of the line (the end of the file), gets one
    caret. Tabs in the source line are kept in the marker's indent so the carets line up
    however the tabs are shown. A line longer than :data:`MAX_LINE` is shown in part, cut
    ends marked ``...``, and a span that runs past the part shown ends in ``...`` too."""
    marked = _marked(d)
    return None if marked is None else marked[1]


def render_text(d: Diagnostic) -> str:
    """``file:line:col: severity CODE [name]: message``, the source line, a caret, a hint."""
    head = f"{d.span}: {d.severity.value} {d.code} [{d.name}]: {d.message}"
    parts = [head]
    marked = _marked(d)
    if marked is not None:
        shown, marker = marked
        num = str(d.span.line)
        pad = " " * len(num)
        parts.append(f" {num} | {shown}".rstrip())
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
