"""Text -> IR. A lark LALR parser over ``grammars/shardspec.lark`` and a transformer that
turns the tree into :mod:`shardspec.frontend.ir` objects with source spans.

Syntax errors come back as ``SS001`` diagnostics (with the tokens that were expected, and
a hint: :mod:`shardspec.frontend.syntax_errors`), never as exceptions.
"""

from __future__ import annotations

import hashlib
import re
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from lark import Lark, Token, Tree
from lark.exceptions import UnexpectedInput
from lark.lexer import PatternRE, TerminalDef

from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span, clip
from shardspec.frontend import ir
from shardspec.frontend.limits import MAX_TOKEN, NUMBER_HINT, number_too_large
from shardspec.frontend.padnames import resolve_pad_names
from shardspec.frontend.syntax_errors import comment_start, syntax_error
from shardspec.frontend.textfile import read_text

GRAMMAR_NAME = "shardspec.lark"


def _grammar_path() -> Path:
    package = Path(__file__).resolve().parent.parent  # shardspec/
    # installed: the package data shardspec/grammars/; from a checkout: grammars/ beside it
    for candidate in (
        package / "grammars" / GRAMMAR_NAME,
        package.parent / "grammars" / GRAMMAR_NAME,
    ):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(GRAMMAR_NAME)  # pragma: no cover - packaging error


@lru_cache(maxsize=1)
def _parser() -> Lark:
    if sys.version_info >= (3, 11):
        try:
            return _lark(_possessive)
        except Exception:  # pragma: no cover - a lark plugin (interegular) that cannot read it
            pass
    return _lark(None)


# The terminals whose regex ends in a repeated group: Python's regex engine keeps a
# backtracking entry per repetition (120 bytes a character for a long pattern); a possessive
# repeat (Python 3.11) keeps none, and nothing follows it in the terminal, so it matches
# the same text.
_REPEATED = ("PATTERN", "CONFIG_EXPR")


def _possessive(t: TerminalDef) -> None:
    if t.name in _REPEATED and isinstance(t.pattern, PatternRE) and t.pattern.value.endswith(")*"):
        t.pattern = PatternRE(t.pattern.value + "+", t.pattern.flags, t.pattern.raw)


def grammar_parser(**options: Any) -> Lark:
    """A LALR parser of the grammar that keeps positions, with lark ``options`` added (the
    front end's own, below; ``shardspec fmt``'s, which keeps every token)."""
    return Lark(
        _grammar_path().read_text(encoding="utf-8"),
        parser="lalr",
        propagate_positions=True,
        maybe_placeholders=False,
        **options,
    )


def _lark(edit_terminals: Callable[[TerminalDef], None] | None) -> Lark:
    return grammar_parser(
        # Cache the built parser (a pickle in the temp directory, keyed by the grammar's
        # hash): saves rebuilding the LALR tables on every lint.
        cache=True,
        # Each statement becomes IR as soon as it is reduced (see _Statements), and every
        # token is bounded as it is read (see _Bounds; lark's lexer_callbacks skip tokens
        # whose terminal collides with a keyword, such as a pattern in an hf block).
        transformer=_Statements(),
        postlex=_Bounds(),
        edit_terminals=edit_terminals,
    )


# The parser (and its transformer, which carries the path of the text being parsed) is
# one per process: one parse at a time.
_LOCK = threading.Lock()


# -- bounds: every token is checked as the lexer reads it -----------------------------------

# The terminals whose text the user writes freely, and what to call each in a finding.
_WHAT = {
    "NAME": "name",
    "PATTERN": "pattern",
    "STRING": "quoted string",
    "INT": "number",
    "PART_SIZE": "number",
    "CONFIG_EXPR": "product",
}


class _Refused(Exception):
    """A token beyond the front end's bounds (:mod:`shardspec.frontend.limits`): the
    finding's code, message, place (line, column, end column) and hint."""

    def __init__(self, code: str, message: str, where: tuple[int, int, int], hint: str):
        super().__init__(message)
        self.code, self.message, self.where, self.hint = code, message, where, hint

    def diagnostic(self, path: str) -> Diagnostic:
        line, col, end = self.where
        return diag(self.code, self.message, Span(path, line, col, line, end), self.hint)


class _Bounds:
    """The lexer's tokens, each checked by :func:`_bounded` as it is read (a lark
    post-lexer)."""

    always_accept: tuple[str, ...] = ()

    def process(self, stream: Iterator[Token]) -> Iterator[Token]:
        for tok in stream:
            yield _bounded(tok) if tok.type in _WHAT else tok


def _bounded(tok: Token) -> Token:
    """``tok`` if it is within bounds; else raises :class:`_Refused` (SS007 for a token of
    more than :data:`MAX_TOKEN` characters, SS006 for a number over ``MAX_NUMBER``)."""
    line, col = tok.line or 1, tok.column or 1
    if len(tok) > MAX_TOKEN:
        first = str(tok).split("\n", 1)[0]
        shown = clip(first) if tok.type == "STRING" else repr(clip(first))  # quoted already
        raise _Refused(
            "SS007",
            f"{_WHAT[tok.type]} {shown} is {len(tok)} characters long",
            (line, col, col + len(first)),
            f"names, patterns, paths and numbers have at most {MAX_TOKEN} characters",
        )
    numbers = [(0, str(tok))] if tok.type in ("INT", "PART_SIZE") else []
    if tok.type == "CONFIG_EXPR":
        numbers = [(m.start(), m.group()) for m in re.finditer(r"[0-9A-Za-z_]+", tok)]
    for at, text in numbers:
        if text.isdigit() and number_too_large(text):
            raise _Refused(
                "SS006",
                f"number too large: {clip(text)} ({len(text)} digits)",
                (line, col + at, col + at + len(text)),
                NUMBER_HINT,
            )
    return tok


_SUPPRESS = re.compile(r"#\s*shardspec:\s*ignore\[([A-Za-z0-9_,\s]*)\]")


# -- what the transformer hands up: IR nodes, and these small values for what is not one ----


@dataclass(frozen=True)
class _Manifest:
    """``manifest "PATH"``."""

    path: str
    path_span: Span
    span: Span


@dataclass(frozen=True)
class _Fsdp:
    """``fsdp AXIS``."""

    axis: ir.Name
    span: Span


@dataclass(frozen=True)
class _Line:
    """A line of a block whose items go, one by one, into a list of the block's node (the
    class says which: see :func:`_sort`)."""

    items: tuple[Any, ...]


class _Local(_Line):
    """``local AXIS, ...`` (axis names)."""


class _Replicate(_Line):
    """``replicate AXIS, ...`` (axis names)."""


class _Heads(_Line):
    """``heads DIM SIZE, ...`` (head sizes)."""


class _View(_Line):
    """``view NAME`` in a rule (the name)."""


class _CheckpointShard(_Line):
    """``checkpoint shard DIM over AXIS`` (one shard item)."""


class _CheckpointReplicate(_Line):
    """``checkpoint replicate`` (its span)."""


class _First(_Line):
    """``first PATTERN, ...`` in a pipeline block."""


class _Last(_Line):
    """``last PATTERN, ...`` in a pipeline block."""


class _Drop(_Line):
    """``drop GLOB`` in an hf block."""


class _Keep(_Line):
    """``keep GLOB`` in an hf block."""


@dataclass(frozen=True)
class _ReplicateAll:
    """A rule's body ``replicate`` (no braces)."""


@dataclass(frozen=True)
class _Groups:
    """``N groups of a 32, b 16`` in a ``fuse`` item."""

    count: int
    components: tuple[ir.Component, ...]


@dataclass(frozen=True)
class _StoredFused:
    """``stored fused`` at the end of a ``fuse`` item."""


@dataclass(frozen=True)
class _Squeezed:
    """``squeezed`` after a ``fuse`` item's components."""


@dataclass(frozen=True)
class _StyleOption:
    """``input LAYOUT``, ``output LAYOUT`` or ``dtensor`` in a ``style`` item: the
    :class:`~shardspec.frontend.ir.StyleItem` field it sets, and its value."""

    field: str
    value: ir.Name | bool


@dataclass(frozen=True)
class _Parts:
    """A split line's ``as PART, ...``."""

    parts: tuple[ir.HFPart, ...]


@dataclass(frozen=True)
class _Size:
    """A part's stated size: a whole number or a ``(product)`` of config.json keys."""

    factors: tuple[ir.HFConfigFactor, ...]
    span: Span


@dataclass(frozen=True)
class _Counts:
    """``as N, N, ...`` on a pipeline ``split`` line."""

    counts: tuple[int, ...]
    span: Span


# Where each line of a block goes: the node's list for the line's class.
_RULE_LISTS: dict[type, str] = {
    ir.ShardItem: "shards",
    ir.FuseItem: "fusions",
    _Local: "local",
    _Replicate: "replicate",
    _Heads: "heads",
    _CheckpointShard: "checkpoint_shards",
    _CheckpointReplicate: "checkpoint_replicate",
    ir.StyleItem: "styles",
    _View: "views",
}
_HF_LISTS: dict[type, str] = {
    ir.HFMapItem: "maps",
    _Drop: "drops",
    ir.HFTie: "ties",
    _Keep: "keeps",
    ir.HFConfig: "configs",
    ir.HFFp8: "fp8",
}
_PIPE_LISTS: dict[type, str] = {
    _First: "first",
    _Last: "last",
    ir.StageSplit: "splits",
    ir.StageTie: "ties",
}
_SPEC_LISTS: dict[type, str] = {ir.Rule: "rules", ir.IgnoreRule: "ignores"}


def _sort(items: Iterable[object], lists: dict[type, str]) -> dict[str, tuple[Any, ...]]:
    """``items`` (in file order) into the tuples that ``lists`` names for their classes;
    the items of a :class:`_Line` go in one by one. An item of any other class is a bug in
    the transformer, and raises rather than vanish."""
    out: dict[str, tuple[Any, ...]] = dict.fromkeys(lists.values(), ())
    grouped: dict[str, list[Any]] = {}
    for item in items:
        name = lists.get(type(item))
        if name is None:
            raise TypeError(f"the parser made a {type(item).__name__} where none belongs")
        got = grouped.setdefault(name, [])
        if isinstance(item, _Line):
            got.extend(item.items)
        else:
            got.append(item)
    for name, got in grouped.items():
        out[name] = tuple(got)
    return out


def _once(stmt: object) -> tuple[str, Span, dict[str, object]] | None:
    """For a statement that a spec may hold once: its keyword, its span and the
    :class:`~shardspec.frontend.ir.Spec` fields it sets; ``None`` for other statements."""
    match stmt:
        case _Manifest():
            return "manifest", stmt.span, {"manifest": stmt.path, "manifest_span": stmt.path_span}
        case ir.MeshDecl() if stmt.name is None:
            return "mesh", stmt.span, {"mesh": stmt}
        case ir.HFBlock():
            return "hf", stmt.span, {"hf": stmt}
        case ir.Pipeline():
            return "pipeline", stmt.span, {"pipeline": stmt}
        case ir.CheckpointKeys():
            return "checkpoint keys", stmt.span, {"checkpoint_keys": stmt}
    return None


class _ToIR:
    """A statement's lark tree -> its IR node (or a :class:`_Manifest` or :class:`_Fsdp`).
    Each grammar rule has a method of the same name, called with the node's positions and
    its children already turned into IR. Nodes are placed by offsets from their
    statement's start (:class:`~shardspec.frontend.ir.Anchor`); ``shift`` is where the
    text lark reads starts in the source (a statement read alone: :mod:`.fastparse`)."""

    def __init__(self, source: ir.Source, shift: int = 0, rule_index: int = 0) -> None:
        self.source = source
        self.shift = shift
        self.rule_index = rule_index
        self.at = ir.Anchor(source)
        self.base = 0

    def statement(self, tree: Tree) -> Any:
        """The IR of one statement's tree."""
        self.base = tree.meta.start_pos + self.shift
        self.at = ir.Anchor(self.source, self.base)
        return self.transform(tree)

    def transform(self, tree: Tree) -> Any:
        """``tree`` as IR, bottom up (what lark's Transformer does, without its per-call
        wrappers: this runs for every node of a spec)."""
        children = [self.transform(c) if isinstance(c, Tree) else c for c in tree.children]
        method = getattr(self, str(tree.data), None)
        if method is None:  # a rule with no IR of its own (none in today's grammar)
            return Tree(tree.data, children, tree.meta)
        return method(tree.meta, children)

    def _at(self, x: Any) -> ir.Placed:
        """The place of a tree (its meta) or token ``x`` in its statement."""
        start = x.start_pos + self.shift - self.base
        return {"at": self.at, "start": start, "end": x.end_pos + self.shift - self.base}

    def _span(self, x: Any) -> Span:
        """The span of a tree (its meta) or token ``x``."""
        return self.source.span(x.start_pos + self.shift, x.end_pos + self.shift)

    def _name(self, tok: Token) -> ir.Name:
        # Names repeat (dimensions, axes): one string each, however many rules use it.
        return ir.Name(**self._at(tok), text=sys.intern(str(tok)))

    def _pattern(self, tok: Token) -> ir.Pattern:
        return ir.Pattern(**self._at(tok), text=str(tok))

    def manifest_stmt(self, meta, children):
        (tok,) = children
        return _Manifest(str(tok)[1:-1], self._span(tok), self._span(meta))

    def world(self, meta, children):
        return int(children[0])

    def axis_decl(self, meta, children):
        name, size, *aliases = children
        return ir.AxisDecl(
            **self._at(meta),
            name=self._name(name),
            size=None if size.type == "REST" else int(size),
            aliases=tuple(self._name(a) for a in aliases),
        )

    def mesh_stmt(self, meta, children):
        world = next((c for c in children if isinstance(c, int)), None)
        axes = tuple(c for c in children if isinstance(c, ir.AxisDecl))
        name = next((self._name(c) for c in children if isinstance(c, Token)), None)
        return ir.MeshDecl(**self._at(meta), axes=axes, world=world, name=name)

    def fsdp_stmt(self, meta, children):
        return _Fsdp(self._name(children[0]), self._span(meta))

    def checkpoint_stmt(self, meta, children):
        return ir.CheckpointKeys(**self._at(meta), layout=self._name(children[0]))

    def ignore_stmt(self, meta, children):
        return ir.IgnoreRule(**self._at(meta), pattern=self._pattern(children[0]))

    def dims(self, meta, children):
        return tuple(self._name(t) for t in children)

    def axis_list(self, meta, children):
        return tuple(self._name(t) for t in children)

    def shard_item(self, meta, children):
        dim, axes = children
        return ir.ShardItem(**self._at(meta), dim=self._name(dim), axes=axes)

    def view_item(self, meta, children):
        return _View((self._name(children[0]),))

    def local_item(self, meta, children):
        return _Local(tuple(self._name(t) for t in children))

    def replicate_item(self, meta, children):
        return _Replicate(tuple(self._name(t) for t in children[1:]))

    def component(self, meta, children):
        name = children[0]
        size = int(children[1]) if len(children) > 1 else None
        return ir.Component(**self._at(meta), name=self._name(name), size=size)

    def components(self, meta, children):
        return tuple(children)

    def groups(self, meta, children):
        return _Groups(int(children[0]), children[1])

    def stored(self, meta, children):
        return _StoredFused()

    def squeezed(self, meta, children):
        return _Squeezed()

    def fuse_item(self, meta, children):
        body = children[1]
        return ir.FuseItem(
            **self._at(meta),
            dim=self._name(children[0]),
            components=body.components if isinstance(body, _Groups) else body,
            groups=body.count if isinstance(body, _Groups) else None,
            stored_fused=any(isinstance(c, _StoredFused) for c in children[2:]),
            squeezed=any(isinstance(c, _Squeezed) for c in children[2:]),
        )

    def head_size(self, meta, children):
        target, size = children[:2]
        return ir.HeadSize(
            **self._at(meta),
            target=self._name(target),
            size=int(size) if size.type == "INT" else None,
            size_name=self._name(size) if size.type == "NAME" else None,
            replicated=len(children) > 2,
        )

    def heads_item(self, meta, children):
        return _Heads(tuple(children))

    def checkpoint_shard(self, meta, children):
        dim, axes = children
        return _CheckpointShard((ir.ShardItem(**self._at(meta), dim=self._name(dim), axes=axes),))

    def checkpoint_replicate(self, meta, children):
        return _CheckpointReplicate((self._span(meta),))

    def style_opt(self, meta, children):
        if len(children) == 1:
            return _StyleOption("dtensor", True)
        return _StyleOption(str(children[0]), self._name(children[1]))

    def style_item(self, meta, children):
        options = {o.field: o.value for o in children[1:]}
        return ir.StyleItem(**self._at(meta), kind=self._name(children[0]), **options)

    def hf_stack(self, meta, children):
        return self._name(children[0])

    def hf_transform(self, meta, children):
        kind = children[0]
        if kind.type == "PAD":
            named = children[1].type == "NAME"
            return ir.HFTransform(
                **self._at(meta),
                kind="pad",
                dim=0 if named else int(children[1]),
                dim_name=self._name(children[1]) if named else None,
                multiple=int(children[2]),
                axes=tuple(self._name(c) for c in children[3:]),
            )
        head_dim = int(children[1]) if len(children) > 1 else 0
        return ir.HFTransform(**self._at(meta), kind=str(kind), head_dim=head_dim)

    def hf_map(self, meta, children):
        hf, _arrow, target = children[0], children[1], children[2]
        rest = children[3:]
        parts = next((c for c in rest if isinstance(c, _Parts)), None)
        return ir.HFMapItem(
            **self._at(meta),
            hf=self._pattern(hf),
            target=self._pattern(target),
            stack=next((c for c in rest if isinstance(c, ir.Name)), None),
            transforms=tuple(c for c in rest if isinstance(c, ir.HFTransform)),
            parts=parts.parts if parts is not None else None,
            grouped=next(
                (self._span(c) for c in rest if isinstance(c, Token) and c.type == "GROUPED"),
                None,
            ),
        )

    def hf_parts(self, meta, children):
        return _Parts(tuple(children))

    def hf_size(self, meta, children):
        return _Size(self._factors(children[0]), self._span(meta))

    def hf_part(self, meta, children):
        size = next((c for c in children[1:] if isinstance(c, _Size)), None)
        return ir.HFPart(
            **self._at(meta),
            name=self._name(children[0]),
            size=size.factors if size else None,
            size_span=size.span if size else None,
            transforms=tuple(c for c in children[1:] if isinstance(c, ir.HFTransform)),
        )

    def _factors(self, expr: Token) -> tuple[ir.HFConfigFactor, ...]:
        """The factors of a ``config`` product (or a size), each with its own place."""
        start = (expr.start_pos or 0) + self.shift - self.base
        return tuple(
            ir.HFConfigFactor(
                at=self.at, start=start + m.start(), end=start + m.end(), text=m.group()
            )
            for m in re.finditer(r"[A-Za-z0-9_]+", str(expr))
        )

    def hf_drop(self, meta, children):
        glob = ir.HFGlob(**self._at(meta), pattern=self._pattern(children[0]))
        return _Drop((glob,))

    def hf_keep(self, meta, children):
        glob = ir.HFGlob(**self._at(meta), pattern=self._pattern(children[0]))
        return _Keep((glob,))

    def hf_tie(self, meta, children):
        alias, source = children
        return ir.HFTie(**self._at(meta), alias=self._pattern(alias), source=self._pattern(source))

    def hf_config(self, meta, children):
        name, expr = children
        factors = self._factors(expr)
        return ir.HFConfig(**self._at(meta), name=self._name(name), factors=factors)

    def fp8_scale(self, meta, children):
        return ir.HFFp8Option(**self._at(meta), kind="scale", text=str(children[0]))

    def fp8_block(self, meta, children):
        rows, cols = (int(c) for c in children if c.type == "INT")
        return ir.HFFp8Option(**self._at(meta), kind="block", block=(rows, cols))

    def fp8_word(self, meta, children):
        return ir.HFFp8Option(**self._at(meta), kind="word", text=str(children[0]))

    def hf_fp8(self, meta, children):
        return ir.HFFp8(
            **self._at(meta),
            glob=self._pattern(children[1]),
            options=tuple(c for c in children[2:] if isinstance(c, ir.HFFp8Option)),
        )

    def hf_stmt(self, meta, children):
        manifest = next((c for c in children if isinstance(c, Token)), None)
        items = _sort((c for c in children if not isinstance(c, Token)), _HF_LISTS)
        return ir.HFBlock(
            **self._at(meta),
            manifest=str(manifest)[1:-1] if manifest is not None else None,
            manifest_span=self._span(manifest) if manifest is not None else None,
            **items,
        )

    def pipe_first(self, meta, children):
        return _First(tuple(self._pattern(t) for t in children))

    def pipe_last(self, meta, children):
        return _Last(tuple(self._pattern(t) for t in children))

    def pipe_counts(self, meta, children):
        return _Counts(tuple(int(t) for t in children), self._span(meta))

    def pipe_split(self, meta, children):
        counts = next((c for c in children if isinstance(c, _Counts)), None)
        return ir.StageSplit(
            **self._at(meta),
            pattern=self._pattern(children[0]),
            counts=counts.counts if counts else (),
            counts_span=counts.span if counts else None,
            local_names=any(isinstance(c, Token) and c.type == "PIPE_LOCAL" for c in children),
        )

    def pipe_tie(self, meta, children):
        alias, source = children
        return ir.StageTie(
            **self._at(meta), alias=self._pattern(alias), source=self._pattern(source)
        )

    def pipeline_stmt(self, meta, children):
        items = _sort(children[1:], _PIPE_LISTS)
        return ir.Pipeline(**self._at(meta), axis=self._name(children[0]), **items)

    def param_body(self, meta, children):
        return list(children)

    def replicate_all(self, meta, children):
        return _ReplicateAll()

    def param_stmt(self, meta, children):
        tok, body = children[0], children[-1]
        dims = children[1] if len(children) == 3 else None
        rule = rule_node(self._at(meta), self.rule_index, self._pattern(tok), dims, body)
        self.rule_index += 1
        return rule


def rule_node(
    place: ir.Placed,
    index: int,
    pattern: ir.Pattern,
    dims: tuple[ir.Name, ...] | None,
    body: list[Any] | _ReplicateAll,
) -> ir.Rule:
    """The Rule of ``param PATTERN [dims] body``: ``body`` the items of its braces (IR
    nodes and :class:`_Line` values, in file order), or ``replicate``."""
    replicate_all = isinstance(body, _ReplicateAll)
    items = _sort(() if isinstance(body, _ReplicateAll) else body, _RULE_LISTS)
    styles = items.pop("styles")
    views = items.pop("views")
    checkpoint_replicate = items.pop("checkpoint_replicate")
    return ir.Rule(
        **place,
        index=index,
        pattern=pattern,
        dims=dims or (),
        dims_given=dims is not None,
        replicate_all=replicate_all,
        checkpoint_replicate=checkpoint_replicate[0] if checkpoint_replicate else None,
        style=styles[0] if styles else None,
        extra_styles=styles[1:],
        view=views[0] if views else None,
        extra_views=views[1:],
        **items,
    )


class _Statements:
    """The parser's own transformer (lark calls a method named after a rule when it reduces
    the rule; other rules become trees): each ``statement`` becomes IR (by :class:`_ToIR`,
    which has the statement's positions) when the parser reduces it, and its parse tree is
    dropped, so that only the IR of a large spec is ever held, never its whole tree."""

    def __init__(self) -> None:
        self.to_ir = _ToIR(ir.Source("<string>", ""))

    def start_text(self, to_ir: _ToIR) -> None:
        """Get ready to parse a text, into IR by ``to_ir``."""
        self.to_ir = to_ir

    def statement(self, children: list[Tree]) -> object:
        (tree,) = children
        return self.to_ir.statement(tree)


def lark_statements(text: str, to_ir: _ToIR) -> list[object] | Diagnostic:
    """The statements (IR, in file order) of ``text`` as lark parses it, each placed by
    ``to_ir`` (whose source ``text`` is, or is the part of from ``to_ir.shift`` on); or
    the diagnostic for a syntax error or a token beyond bounds."""
    parser = _parser()
    statements = parser.options.transformer
    assert isinstance(statements, _Statements)
    path = to_ir.source.path
    with _LOCK:
        statements.start_text(to_ir)
        try:
            start = parser.parse(text)
        except UnexpectedInput as err:
            return syntax_error(path, text, err)
        except _Refused as refused:
            return refused.diagnostic(path)
        finally:  # hold no reference to this text's IR
            statements.start_text(_ToIR(ir.Source("<string>", "")))
    assert isinstance(start, Tree)
    return list(start.children)


def parse(
    text: str, path: str = "<string>", *, fast: bool = True
) -> tuple[ir.Spec | None, list[Diagnostic]]:
    """Parse ``text``. Returns the IR (``None`` on a syntax error, or on a token beyond the
    front end's bounds) and the diagnostics. The fast reader
    (:mod:`shardspec.frontend.fastparse`) reads what it can, to the IR lark would give;
    lark reads the rest (``fast=False``: lark reads everything)."""
    source = ir.Source(path, text)
    got: list[object] | Diagnostic | None = None
    if fast:
        from shardspec.frontend.fastparse import fast_statements  # (it imports this module)

        got = fast_statements(text, source)
    if got is None:
        got = lark_statements(text, _ToIR(source))
    if isinstance(got, Diagnostic):
        return None, [got]
    return spec_of(path, text, got)


def spec_of(path: str, text: str, statements: Iterable[object]) -> tuple[ir.Spec, list[Diagnostic]]:
    """The Spec of ``text`` from its statements (in file order), and the findings about
    statements that a spec holds once (SS005)."""
    diags: list[Diagnostic] = []
    fields: dict[str, Any] = {}
    others = []
    seen: dict[str, Span] = {}
    views: list[ir.MeshDecl] = []
    fsdps: list[_Fsdp] = []
    meshes: list[ir.MeshDecl] = []
    table: ir.RuleTable | None = None
    for stmt in statements:
        if isinstance(stmt, ir.RuleTable):  # the fast reader's rules of a large spec
            table = stmt
            continue
        if isinstance(stmt, ir.MeshDecl):
            meshes.append(stmt)
            if stmt.name is not None:
                views.append(stmt)
                continue
        if isinstance(stmt, _Fsdp):
            fsdps.append(stmt)
            continue
        once = _once(stmt)
        if once is None:
            others.append(stmt)
            continue
        keyword, span, values = once
        if keyword in seen:
            diags.append(
                diag(
                    "SS005",
                    f"`{keyword}` appears more than once",
                    span,
                    f"the first one is at line {seen[keyword].line}; keep one",
                )
            )
            continue
        seen[keyword] = span
        fields.update(values)
    # `fsdp AXIS` once per view (checks/views.py matches them to views); once without views.
    for f in fsdps[1:] if not views else ():
        diags.append(
            diag(
                "SS005",
                "`fsdp` appears more than once",
                f.span,
                f"the first one is at line {fsdps[0].span.line}; keep one",
            )
        )
    diags.sort(key=lambda d: (d.span.line, d.span.col))
    if fsdps:
        fields["fsdp"] = fsdps[0].axis
        fields["fsdps"] = tuple(f.axis for f in fsdps) if views else (fsdps[0].axis,)
    if views:
        # The default view is the first named mesh; an unnamed one beside views (SS100)
        # stays among them, nameless, for the checks to point at.
        fields["views"] = tuple(meshes)
        fields["mesh"] = views[0]
    fields.update(_sort(others, _SPEC_LISTS))
    if table is not None:
        fields["rules"] = table
    fields["suppressions"] = _suppressions(path, text)
    spec = ir.Spec(path=path, source=text, sha256=_sha256(text), **fields)
    spec, named = resolve_pad_names(spec)
    return spec, diags + named


def _sha256(text: str) -> str:
    """The sha256 of ``text``'s UTF-8 bytes, encoded a megabyte at a time (not a copy of
    the whole text)."""
    h = hashlib.sha256()
    step = 1 << 20
    for i in range(0, len(text), step):
        h.update(text[i : i + step].encode("utf-8"))
    return h.hexdigest()


def _suppressions(path: str, text: str) -> tuple[ir.Suppression, ...]:
    """``# shardspec: ignore[CODE, ...]`` comments; the same words inside a string (such as
    a manifest path) are not a comment and suppress nothing. Only the lines that hold
    ``ignore[`` are read."""
    out = []
    lineno, counted = 1, 0  # the line number of offset ``counted``
    next_line = 0
    for hit in re.finditer(r"ignore\[", text):
        if hit.start() < next_line:
            continue  # on a line already read
        start = text.rfind("\n", 0, hit.start()) + 1
        end = text.find("\n", hit.start())
        next_line = end + 1 if end >= 0 else len(text)
        lineno += text.count("\n", counted, start)
        counted = start
        line = text[start:next_line].rstrip("\n")
        comment = comment_start(line)
        m = _SUPPRESS.search(line, comment) if comment is not None else None
        if not m:
            continue
        codes = tuple(c.strip().upper() for c in m.group(1).split(",") if c.strip())
        span = Span(path, lineno, m.start() + 1, lineno, m.end() + 1)
        out.append(ir.Suppression(**ir.placed(span), codes=codes))
    return tuple(out)


def read_spec(path: str | Path, name: str | None = None) -> str | Diagnostic:
    """The text of spec file ``path``, or the ``SS002`` diagnostic that says why it cannot
    be read (spanned at ``name``, ``path`` itself by default)."""
    name = name if name is not None else str(path)
    try:
        return read_text(Path(path))  # a byte order mark is not part of the text
    except UnicodeDecodeError as e:
        return diag(
            "SS002",
            f"cannot read spec: byte {e.start} is not UTF-8",
            Span(name, 1, 1),
            "save the spec as UTF-8 text",
        )
    except OSError as e:
        reason = e.strerror or str(e)
        return diag("SS002", f"cannot read spec: {reason}", Span(name, 1, 1), "check the path")


def parse_file(
    path: str | Path, name: str | None = None
) -> tuple[ir.Spec | None, list[Diagnostic]]:
    """Read and parse a spec file; an unreadable file is an ``SS002`` diagnostic. ``name``
    is the path that spans (and so diagnostics) carry, ``path`` itself by default."""
    name = name if name is not None else str(path)
    text = read_spec(path, name)
    if isinstance(text, Diagnostic):
        return None, [text]
    return parse(text, name)
