"""The IR: what a ``.shard`` file says, as typed objects that keep their source spans.

The parser builds these; resolution, checks and code generation read them. Nothing here
computes layouts (that is :mod:`shardspec.core.layout`) or knows about parameters (that is
:mod:`shardspec.resolve.params`).

A spec of half a million rules holds millions of nodes, so a node is small: a frozen,
slotted dataclass whose place in the text is two offsets from its statement's start
(:class:`Anchor`; numbers that small are shared by Python, not allocated per node), turned
into a :class:`~shardspec.findings.diagnostics.Span` (file, line, column) only when asked
for (``node.span``), and whose lists are tuples (an empty one costs nothing).
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_right
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypedDict, overload

from shardspec.findings.diagnostics import Span


class Source:
    """The text a spec was parsed from and the path its spans name. Offsets become lines
    and columns (1-based, as lark counts them) through a table of where each line starts,
    built the first time a span is asked for."""

    __slots__ = ("_starts", "path", "text")

    def __init__(self, path: str, text: str) -> None:
        self.path, self.text = path, text
        self._starts: array[int] | None = None

    def line_col(self, offset: int) -> tuple[int, int]:
        """(line, column) of the character at ``offset``."""
        starts = self._starts
        if starts is None:
            starts = self._starts = array("i" if len(self.text) < 2**31 else "q", [0])
            starts.extend(m.end() for m in re.finditer("\n", self.text))
        line = bisect_right(starts, offset)
        return line, offset - starts[line - 1] + 1

    def span(self, start: int, end: int) -> Span:
        """The span of the characters from ``start`` to ``end`` (offsets, end exclusive)."""
        line, col = self.line_col(start)
        end_line, end_col = self.line_col(end)
        return Span(self.path, line, col, end_line, end_col)


@dataclass(frozen=True, slots=True)
class Anchor:
    """Where a statement of ``source`` starts (``base``, an offset): its nodes' offsets
    count from there. One per statement: a spec of half a million rules holds as many."""

    source: Source | None
    base: int = 0

    def span(self, start: int, end: int) -> Span:
        assert self.source is not None
        return self.source.span(self.base + start, self.base + end)


@dataclass(frozen=True, slots=True)
class FixedAnchor(Anchor):
    """The anchor of a node built from a span, not parsed (its offsets are 0): that span."""

    fixed: Span | None = None

    def span(self, start: int, end: int) -> Span:
        assert self.fixed is not None
        return self.fixed


class Placed(TypedDict):
    """A node's place, as :class:`Node`'s fields (``ir.Name(**placed(span), text=...)``)."""

    at: Anchor
    start: int
    end: int


def placed(span: Span) -> Placed:
    """The place of a node built from ``span`` rather than parsed."""
    return {"at": FixedAnchor(None, 0, span), "start": 0, "end": 0}


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class Node:
    """A piece of the spec and where it is written: ``start`` and ``end`` (exclusive) count
    characters from the start of its statement (``at``). Every node is a frozen dataclass
    with slots, built by keyword: a field that a node does not have is an error
    (TypeError), never silently dropped. Two nodes are equal when they are of one class,
    have one span and equal fields; ``repr`` shows the span."""

    at: Anchor
    start: int
    end: int

    @property
    def span(self) -> Span:
        """Where the node is written."""
        return self.at.span(self.start, self.end)

    def _shown(self) -> tuple[str, ...]:
        """The fields compared, hashed and shown (all but the place)."""
        return tuple(f.name for f in fields(self)[3:])

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._shown())

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, Node)
        return self.span == other.span and self._values() == other._values()

    def __hash__(self) -> int:
        return hash((type(self), self.span, self._values()))

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._shown())
        return f"{type(self).__name__}(span={self.span!r}{', ' if shown else ''}{shown})"


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class Name(Node):
    """An identifier as written: an axis, a dimension or a component name."""

    text: str


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class AxisDecl(Node):
    name: Name
    size: int | None  # None: this axis takes the rest of the world size
    aliases: tuple[Name, ...] = ()  # `aka NAME, ...`: the axis as trainers' meshes call it


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class MeshDecl(Node):
    """``mesh [NAME] [over N ranks] { AXIS: SIZE ... }``; a named mesh is a *view*, one of
    several factorizations of the same ranks."""

    axes: tuple[AxisDecl, ...]
    world: int | None = None
    name: Name | None = None  # None: the spec's one unnamed mesh


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class Component(Node):
    name: Name
    size: int | None = None  # None: equal parts of the dimension


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class FuseItem(Node):
    dim: Name
    components: tuple[Component, ...]
    groups: int | None = None
    stored_fused: bool = False
    # `squeezed`: each component is one index of the dimension, stored without it.
    squeezed: bool = False


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HeadSize(Node):
    """``TARGET SIZE`` in a ``heads`` item: dimension or fused component ``target`` comes
    in heads of ``size`` indices, or of the value of the name ``size_name`` (a factory
    argument of the manifest, or a config.json key of the hf block's HF manifest)."""

    target: Name
    size: int | None = None
    size_name: Name | None = None
    # `heads k 16 replicated`: where the axis splitting the fused dimension has more ranks
    # than the component has heads, each head is held whole by consecutive ranks (vLLM).
    replicated: bool = False

    @property
    def size_text(self) -> str:
        """The size as written."""
        return self.size_name.text if self.size_name is not None else str(self.size)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class ShardItem(Node):
    dim: Name
    axes: tuple[Name, ...]  # outer -> inner


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class StyleItem(Node):
    """``style KIND [input LAYOUT] [output LAYOUT] [dtensor]``: the tensor-parallel style
    of the module holding the parameter, and its activations' layouts."""

    kind: Name
    input: Name | None = None
    output: Name | None = None
    dtensor: bool = False


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class Pattern(Node):
    text: str


@dataclass(frozen=True, slots=True)
class RuleRest:
    """The fields of a :class:`Rule` that most rules leave at their defaults, held apart so
    that a rule costs a slot for them all: one object shared by every rule that sets none
    of the node fields (per value of the two flags), one of its own otherwise."""

    dims_given: bool = True
    replicate_all: bool = False
    local: tuple[Name, ...] = ()
    replicate: tuple[Name, ...] = ()
    checkpoint_shards: tuple[ShardItem, ...] = ()
    checkpoint_replicate: Span | None = None
    extra_styles: tuple[StyleItem, ...] = ()
    view: Name | None = None
    extra_views: tuple[Name, ...] = ()


# The RuleRest of each (dims_given, replicate_all) with no node fields set.
_PLAIN_RESTS = {
    (given, all_): RuleRest(dims_given=given, replicate_all=all_)
    for given in (True, False)
    for all_ in (True, False)
}

# A Rule's fields as it is built, compared, hashed and shown, in this order.
_RULE_FIELDS = (
    "index",
    "pattern",
    "dims",
    "dims_given",
    "replicate_all",
    "shards",
    "fusions",
    "local",
    "replicate",
    "checkpoint_shards",
    "checkpoint_replicate",
    "style",
    "heads",
    "extra_styles",
    "view",
    "extra_views",
)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False, init=False)
class Rule(Node):
    """``param PATTERN [dims] { ... }``.

    Built by keyword with every field below; the fields most rules leave at their defaults
    (``dims_given`` to ``extra_views`` but ``style`` and ``heads``) are read through
    properties from a :class:`RuleRest` (shared when they are all defaults)."""

    index: int  # position in the file, 0-based
    pattern: Pattern
    dims: tuple[Name, ...]
    shards: tuple[ShardItem, ...]
    fusions: tuple[FuseItem, ...]
    style: StyleItem | None
    # `heads kv 128, ...`: head sizes of dims or components
    heads: tuple[HeadSize, ...]
    rest: RuleRest

    def __init__(
        self,
        *,
        at: Anchor,
        start: int,
        end: int,
        index: int,
        pattern: Pattern,
        dims: tuple[Name, ...],
        dims_given: bool = True,  # `param p replicate` may omit the dimension list
        replicate_all: bool = False,
        shards: tuple[ShardItem, ...] = (),
        fusions: tuple[FuseItem, ...] = (),
        local: tuple[Name, ...] = (),
        # axes this rule explicitly keeps replicated (opts out of fsdp)
        replicate: tuple[Name, ...] = (),
        # `checkpoint shard DIM over AXIS`: stored chunks split further over axes the
        # parameter is replicated on at run time; `checkpoint replicate`: the runtime
        # chunks (the default).
        checkpoint_shards: tuple[ShardItem, ...] = (),
        checkpoint_replicate: Span | None = None,
        style: StyleItem | None = None,
        heads: tuple[HeadSize, ...] = (),
        # a second `style` in one rule (an error)
        extra_styles: tuple[StyleItem, ...] = (),
        # `view NAME`: the view (named mesh) that places the parameter; later ones (an error)
        view: Name | None = None,
        extra_views: tuple[Name, ...] = (),
    ) -> None:
        if local or replicate or checkpoint_shards or checkpoint_replicate or extra_styles:
            plain = False
        else:
            plain = view is None and not extra_views
        rest = (
            _PLAIN_RESTS[dims_given, replicate_all]
            if plain
            else RuleRest(
                dims_given,
                replicate_all,
                local,
                replicate,
                checkpoint_shards,
                checkpoint_replicate,
                extra_styles,
                view,
                extra_views,
            )
        )
        put = object.__setattr__
        for name, value in (
            ("at", at),
            ("start", start),
            ("end", end),
            ("index", index),
            ("pattern", pattern),
            ("dims", dims),
            ("shards", shards),
            ("fusions", fusions),
            ("style", style),
            ("heads", heads),
            ("rest", rest),
        ):
            put(self, name, value)

    @property
    def dims_given(self) -> bool:
        return self.rest.dims_given

    @property
    def replicate_all(self) -> bool:
        return self.rest.replicate_all

    @property
    def local(self) -> tuple[Name, ...]:
        return self.rest.local

    @property
    def replicate(self) -> tuple[Name, ...]:
        return self.rest.replicate

    @property
    def checkpoint_shards(self) -> tuple[ShardItem, ...]:
        return self.rest.checkpoint_shards

    @property
    def checkpoint_replicate(self) -> Span | None:
        return self.rest.checkpoint_replicate

    @property
    def extra_styles(self) -> tuple[StyleItem, ...]:
        return self.rest.extra_styles

    @property
    def view(self) -> Name | None:
        return self.rest.view

    @property
    def extra_views(self) -> tuple[Name, ...]:
        return self.rest.extra_views

    def _shown(self) -> tuple[str, ...]:
        return _RULE_FIELDS


class RuleTable(Sequence[Rule]):
    """The rules of a large spec, as the fast reader read them, in columns: per rule, where
    its statement starts and ends and where its pattern is (offsets in the text), and its
    *shape*: the text of its statement around the pattern. Rules of one shape differ only
    in their pattern and their place, so one :class:`Rule` per shape (the first rule of
    it, :attr:`shapes`) holds what they say; a rule's own node is read again from the text
    when asked for (``table[i]``: the same node the reader built, spans included).

    The per-rule loops of resolve and the checks read :meth:`shape_of` and
    :meth:`pattern_text` (see :func:`rules_to_check`); other code reads the rules as a
    tuple's, a few at a time (the last ones read are kept)."""

    __slots__ = ("_cache", "_ends", "_pattern", "_read", "_shape", "_starts", "shapes", "text")

    _CACHE = 4096

    def __init__(self, text: str, read: Callable[[int, int], Rule]) -> None:
        self.text = text
        self._read = read  # (statement start, rule index) -> the rule
        big = "i" if len(text) < 2**31 else "q"
        self._starts: array[int] = array(big)
        self._ends: array[int] = array(big)
        self._pattern: array[int] = array(big)  # pattern start, end: two per rule
        self._shape: array[int] = array("i")
        self.shapes: list[Rule] = []
        self._cache: dict[int, Rule] = {}

    def add(self, rule: Rule, start: int, end: int, known: dict[Hashable, int]) -> None:
        """Append ``rule`` (the next index), its statement from ``start`` to ``end``;
        ``known``: the shape ids by key, shared by the calls of one reading."""
        p0, p1 = start + rule.pattern.start, start + rule.pattern.end
        key = (self.text[start:p0], self.text[p1:end])
        shape = known.get(key)
        if shape is None:
            shape = known[key] = len(self.shapes)
            self.shapes.append(rule)
        self._starts.append(start)
        self._ends.append(end)
        self._pattern.extend((p0, p1))
        self._shape.append(shape)

    def __len__(self) -> int:
        return len(self._starts)

    def shape_of(self, index: int) -> int:
        """The shape id of rule ``index`` (an index into :attr:`shapes`)."""
        return self._shape[index]

    def shape_ids(self) -> array[int]:
        """Every rule's shape id, in rule order."""
        return self._shape

    def pattern_text(self, index: int) -> str:
        """The pattern of rule ``index`` as written."""
        return self.text[self._pattern[2 * index] : self._pattern[2 * index + 1]]

    @overload
    def __getitem__(self, index: int) -> Rule: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Rule, ...]: ...

    def __getitem__(self, index: int | slice) -> Rule | tuple[Rule, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(len(self))[index])
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("rule index out of range")
        rep = self.shapes[self._shape[index]]
        if rep.index == index:
            return rep
        got = self._cache.get(index)
        if got is None:
            got = self._read(self._starts[index], index)
            if len(self._cache) >= self._CACHE:
                self._cache.clear()
            self._cache[index] = got
        return got

    def __iter__(self) -> Iterator[Rule]:
        for i in range(len(self)):
            yield self[i]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (tuple, RuleTable)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"RuleTable({len(self)} rules, {len(self.shapes)} shapes)"


def rules_to_check(
    rules: Sequence[Rule],
    finds: Callable[[Rule], bool],
    key: Callable[[RuleTable, int], Hashable] | None = None,
) -> Iterator[Rule]:
    """The rules a per-rule check must read, in order: every rule of a tuple; of a
    :class:`RuleTable`, the rules of each shape whose first rule ``finds`` something in
    (rules of one shape say the same but for their pattern and place, so a check that
    reads neither finds the same in each). ``key`` (table, index): a check that reads the
    pattern too keys rules by what it reads of it (their shape included), and the first
    rule of each key is asked."""
    if not isinstance(rules, RuleTable):
        yield from rules
        return
    shapes = rules.shape_ids()
    if key is None:
        bad = [finds(rep) for rep in rules.shapes]
        if not any(bad):
            return
        for i, shape in enumerate(shapes):
            if bad[shape]:
                yield rules[i]
        return
    asked: dict[Hashable, bool] = {}
    for i in range(len(rules)):
        k = key(rules, i)
        got = asked.get(k)
        if got is None:
            got = asked[k] = finds(rules[i])
        if got:
            yield rules[i]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class IgnoreRule(Node):
    pattern: Pattern


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFTransform(Node):
    """``transpose``, ``rope N`` (``head_dim`` N), or ``pad D to M [x AXIS ...]`` (``dim``
    D, ``multiple`` M, ``axes`` the mesh axes whose sizes multiply M), on an hf map line."""

    kind: str
    head_dim: int = 0
    dim: int = 0
    multiple: int = 0
    axes: tuple[Name, ...] = ()
    # `pad vocab to 64`: the target rule's dimension name, resolved to ``dim`` when the
    # spec is read (:mod:`shardspec.frontend.padnames`)
    dim_name: Name | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFConfigFactor(Node):
    """One factor of a ``config`` product: a config.json key or a whole number."""

    text: str

    @property
    def number(self) -> int | None:
        return int(self.text) if self.text.isdigit() else None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFPart(Node):
    """One part of a split line's ``as`` list: a fused component, an optional stated size
    (a whole number or a product of config.json keys) and the part's own transforms."""

    name: Name
    size: tuple[HFConfigFactor, ...] | None = None
    size_span: Span | None = None
    transforms: tuple[HFTransform, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFMapItem(Node):
    """``HF_TEMPLATE -> TARGET_TEMPLATE[stack] transform... [grouped] [as PART, ...]`` in
    an ``hf`` block; ``grouped`` is the keyword's span, or None without it."""

    hf: Pattern
    target: Pattern
    stack: Name | None = None
    transforms: tuple[HFTransform, ...] = ()
    parts: tuple[HFPart, ...] | None = None
    grouped: Span | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFGlob(Node):
    """``drop GLOB`` (HF keys nothing consumes) or ``keep GLOB`` (storage units the HF
    checkpoint does not provide)."""

    pattern: Pattern


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFTie(Node):
    """``tie ALIAS = SOURCE``: HF key ``alias`` is the same tensor as HF key ``source``."""

    alias: Pattern
    source: Pattern


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFConfig(Node):
    """``config NAME = a * b * 2``: dimension or component ``name`` has that size."""

    name: Name
    factors: tuple[HFConfigFactor, ...]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFFp8Option(Node):
    """One option of an ``fp8`` line: ``scale TEMPLATE`` (kind ``scale``, ``text`` the
    template), ``block R x C`` (kind ``block``, ``block`` the sizes), or a word (kind
    ``word``: ``float32``, ``bfloat16``, ``float16``, ``ue8m0``, ``e4m3`` or ``e5m2``)."""

    kind: str
    text: str = ""
    block: tuple[int, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFFp8(Node):
    """``fp8 GLOB [scale TEMPLATE] [block R x C] [SCALE FORMAT] [e4m3 | e5m2]``: the HF keys
    matching ``glob`` are stored block-scaled in FP8; ``options`` in file order."""

    glob: Pattern
    options: tuple[HFFp8Option, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class HFBlock(Node):
    """``hf "manifest.hf.json" { ... }``; each list keeps its items in file order."""

    manifest: str | None = None
    manifest_span: Span | None = None
    maps: tuple[HFMapItem, ...] = ()
    drops: tuple[HFGlob, ...] = ()
    ties: tuple[HFTie, ...] = ()
    keeps: tuple[HFGlob, ...] = ()
    configs: tuple[HFConfig, ...] = ()
    fp8: tuple[HFFp8, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class StageSplit(Node):
    """``split PATTERN [as N, N, ...] [local]`` in a pipeline block."""

    pattern: Pattern
    counts: tuple[int, ...] = ()
    counts_span: Span | None = None
    local_names: bool = False


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class StageTie(Node):
    """``tie ALIAS = SOURCE`` in a pipeline block: parameter ``alias`` (global name, on its
    own stage) is the same weight as parameter ``source`` (tied embeddings and head)."""

    alias: Pattern
    source: Pattern


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class Pipeline(Node):
    """``pipeline AXIS { first ...  split ...  last ...  tie ... }``; lists keep file order."""

    axis: Name
    first: tuple[Pattern, ...] = ()
    last: tuple[Pattern, ...] = ()
    splits: tuple[StageSplit, ...] = ()
    ties: tuple[StageTie, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class Suppression(Node):
    """``# shardspec: ignore[SS121, SS122]`` on the line it silences."""

    codes: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True, eq=False, repr=False)
class CheckpointKeys(Node):
    """``checkpoint keys NAME``: the key layout checkpoints are saved and loaded in by
    default (``torchtitan``: as that trainer's state-dict hooks write them)."""

    layout: Name


@dataclass(frozen=True, slots=True, kw_only=True)
class Spec:
    """A whole ``.shard`` file."""

    path: str
    source: str
    sha256: str
    manifest: str | None = None
    manifest_span: Span | None = None
    # The default mesh: the unnamed one, or else the first view (named mesh) declared.
    mesh: MeshDecl | None = None
    fsdp: Name | None = None  # the first `fsdp AXIS`
    # Named meshes (views) in file order, and every `fsdp AXIS` in file order (a spec with
    # views may give one per view).
    views: tuple[MeshDecl, ...] = ()
    fsdps: tuple[Name, ...] = ()
    rules: tuple[Rule, ...] | RuleTable = ()
    ignores: tuple[IgnoreRule, ...] = ()
    hf: HFBlock | None = None
    pipeline: Pipeline | None = None
    checkpoint_keys: CheckpointKeys | None = None
    suppressions: tuple[Suppression, ...] = ()

    @property
    def name(self) -> str:
        """The spec's name: its file name without ``.shard``."""
        base = self.path.replace("\\", "/").rsplit("/", 1)[-1]
        return base[: -len(".shard")] if base.endswith(".shard") else base
