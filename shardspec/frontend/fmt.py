"""``shardspec fmt``: one canonical layout of a spec, from its parse.

The canonical form (README, "Commands"; the specs under ``specs/`` are in it):

- one statement per line at the top level; a block (``mesh``, ``param``, ``hf``,
  ``pipeline``) opens with ``{`` at the end of its header line, holds one item per line
  indented 4 spaces per level, and closes with ``}`` on a line of its own; an empty block
  is ``{}`` on the header line;
- one space between tokens, none before ``,`` ``:`` ``)`` ``]`` nor after ``(`` ``[``;
  an hf line's stack index sticks to its name (``...gate_up_proj.gate[e]``); a product of
  config keys is written ``a * b``;
- comments kept, with their text as written (trailing blanks dropped): a full-line comment
  indented as the line it precedes (inside a block when it precedes the block's ``}``); a
  trailing comment three spaces after its line's code, as the example specs and the
  README write them, and not aligned with its neighbours' (so that changing a line never
  rewrites the lines around it: black and ruff do the same with two); a trailing comment
  stays on the line of the first token of its source line, where a suppression
  (``# shardspec: ignore[...]``) is looked for;
- blank lines: a run of them becomes one; none at the start or end of the file, after a
  ``{`` or before a ``}``; the file ends with one newline (``\\n`` line ends).

It works from lark's parse of the reference grammar, all tokens kept, with the comments the
lexer skips collected by position; the layout is a table of the grammar's rules
(:data:`_RULES`), and a rule not in it is refused (:class:`FormatRefused`), never guessed.
The result is checked before it is returned: it must lex to the same tokens and the same
comments as the input.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import lru_cache

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedInput

from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.frontend.parse import grammar_parser, parse, read_spec
from shardspec.frontend.syntax_errors import comment_start

INDENT = "    "
COMMENT_GAP = "   "  # between a line's code and its trailing comment

# Every rule of grammars/shardspec.lark that fmt lays out (tests/test_fmt.py checks the
# grammar has no other). Blocks are the rules with braces; their items go one per line.
_RULES = frozenset(
    {
        "start",
        "statement",
        "manifest_stmt",
        "mesh_stmt",
        "world",
        "axis_decl",
        "fsdp_stmt",
        "checkpoint_stmt",
        "ignore_stmt",
        "param_stmt",
        "dims",
        "param_body",
        "replicate_all",
        "shard_item",
        "view_item",
        "local_item",
        "replicate_item",
        "fuse_item",
        "groups",
        "components",
        "component",
        "stored",
        "squeezed",
        "heads_item",
        "head_size",
        "checkpoint_shard",
        "checkpoint_replicate",
        "style_item",
        "style_opt",
        "pipeline_stmt",
        "pipe_first",
        "pipe_last",
        "pipe_split",
        "pipe_counts",
        "pipe_tie",
        "hf_stmt",
        "hf_map",
        "hf_stack",
        "hf_transform",
        "hf_parts",
        "hf_part",
        "hf_size",
        "hf_drop",
        "hf_tie",
        "hf_keep",
        "hf_fp8",
        "fp8_scale",
        "fp8_block",
        "fp8_word",
        "hf_config",
        "axis_list",
    }
)

# Rules whose opening token sticks to the token before it.
_GLUED = frozenset({"hf_stack"})

_NO_SPACE_BEFORE = frozenset({",", ":", ")", "]"})
_NO_SPACE_AFTER = frozenset({"(", "["})
_PRODUCT = re.compile(r"[ \t]*\*[ \t]*")


class FormatRefused(Exception):
    """A parse tree holds a construct fmt has no layout for; its rule name."""

    def __init__(self, rule: str, line: int, col: int) -> None:
        super().__init__(rule)
        self.rule, self.line, self.col = rule, line, col


@dataclass(frozen=True)
class _Comment:
    """A full-line comment's text, and whether a blank line comes before it."""

    body: str
    blank: bool


@dataclass
class _Line:
    """One output line: its block depth, its code's tokens (each with whether it sticks to
    the one before), and the comments that go with it."""

    depth: int
    tokens: list[tuple[Token, bool]] = field(default_factory=list)
    before: list[_Comment] = field(default_factory=list)
    trailing: str | None = None
    blank_before: bool = False

    @property
    def first(self) -> Token:
        return self.tokens[0][0]

    @property
    def opens(self) -> bool:
        return self.tokens[-1][0] == "{"

    @property
    def closes(self) -> bool:
        return len(self.tokens) == 1 and self.tokens[0][0] == "}"

    def code(self) -> str:
        out: list[str] = []
        prev = ""
        for tok, glued in self.tokens:
            text = _PRODUCT.sub(" * ", str(tok)) if tok.type == "CONFIG_EXPR" else str(tok)
            if out and not glued and text not in _NO_SPACE_BEFORE and prev not in _NO_SPACE_AFTER:
                out.append(" ")
            out.append(text)
            prev = text
        return "".join(out)


class _Comments:
    """The comments the lexer skips, collected per parse (lark's ``lexer_callbacks``)."""

    def __init__(self) -> None:
        self.found: list[Token] = []

    def __call__(self, tok: Token) -> Token:
        self.found.append(tok)
        return tok


_COMMENTS = _Comments()
_LOCK = threading.Lock()


@lru_cache(maxsize=1)
def _tree_parser() -> Lark:
    return grammar_parser(keep_all_tokens=True, lexer_callbacks={"COMMENT": _COMMENTS})


def _parse_tree(text: str) -> tuple[Tree, list[Token]]:
    """The parse tree of ``text`` with every token, and its comments. Raises
    :class:`FormatRefused` if the lexer did not hand over every comment the text holds
    (counted line by line: strings cannot span lines)."""
    with _LOCK:
        _COMMENTS.found = []
        try:
            tree = _tree_parser().parse(text)
        finally:
            comments, _COMMENTS.found = _COMMENTS.found, []
    held = sum(comment_start(row) is not None for row in text.split("\n"))
    if held != len(comments):  # pragma: no cover - lark's callbacks missed one
        raise FormatRefused("a comment the lexer did not report", 1, 1)
    return tree, comments


def _lines(tree: Tree) -> list[_Line]:
    """The output lines of the code of ``tree`` (no comments yet)."""
    lines: list[_Line] = []

    def walk(node: Tree | Token, depth: int, glued: bool) -> None:
        if isinstance(node, Token):
            lines[-1].tokens.append((node, glued))
            return
        if node.data not in _RULES:
            meta = node.meta
            raise FormatRefused(
                str(node.data), getattr(meta, "line", 1), getattr(meta, "column", 1)
            )
        if node.data == "statement":
            lines.append(_Line(0))
        inside = False
        for i, child in enumerate(node.children):
            stick = glued and i == 0
            if isinstance(child, Token) and child.type == "LBRACE":
                lines[-1].tokens.append((child, False))
                inside = True
            elif isinstance(child, Token) and child.type == "RBRACE":
                lines.append(_Line(depth))
                lines[-1].tokens.append((child, False))
                inside = False
            elif inside:
                if not isinstance(child, Tree):  # an item is a rule; a bare token is unknown
                    raise FormatRefused(repr(str(child)), child.line or 1, child.column or 1)
                lines.append(_Line(depth + 1))
                walk(child, depth + 1, False)
            else:
                walk(child, depth, stick or (isinstance(child, Tree) and child.data in _GLUED))

    if tree.data != "start":
        raise FormatRefused(str(tree.data), 1, 1)
    walk(tree, 0, False)
    return lines


def _place_comments(lines: list[_Line], comments: list[Token], text: str) -> list[_Comment]:
    """Attach each comment to a line (see the module docstring); return the comments that
    follow the last line of code."""
    rows = text.split("\n")
    first_on_line: dict[int, int] = {}  # source line -> the output line of its first token
    starts: list[tuple[int, int, int]] = []  # (source line, col, output line) of each token
    for n, line in enumerate(lines):
        for tok, _ in line.tokens:
            first_on_line.setdefault(tok.line or 0, n)
            starts.append((tok.line or 0, tok.column or 0, n))
    starts.sort()
    after: list[_Comment] = []
    for c in comments:
        at, col = c.line or 1, c.column or 1
        body = str(c).rstrip()
        if at in first_on_line:
            n = first_on_line[at]
            if lines[n].trailing is None:
                lines[n].trailing = body
            else:  # two source lines' comments on one output line: the second goes above
                lines[n].before.append(_Comment(body, False))
            continue
        nxt = bisect.bisect_right(starts, (at, col, len(lines)))  # the next token's index
        comment = _Comment(body, _blank_before(rows, at, col))
        (after if nxt == len(starts) else lines[starts[nxt][2]].before).append(comment)
    for line in lines:
        line.blank_before = _blank_before(rows, line.first.line or 1, line.first.column or 1)
    return after


def _blank_before(rows: list[str], line: int, col: int) -> bool:
    """Whether what starts at (``line``, ``col``) of the source ``rows`` is the first thing
    on its line, with a blank line between it and anything before it."""
    if rows[line - 1][: col - 1].strip():
        return False
    return line >= 2 and not rows[line - 2].strip()


def _render(lines: list[_Line], after: list[_Comment]) -> str:
    out: list[str] = []
    opened = True  # at the start of the file, as after a `{`: no blank line

    def comments(block: list[_Comment], pad: str) -> None:
        nonlocal opened
        for c in block:
            if c.blank and not opened:
                out.append("")
            out.append(pad + c.body)
            opened = False

    n = 0
    while n < len(lines):
        line = lines[n]
        pad = INDENT * line.depth
        comments(line.before, INDENT * (line.depth + 1) if line.closes else pad)
        nxt = lines[n + 1] if n + 1 < len(lines) else None
        code, trailing = line.code(), line.trailing
        if (
            line.opens
            and nxt is not None
            and nxt.closes
            and not nxt.before
            and (trailing is None or nxt.trailing is None)
        ):  # an empty block: `{}`
            code += "}"
            trailing = trailing if trailing is not None else nxt.trailing
            n += 1
        if line.blank_before and not opened and not line.closes:
            out.append("")
        out.append(pad + code + (COMMENT_GAP + trailing if trailing is not None else ""))
        opened = code.endswith("{")
        n += 1
    comments(after, "")
    return "\n".join(out) + "\n" if out else ""


def _kept(tree: Tree, comments: list[Token]) -> tuple[list[tuple[str, str]], list[str]]:
    """The tokens (type and text, a product's blanks dropped) in order, and the comments
    (sorted: two comments that end up on one line may trade places) of a parse: what fmt
    must keep."""
    toks = [
        (t.type, re.sub(r"[ \t]", "", t) if t.type == "CONFIG_EXPR" else str(t))
        for t in _tokens(tree)
    ]
    return toks, sorted(str(c).rstrip() for c in comments)


def _tokens(tree: Tree) -> Iterator[Token]:
    for node in tree.children:
        if isinstance(node, Token):
            yield node
        else:
            yield from _tokens(node)


def format_text(text: str, path: str = "<string>") -> tuple[str | None, list[Diagnostic]]:
    """``text`` in the canonical layout, or ``None`` and the diagnostics when it cannot be
    formatted: a syntax error (or a token beyond the front end's bounds) as lint reports
    it, or a construct fmt does not know (SS001, naming the rule)."""
    spec, diags = parse(text, path)
    if spec is None:
        return None, diags
    try:
        tree, comments = _parse_tree(text)
        lines = _lines(tree)
        after = _place_comments(lines, comments, text)
    except UnexpectedInput as err:  # pragma: no cover - parse() above read it
        from shardspec.frontend.syntax_errors import syntax_error

        return None, [syntax_error(path, text, err)]
    except FormatRefused as r:
        return None, [
            diag(
                "SS001",
                f"shardspec fmt has no layout for {r.rule} (left the file as it is)",
                Span(path, r.line, r.col),
                "this version of fmt does not know the construct: lay it out by hand",
            )
        ]
    out = _render(lines, after)
    try:
        same = _kept(*_parse_tree(out)) == _kept(tree, comments)
    except (UnexpectedInput, FormatRefused):  # pragma: no cover - a bug in the layout
        same = False
    if not same:  # pragma: no cover - a bug in the layout, not the input
        return None, [
            diag(
                "SS001",
                "shardspec fmt would change the spec's tokens or comments (left the file as it is)",
                Span(path, 1, 1),
                "a bug in shardspec fmt: please report it with this spec",
            )
        ]
    return out, []


@dataclass(frozen=True)
class FileFormat:
    """What fmt makes of one file: its text, the canonical text (``None`` when it cannot be
    formatted), and the diagnostics that say why not."""

    path: str
    text: str | None
    formatted: str | None
    diagnostics: list[Diagnostic]

    @property
    def changed(self) -> bool:
        return self.formatted is not None and self.formatted != self.text


def format_file(path: str) -> FileFormat:
    """Read spec ``path`` and lay it out (:func:`format_text`); an unreadable file is an
    ``SS002`` diagnostic, as lint reports it."""
    text = read_spec(path)
    if isinstance(text, Diagnostic):
        return FileFormat(path, None, None, [text])
    formatted, diags = format_text(text, path)
    return FileFormat(path, text, formatted, diags)
