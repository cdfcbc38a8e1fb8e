"""Parameter-name globs: matching, captures and precedence.

Pure Python (``re`` only) so that generated modules can match names at run time when a
spec has no manifest.

Syntax, over dot-separated segments:

* ``*`` matches one whole segment; inside a segment (``w*``) it matches any characters
  but a dot;
* ``**`` matches any number of segments, zero included;
* ``{a,b}`` matches one of the alternatives;
* ``{name}`` (one word, no comma) matches one segment and captures it as ``name``.

Precedence is by specificity, never by file order. A rule's key is, compared in order:

1. more segments that are fully literal (``layers``, ``hc_head``);
2. fewer ``**``;
3. more segments that constrain the text (``w*``, ``w{1,3}``) rather than ``*``, ``{e}``;
4. more literal characters (an alternation ``{a,b}`` counts its shortest alternative,
   so ``w{1,3}`` beats ``w*`` and ``{attn,mlp}_norm`` beats ``*_norm``).

Two matching rules with equal keys are ambiguous: lint reports it, the runtime refuses.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TypeVar

_SEGMENT_OK = re.compile(r"^(?:[A-Za-z0-9_*]|\{[A-Za-z0-9_,*]+\})+\Z")
_BRACE = re.compile(r"\{([^}]*)\}")


_T = TypeVar("_T", bound=tuple)


class PatternError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Glob:
    """A compiled pattern. Slotted, its captures and key shared with every glob like it: a
    spec of half a million rules holds one per rule."""

    text: str
    captures: tuple[str, ...]
    key: tuple[int, int, int, int]
    # the regex's source (None: the pattern is literal, the source its text escaped), and
    # the regex compiled from it on first use: checking a pattern needs no regex
    _source: str | None = field(default=None, compare=False, repr=False)
    _regex: re.Pattern[str] | None = field(default=None, init=False, compare=False, repr=False)

    @property
    def source(self) -> str:
        """The regex's source."""
        got = self._source
        return "^" + re.escape(self.text) + r"\Z" if got is None else got

    @property
    def regex(self) -> re.Pattern[str]:
        got = self._regex
        if got is None:
            got = re.compile(self.source)
            object.__setattr__(self, "_regex", got)
        return got

    def match(self, fqn: str) -> dict[str, str] | None:
        m = self.regex.match(fqn)
        if m is None:
            return None
        return m.groupdict()


def _segment_regex(seg: str) -> tuple[str, list[str], bool, int]:
    """Regex for one segment; its capture names; whether it constrains; literal chars."""
    out, caps, pos, literal = [], [], 0, 0
    constrains = False
    for m in _BRACE.finditer(seg):
        lit = seg[pos : m.start()]
        out.append(_literal(lit))
        literal += len(lit.replace("*", ""))
        constrains |= bool(lit.replace("*", ""))
        inner = m.group(1)
        if "," in inner:
            alts = [a for a in inner.split(",")]
            if any(not a for a in alts):
                raise PatternError(f"empty alternative in {{{inner}}}")
            out.append("(?:" + "|".join(_literal(a) for a in alts) + ")")
            constrains = True
            # An alternation pins at least its shortest alternative's characters.
            literal += min(len(a.replace("*", "")) for a in alts)
        else:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", inner):
                raise PatternError(f"capture {{{inner}}} must be a name")
            caps.append(inner)
            out.append(f"(?P<{inner}>[^.]+)")
        pos = m.end()
    lit = seg[pos:]
    out.append(_literal(lit))
    literal += len(lit.replace("*", ""))
    constrains |= bool(lit.replace("*", ""))
    return "".join(out), caps, constrains, literal


def _literal(text: str) -> str:
    return "[^.]*".join(re.escape(p) for p in text.split("*")) if text else ""


def _check_braces(text: str) -> None:
    """Braces must pair up, not nest, not be empty and not contain a ``.``."""
    if "{" not in text and "}" not in text:
        return
    depth = 0
    start = 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth:
                raise PatternError(f"braces nest at column {i + 1}; write `{{a,b}}` flat")
            depth, start = 1, i
        elif ch == "}":
            if not depth:
                raise PatternError(f"'}}' at column {i + 1} closes no '{{'")
            depth = 0
            inner = text[start + 1 : i]
            if not inner:
                raise PatternError("empty braces '{}'")
            if "." in inner:
                raise PatternError(
                    f"'{{{inner}}}' spans a '.'; an alternation or capture is one segment"
                )
    if depth:
        raise PatternError(f"'{{' at column {start + 1} is never closed")


# A pattern of literal segments only (``model.layers.0.mlp.w1``), as most of a large spec's
# are: its regex, captures and key follow from it at once.
_LITERAL = re.compile(r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*")
# One tuple per distinct value (see shared), up to a bound.
_SHARED: dict[tuple, tuple] = {}


@lru_cache(maxsize=4096)
def compile_glob(text: str) -> Glob:
    """Compile a pattern; raises :class:`PatternError` with a reason when it is malformed."""
    if _LITERAL.fullmatch(text):
        segments = text.count(".") + 1
        key = (segments, 0, 0, len(text) - segments + 1)
        return Glob(text, (), shared(key))
    return _compile(text)


def shared(t: _T) -> _T:
    """``t``, or the tuple equal to it that an earlier call returned: one object per
    distinct value of the small tuples that every glob and rule of a large spec holds (keys,
    captures, dimension names), of which there are few."""
    return _SHARED.setdefault(t, t) if len(_SHARED) < 65536 else t  # type: ignore[return-value]


def _compile(text: str) -> Glob:
    if not text:
        raise PatternError("empty pattern")
    _check_braces(text)
    if text.startswith(".") or text.endswith(".") or ".." in text:
        raise PatternError("empty segment (a leading, trailing or doubled '.')")
    segs = text.split(".")
    parts: list[str] = []
    captures: list[str] = []
    n_literal = n_double = n_constrain = n_chars = 0
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg == "**":
            n_double += 1
            if last:
                if parts and parts[-1].endswith(r"\."):
                    parts[-1] = parts[-1][:-2]
                    parts.append(r"(?:\.[^.]+)*")
                else:
                    parts.append(r".*")
            else:
                parts.append(r"(?:[^.]+\.)*")
            continue
        if "**" in seg:
            raise PatternError(f"'**' must be a whole segment, not part of {seg!r}")
        if not _SEGMENT_OK.match(seg):
            raise PatternError(
                f"segment {seg!r} has characters other than letters, digits, '_', '*' and braces"
            )
        if "*" not in seg and "{" not in seg:  # a literal segment, as most are
            n_literal += 1
            n_chars += len(seg)
            parts.append(re.escape(seg) + ("" if last else r"\."))
            continue
        rx, caps, constrains, chars = _segment_regex(seg)
        if seg == "*":
            rx = r"[^.]+"
        for c in caps:
            if c in captures:
                raise PatternError(f"capture {{{c}}} appears twice")
        captures.extend(caps)
        if "*" not in seg and "{" not in seg:
            n_literal += 1
        elif constrains:
            n_constrain += 1
        n_chars += chars
        parts.append(rx + ("" if last else r"\."))
    source = "^" + "".join(parts) + r"\Z"  # \Z: "$" would allow a final newline
    key = (n_literal, -n_double, n_constrain, n_chars)
    return Glob(text, shared(tuple(captures)), shared(key), source)


def describe_key(key: tuple[int, int, int, int]) -> str:
    lit, neg_double, constrain, chars = key
    return (
        f"{lit} literal segment(s), {-neg_double} '**', {constrain} partial segment(s), "
        f"{chars} literal character(s)"
    )
