"""A hand-written reader for the statements a large spec is made of (``param``, ``ignore``,
``manifest``, ``fsdp``), beside lark's LALR parser, which spends some 20 microseconds on
every token: a spec of half a million rules took two minutes to parse.

It reads a text as lark does, to the same IR (the same nodes, spans and rule indices),
or not at all: anything it is not sure lark reads the same way (a name that is also a
keyword, a token beyond the front end's bounds, anything that is no plain statement) makes
it give the whole text back, and lark parses it and says what is wrong
(:func:`shardspec.frontend.parse.parse`). ``mesh``, ``hf`` and ``pipeline`` blocks, a few in
any spec, are parsed by lark on their own (their text found by :func:`_block_end`), placed
where they are in the whole text. ``tests/test_fastparse.py`` holds the two readers to the
same IR on generated and mutated specs.

The tokens are lark's own terminals (their regexes are taken from the grammar); the
grammar's rules for the statements read here are written out below as code.
"""

from __future__ import annotations

import re
import sys
from functools import lru_cache
from typing import Any

from shardspec.findings.diagnostics import Diagnostic
from shardspec.frontend import ir
from shardspec.frontend.limits import MAX_TOKEN, number_too_large
from shardspec.frontend.parse import (
    _LOCK,
    _CheckpointReplicate,
    _CheckpointShard,
    _Fsdp,
    _Heads,
    _Local,
    _Manifest,
    _parser,
    _Replicate,
    _ReplicateAll,
    _ToIR,
    _View,
    lark_statements,
    rule_node,
)

__all__ = ["COLUMNS_FROM", "fast_statements"]

# A spec of at least this many rules keeps them in columns (:class:`ir.RuleTable`), read
# again from the text when asked for; fewer are a tuple of nodes.
COLUMNS_FROM = 1024


class _Decline(Exception):
    """The text is not one the fast reader reads: lark reads it."""


# Terminals whose text is the user's own; every other word-like terminal is a keyword.
_FREE = {"NAME", "PATTERN", "INT", "PART_SIZE", "STRING", "COMMENT", "WS", "CONFIG_EXPR"}

# Each place where the fast reader takes a name or a pattern, and a text that leaves lark's
# parser in the state it is in there. lark reads a word that is also a keyword as a name
# where that state accepts no such keyword (its lexer then has no such terminal): `heads
# heads 128` is a dimension named `heads`. Where the state accepts the keyword, the word is
# the keyword to lark, and the fast reader leaves the text to it.
_PLACES = {
    "ignore": "ignore ",
    "fsdp": "fsdp ",
    "checkpoint keys": "checkpoint keys ",
    "param": "param ",
    "dims": "param p [",
    "dims,": "param p [a,",
    "shard": "param p {shard ",
    "shard over": "param p {shard a over ",
    "shard (": "param p {shard a over (",
    "shard (,": "param p {shard a over (b,",
    "local": "param p {local ",
    "local,": "param p {local a,",
    "replicate": "param p {replicate ",
    "replicate,": "param p {replicate a,",
    "fuse": "param p {fuse ",
    "fuse as": "param p {fuse a as ",
    "fuse of": "param p {fuse a as 2 groups of ",
    "fuse,": "param p {fuse a as b,",
    "heads": "param p {heads ",
    "heads size": "param p {heads a ",
    "heads,": "param p {heads a 1,",
    "checkpoint": "param p {checkpoint shard ",
    "checkpoint over": "param p {checkpoint shard a over ",
    "checkpoint (": "param p {checkpoint shard a over (",
    "checkpoint (,": "param p {checkpoint shard a over (b,",
    "style": "param p {style ",
    "style option": "param p {style a input ",
    "view": "param p {view ",
}


class _Lexicon:
    """The grammar's terminals that the fast reader matches (compiled from lark's own
    regexes), every keyword of the language, and per place (:data:`_PLACES`) the keywords
    lark's parser accepts there (asked of lark's interactive parser once)."""

    def __init__(self) -> None:
        terminals = {t.name: t for t in _parser().terminals}
        # each terminal as group 1, then the blanks after it
        self.regexes = {
            name: re.compile(f"({terminals[name].pattern.to_regexp()})[ \\t\\f\\r\\n]*")
            for name in ("NAME", "PATTERN", "INT", "STRING")
        }
        self.words = {
            t.name: frozenset(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", t.pattern.value))
            for t in terminals.values()
            if t.name not in _FREE
        }
        self.keywords = frozenset(w for words in self.words.values() for w in words)
        self._accepted: dict[str, frozenset[str]] = {}

    def accepted(self, place: str) -> frozenset[str]:
        """The keywords lark's parser accepts at ``place``."""
        got = self._accepted.get(place)
        if got is None:
            with _LOCK:
                state = _parser().parse_interactive(_PLACES[place])
                state.exhaust_lexer()
                names = state.accepts()
            got = frozenset(w for n in names for w in self.words.get(n, ()))
            self._accepted[place] = got
        return got


@lru_cache(maxsize=1)
def _lexicon() -> _Lexicon:
    return _Lexicon()


_BLANK = re.compile(r"[ \t\f\r\n]*")
# What can hide a '}' in a block: a string, a comment, a pattern's braces.
_BLOCK_STOP = re.compile(r'["#{}]')
_GROUP = re.compile(r"\{[A-Za-z0-9_,*]+\}")
_ITEMS = frozenset(("shard", "local", "replicate", "fuse", "checkpoint", "style", "heads", "view"))


def fast_statements(text: str, source: ir.Source) -> list[object] | None:
    """The statements of ``text`` (IR, in file order, as
    :func:`~shardspec.frontend.parse.lark_statements` gives them), or None where the fast
    reader does not read the text (lark then does)."""
    try:
        return _Reader(text, source).statements()
    except (_Decline, IndexError):  # IndexError: the text ended inside a statement
        return None


def _rule_reader(text: str, source: ir.Source) -> Any:
    """A function that reads again the rule whose statement starts at an offset of
    ``text`` (one the reader read before, to the same node)."""

    def read(start: int, index: int) -> ir.Rule:
        reader = _Reader(text, source)
        reader.pos = reader.base = start
        reader.at = ir.Anchor(source, start)
        reader.rule_index = index
        return reader.param()

    return read


class _Reader:
    def __init__(self, text: str, source: ir.Source) -> None:
        self.lexicon = lexicon = _lexicon()
        self.word_re = lexicon.regexes["NAME"].match
        self.pattern_re = lexicon.regexes["PATTERN"].match
        self.int_re = lexicon.regexes["INT"].match
        self.string_re = lexicon.regexes["STRING"].match
        self.text, self.source, self.pos = text, source, 0
        self.rule_index = 0
        self.at = ir.Anchor(source)
        self.base = self.last = 0  # the statement's start; the end of the last token

    # -- tokens: each regex takes a token (group 1) and the blanks after it --------------

    def blank(self) -> None:
        """Past white space and comments."""
        text, pos = self.text, self.pos
        while True:
            m = _BLANK.match(text, pos)
            pos = m.end() if m else pos
            if not text.startswith("#", pos):
                self.pos = pos
                return
            nl = text.find("\n", pos)
            pos = len(text) if nl < 0 else nl

    def take(self, m: re.Match[str]) -> None:
        """Take the token that ``m`` matched, and the blanks and comments after it."""
        self.last, self.pos = m.end(1), m.end()
        if self.text.startswith("#", self.pos):
            self.blank()

    def peek(self) -> tuple[str, re.Match[str] | None]:
        """The word (a keyword or a name) at the position, not taken yet ("" if none),
        and its match for :meth:`take`."""
        m = self.word_re(self.text, self.pos)
        return (m.group(1), m) if m else ("", None)

    def keyword(self, expected: str) -> None:
        """Take keyword ``expected``, a whole word."""
        m = self.word_re(self.text, self.pos)
        if m is None or m.group(1) != expected:
            raise _Decline
        self.take(m)

    def char(self, c: str) -> None:
        if self.text[self.pos] != c:
            raise _Decline
        self.pos += 1
        self.last = self.pos
        self.blank()

    def _token(self, match: Any, place: str) -> tuple[int, int, str]:
        """(start, end) in the statement and the text of the free token that ``match``
        finds at the position, at ``place`` (a key of :data:`_PLACES`); one that lark reads
        as a keyword there, or that is too long, is lark's to read."""
        m = match(self.text, self.pos)
        if m is None:
            raise _Decline
        got = m.group(1)
        if len(got) > MAX_TOKEN or (
            got in self.lexicon.keywords and got in self.lexicon.accepted(place)
        ):
            raise _Decline
        start = self.pos - self.base
        self.take(m)
        return start, start + len(got), got

    def name(self, place: str) -> ir.Name:
        start, end, got = self._token(self.word_re, place)
        return ir.Name(at=self.at, start=start, end=end, text=sys.intern(got))

    def pattern(self, place: str) -> ir.Pattern:
        start, end, got = self._token(self.pattern_re, place)
        return ir.Pattern(at=self.at, start=start, end=end, text=got)

    def number(self) -> int:
        """A whole number."""
        m = self.int_re(self.text, self.pos)
        if m is None or number_too_large(m.group(1)):  # (or too long: SS006, SS007)
            raise _Decline
        self.take(m)
        return int(m.group(1))

    def ended(self) -> int:
        """Where the last token taken ends, in the statement."""
        return self.last - self.base

    # -- statements ----------------------------------------------------------------------

    def statements(self) -> list[object]:
        out: list[object] = []
        text = self.text
        table = ir.RuleTable(text, _rule_reader(text, self.source))
        rules: list[ir.Rule] = []  # while there are fewer than COLUMNS_FROM
        shapes: dict[Any, int] = {}
        self.blank()
        while self.pos < len(text):
            start = self.pos
            self.base, self.at = start, ir.Anchor(self.source, start)
            kw, _ = self.peek()
            if kw == "param":
                rule = self.param()
                table.add(rule, start, self.last, shapes)
                if len(rules) < COLUMNS_FROM:
                    rules.append(rule)
            elif kw == "ignore":
                self.keyword("ignore")
                pattern = self.pattern("ignore")
                out.append(ir.IgnoreRule(at=self.at, start=0, end=self.ended(), pattern=pattern))
            elif kw == "fsdp":
                self.keyword("fsdp")
                axis = self.name("fsdp")
                out.append(_Fsdp(axis, self.source.span(start, self.base + self.ended())))
            elif kw == "manifest":
                out.append(self.manifest())
            elif kw == "checkpoint":
                out.append(self.checkpoint_keys())
            elif kw in ("mesh", "hf", "pipeline"):
                out.extend(self.block(kw))
            else:
                raise _Decline
        if len(table) < COLUMNS_FROM:
            out.extend(rules)  # (the order of rules among other statements is their own)
        else:
            out.append(table)
        return out

    def manifest(self) -> _Manifest:
        start = self.pos
        self.keyword("manifest")
        m = self.string_re(self.text, self.pos)
        if m is None or len(m.group(1)) > MAX_TOKEN:
            raise _Decline
        at = self.pos
        self.take(m)
        path_span = self.source.span(at, self.last)
        return _Manifest(m.group(1)[1:-1], path_span, self.source.span(start, self.last))

    def checkpoint_keys(self) -> ir.CheckpointKeys:
        """``checkpoint keys NAME``."""
        self.keyword("checkpoint")
        self.keyword("keys")
        layout = self.name("checkpoint keys")
        return ir.CheckpointKeys(at=self.at, start=0, end=self.ended(), layout=layout)

    def block(self, kw: str) -> list[object]:
        """A ``mesh``, ``hf`` or ``pipeline`` statement, parsed by lark on its own."""
        start = self.pos
        end = _block_end(self.text, start)
        got = lark_statements(self.text[start:end], _ToIR(self.source, shift=start))
        if isinstance(got, Diagnostic) or len(got) != 1:
            raise _Decline
        self.pos = self.last = end
        self.blank()
        return got

    def param(self) -> ir.Rule:
        """``param PATTERN [dims] { items }`` or ``param PATTERN [dims] replicate``."""
        self.keyword("param")
        pattern = self.pattern("param")
        dims = None
        if self.text[self.pos] == "[":
            self.char("[")
            names: list[ir.Name] = []
            if self.text[self.pos] != "]":
                names.append(self.name("dims"))
                while self.text[self.pos] == ",":
                    self.char(",")
                    names.append(self.name("dims,"))
            self.char("]")
            dims = tuple(names)
        body: list[Any] | _ReplicateAll
        if self.text[self.pos] == "{":
            self.char("{")
            body = []
            while self.text[self.pos] != "}":
                body.append(self.item())
            self.char("}")
        else:
            self.keyword("replicate")
            body = _ReplicateAll()
        place: ir.Placed = {"at": self.at, "start": 0, "end": self.ended()}
        rule = rule_node(place, self.rule_index, pattern, dims, body)
        self.rule_index += 1
        return rule

    def item(self) -> object:
        """One item of a rule's braces."""
        kw, m = self.peek()
        if kw not in _ITEMS or m is None:
            raise _Decline
        start = self.pos - self.base
        self.take(m)
        if kw == "shard":
            dim = self.name("shard")
            self.keyword("over")
            axes = self.axis_list("shard")
            return ir.ShardItem(at=self.at, start=start, end=self.ended(), dim=dim, axes=axes)
        if kw in ("local", "replicate"):
            names = [self.name(kw)]
            while self.text[self.pos] == ",":
                self.char(",")
                names.append(self.name(kw + ","))
            return (_Local if kw == "local" else _Replicate)(tuple(names))
        if kw == "fuse":
            return self.fuse(start)
        if kw == "checkpoint":
            if self.peek()[0] == "replicate":
                self.keyword("replicate")
                span = self.source.span(self.base + start, self.base + self.ended())
                return _CheckpointReplicate((span,))
            self.keyword("shard")
            dim = self.name("checkpoint")
            self.keyword("over")
            axes = self.axis_list("checkpoint")
            shard = ir.ShardItem(at=self.at, start=start, end=self.ended(), dim=dim, axes=axes)
            return _CheckpointShard((shard,))
        if kw == "style":
            return self.style(start)
        if kw == "view":
            return _View((self.name("view"),))
        return self.heads()

    def axis_list(self, item: str) -> tuple[ir.Name, ...]:
        """``AXIS`` or ``(AXIS, ...)`` after ``over`` in a ``shard`` or ``checkpoint``
        item."""
        if self.text[self.pos] != "(":
            return (self.name(item + " over"),)
        self.char("(")
        names = [self.name(item + " (")]
        while self.text[self.pos] == ",":
            self.char(",")
            names.append(self.name(item + " (,"))
        self.char(")")
        return tuple(names)

    def fuse(self, start: int) -> ir.FuseItem:
        """``fuse DIM as COMPONENTS [squeezed] [stored fused]``, COMPONENTS ``a 32, b`` or
        ``N groups of a 32, b``."""
        dim = self.name("fuse")
        self.keyword("as")
        groups, place = None, "fuse as"
        if self.text[self.pos].isdigit():
            groups = self.number()
            self.keyword("groups")
            self.keyword("of")
            place = "fuse of"
        components = [self.component(place)]
        while self.text[self.pos] == ",":
            self.char(",")
            components.append(self.component("fuse,"))
        squeezed = self.peek()[0] == "squeezed"
        if squeezed:
            self.keyword("squeezed")
        stored = self.peek()[0] == "stored"
        if stored:
            self.keyword("stored")
            self.keyword("fused")
        return ir.FuseItem(
            at=self.at,
            start=start,
            end=self.ended(),
            dim=dim,
            components=tuple(components),
            groups=groups,
            stored_fused=stored,
            squeezed=squeezed,
        )

    def component(self, place: str) -> ir.Component:
        name = self.name(place)
        size = self.number() if self.text[self.pos].isdigit() else None
        end = self.ended()
        return ir.Component(at=self.at, start=name.start, end=end, name=name, size=size)

    def heads(self) -> _Heads:
        sizes = [self.head_size("heads")]
        while self.text[self.pos] == ",":
            self.char(",")
            sizes.append(self.head_size("heads,"))
        return _Heads(tuple(sizes))

    def head_size(self, place: str) -> ir.HeadSize:
        target = self.name(place)
        if self.text[self.pos].isdigit():
            size, size_name = self.number(), None
        else:
            size, size_name = None, self.name("heads size")
        replicated = self.replicated_word()
        return ir.HeadSize(
            at=self.at,
            start=target.start,
            end=self.ended(),
            target=target,
            size=size,
            size_name=size_name,
            replicated=replicated,
        )

    def replicated_word(self) -> bool:
        """``replicated`` after a head size (a keyword there: lark's lexer reads it so)."""
        word, m = self.peek()
        if word != "replicated" or m is None:
            return False
        self.take(m)
        return True

    def style(self, start: int) -> ir.StyleItem:
        """``style KIND [input LAYOUT] [output LAYOUT] [dtensor]`` (options in any order,
        a later one of a kind winning, as lark's reading does)."""
        kind = self.name("style")
        options: dict[str, Any] = {}
        while True:
            opt, m = self.peek()
            if m is not None and opt in ("input", "output"):
                self.take(m)
                options[opt] = self.name("style option")
            elif m is not None and opt == "dtensor":
                self.take(m)
                options["dtensor"] = True
            else:
                break
        return ir.StyleItem(at=self.at, start=start, end=self.ended(), kind=kind, **options)


def _block_end(text: str, start: int) -> int:
    """The end of the block statement at ``start`` (just past its closing brace): the
    first '}' after its opening '{' that no string, comment or pattern's braces hold."""
    opened = False
    i = start
    while True:
        m = _BLOCK_STOP.search(text, i)
        if m is None:
            raise _Decline
        c, i = m.group(), m.start()
        if c == '"':
            close = text.find('"', i + 1)
            if close < 0 or "\n" in text[i:close]:
                raise _Decline
            i = close + 1
        elif c == "#":
            nl = text.find("\n", i)
            i = len(text) if nl < 0 else nl
        elif c == "{" and not opened:
            opened, i = True, i + 1
        elif c == "{":
            g = _GROUP.match(text, i)
            if g is None:
                raise _Decline
            i = g.end()
        elif opened:
            return i + 1
        else:
            raise _Decline
