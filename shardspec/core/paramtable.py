"""A whole model's parameter table, folded into rows of names that differ only in numbers.

A model with a million parameters has a few dozen kinds of them: ``model.layers.7.mlp.
experts.12.up_proj.weight`` differs from its siblings only in its numeric segments. A
generated module therefore lists one row per kind, with each numeric segment written as the
set of numbers it takes::

    "model.layers.{3..60}.mlp.experts.{0..255}.up_proj.weight": Param(9, (2048, 7168), "bfloat16")

A ``{...}`` segment holds runs, ``a..b`` (both included) or a single number, separated by
commas (``{0..2,5,7..9}``); a row stands for every combination of its segments' numbers.
Names that differ in a value (another shape, another rule) go in rows of their own. A
literal ``{`` or ``}`` in a name is doubled, as in a format string.

:class:`ParamTable` is a read-only mapping from every name to its value, built from the
rows without expanding them: a lookup parses the name's numbers and finds the row holding
them; ``len`` multiplies; iteration expands rows lazily, in sorted name order (the order
of the manifest). :func:`fold` turns names into rows (the compiler's side), and
:meth:`ParamTable.from_names` does the same for a table built by hand.

A segment counts as a number when it is one in canonical decimal form (``0``, ``17``; not
``007``, not more than 18 digits), among the first 16 such segments of its name: only those
are folded, so that the folded and the expanded names are the same text (and no name's
folding costs more than a few levels). Pure Python, shared by the compiler and the runtime.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
import re
from collections import defaultdict
from collections.abc import Hashable, ItemsView, Iterable, Iterator, Mapping, ValuesView
from dataclasses import dataclass
from typing import TypeVar

V = TypeVar("V", bound=Hashable)

MAX_DIGITS = 18  # longer numeric segments are kept as literal text
MAX_SLOTS = 16  # numeric segments of a name past this many are kept as literal text
# Rows that share a skeleton (the same names with other numbers) are scanned per lookup up
# to this many; past it, they are split by the numbers of one segment (see _Node).
SCAN_ROWS = 8
# Rows of one skeleton are checked pairwise for names they share up to this many (the
# compiler's rows never share one; this catches a table edited by hand).
CHECK_ROWS = 64

Runs = tuple[tuple[int, int], ...]  # sorted, disjoint, non-adjacent inclusive runs


class TableError(ValueError):
    """A row key that is not a well-formed folded name, or rows that name a parameter twice."""


def _is_number(segment: str) -> bool:
    return (
        segment.isascii()
        and segment.isdigit()
        and len(segment) <= MAX_DIGITS
        and (segment == "0" or segment[0] != "0")
    )


def _escape(segment: str) -> str:
    if "{" in segment or "}" in segment:
        return segment.replace("{", "{{").replace("}", "}}")
    return segment


def _unescape(segment: str) -> str:
    return segment.replace("{{", "{").replace("}}", "}")


def split_name(name: str) -> tuple[str, tuple[int, ...]]:
    """A name's skeleton (its text with each numeric segment as ``{}`` and literal braces
    doubled, a ``str.format`` template) and its numbers."""
    parts = name.split(".")
    numbers: list[int] = []
    braces = "{" in name or "}" in name
    for i, segment in enumerate(parts):
        if segment.isdigit() and _is_number(segment) and len(numbers) < MAX_SLOTS:
            parts[i] = "{}"
            numbers.append(int(segment))
        elif braces:
            parts[i] = _escape(segment)
    return ".".join(parts), tuple(numbers)


def to_runs(values: Iterable[int]) -> Runs:
    """Sorted numbers as inclusive runs: ``[0, 1, 2, 5]`` -> ``((0, 2), (5, 5))``."""
    out: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if out and out[-1][1] == v - 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return tuple(out)


def runs_text(runs: Runs) -> str:
    """A segment's text: a lone number as it is, else ``{a..b,c}``."""
    if len(runs) == 1 and runs[0][0] == runs[0][1]:
        return str(runs[0][0])
    return "{" + ",".join(f"{a}" if a == b else f"{a}..{b}" for a, b in runs) + "}"


def _count(runs: Runs) -> int:
    return sum(b - a + 1 for a, b in runs)


def _holds(runs: Runs, value: int) -> bool:
    i = bisect.bisect_right(runs, (value, math.inf)) - 1
    return i >= 0 and runs[i][0] <= value <= runs[i][1]


def _overlap(x: Runs, y: Runs) -> bool:
    i = j = 0
    while i < len(x) and j < len(y):
        if x[i][1] < y[j][0]:
            i += 1
        elif y[j][1] < x[i][0]:
            j += 1
        else:
            return True
    return False


# ----------------------------------------------------------------------------- folding


def _factor(points: list[tuple[int, ...]]) -> tuple[tuple[Runs, ...], ...]:
    """Number tuples (all of one length) as a union of disjoint products of runs, exactly:
    the first numbers whose remaining tuples factor alike share a product."""
    if not points[0]:
        return ((),)
    if len(points[0]) == 1:
        return ((to_runs(p[0] for p in points),),)
    rests: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for p in points:
        rests[p[0]].append(p[1:])
    firsts: dict[tuple[tuple[Runs, ...], ...], list[int]] = defaultdict(list)
    for first, rest in rests.items():
        firsts[_factor(rest)].append(first)
    return tuple(sorted((to_runs(fs), *product) for form, fs in firsts.items() for product in form))


def _row_text(skeleton: str, product: tuple[Runs, ...]) -> str:
    """The row's key: the skeleton's ``{}`` segments written as their runs (literal braces
    stay doubled)."""
    sets = iter(product)
    return ".".join(runs_text(next(sets)) if s == "{}" else s for s in skeleton.split("."))


def _first_name(skeleton: str, product: tuple[Runs, ...]) -> str:
    return skeleton.format(*(min(_strings(r)) for r in product))


def fold(items: Iterable[tuple[str, V]]) -> dict[str, V]:
    """Names and values as rows (see the module's docstring), ordered by each row's first
    name in sorted order. Unique names give rows that name each exactly once."""
    groups: dict[tuple[str, V], list[tuple[int, ...]]] = defaultdict(list)
    for name, value in items:
        skeleton, numbers = split_name(name)
        groups[(skeleton, value)].append(numbers)
    rows: list[tuple[str, str, V]] = []
    for (skeleton, value), points in groups.items():
        for product in _factor(points):
            rows.append((_first_name(skeleton, product), _row_text(skeleton, product), value))
    rows.sort(key=lambda r: r[0])
    return {text: value for _, text, value in rows}


def relative_name(name: str, key: str) -> str:
    """``name`` (a module or parameter name a value mentions) written relative to ``key``
    (the table's name it is the value of): each numeric segment equal to ``key``'s segment
    at the same position becomes ``*``, so that values of names that differ only in those
    numbers (every layer's hook) are equal and fold into one row. A literal segment of
    stars gets one more (``*`` is written ``**``). :func:`absolute_name` inverts it."""
    theirs = key.split(".")
    parts = name.split(".")
    for i, segment in enumerate(parts):
        if segment and segment.strip("*") == "":
            parts[i] = segment + "*"
        elif i < len(theirs) and segment == theirs[i] and _is_number(segment):
            parts[i] = "*"
    return ".".join(parts)


def absolute_name(name: str, key: str) -> str:
    """The name :func:`relative_name` wrote relative to ``key``."""
    if "*" not in name:
        return name
    theirs = key.split(".")
    parts = name.split(".")
    for i, segment in enumerate(parts):
        if segment == "*" and i < len(theirs):
            parts[i] = theirs[i]
        elif segment and segment.strip("*") == "":
            parts[i] = segment[1:]
    return ".".join(parts)


# ----------------------------------------------------------------------------- parsing

_PIECE = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[^{}]+|[{}]")
_RUN = re.compile(r"(0|[1-9][0-9]*)(?:\.\.(0|[1-9][0-9]*))?")


def _parse_set(text: str, key: str) -> Runs:
    runs: list[tuple[int, int]] = []
    for part in text.split(","):
        m = _RUN.fullmatch(part)
        if m is None or len(m.group(1)) > MAX_DIGITS or len(m.group(2) or "") > MAX_DIGITS:
            raise TableError(
                f"row {key!r}: {{{text}}} is not a set of numbers such as {{0..7}} or {{0,2,5..9}}"
            )
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) is not None else a
        if b < a or (runs and a <= runs[-1][1]):
            raise TableError(f"row {key!r}: the runs of {{{text}}} are not in increasing order")
        runs.append((a, b))
    return _merge(runs)


def _merge(runs: list[tuple[int, int]]) -> Runs:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a - 1:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


def parse_row(key: str) -> tuple[tuple[str, ...], tuple[Runs, ...]]:
    """A row key's segments (each ``{}`` for a number, else its literal text escaped as in
    a skeleton) and the runs of each number segment. Raises :class:`TableError`."""
    segments: list[list[str | Runs]] = [[]]
    for m in _PIECE.finditer(key):
        token = m.group(0)
        if token in ("{{", "}}"):
            segments[-1].append(token)
        elif m.group(1) is not None:
            segments[-1].append(_parse_set(m.group(1), key))
        elif token in ("{", "}"):
            raise TableError(f"row {key!r} has a lone {token!r} (a literal brace is doubled)")
        else:
            first, *more = token.split(".")
            segments[-1].append(first)
            segments.extend([part] for part in more)
    skeleton: list[str] = []
    sets: list[Runs] = []
    for pieces in segments:
        texts = [p for p in pieces if isinstance(p, str) and p]
        found = [p for p in pieces if not isinstance(p, str)]
        if found:
            if len(found) > 1 or texts:
                raise TableError(f"row {key!r}: a {{...}} set must be a whole segment")
            if len(sets) == MAX_SLOTS:
                raise TableError(f"row {key!r} has more than {MAX_SLOTS} number segments")
            skeleton.append("{}")
            sets.append(found[0])
            continue
        text = "".join(texts)
        plain = _unescape(text)
        if _is_number(plain) and len(sets) < MAX_SLOTS:
            skeleton.append("{}")
            sets.append(((int(plain), int(plain)),))
        else:
            skeleton.append(text)
    return tuple(skeleton), tuple(sets)


def _values(runs: Runs) -> list[int]:
    return [v for a, b in runs for v in range(a, b + 1)]


def _strings(runs: Runs) -> list[str]:
    """A set's numbers as text, in string order (the order names sort in)."""
    return sorted(map(str, _values(runs)))


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class _Row:
    key: str  # as written
    segments: tuple[str, ...]  # skeleton segments
    sets: tuple[Runs, ...]
    value: Hashable

    @property
    def skeleton(self) -> str:
        return ".".join(self.segments)

    def holds(self, numbers: tuple[int, ...]) -> bool:
        for runs, n in zip(self.sets, numbers, strict=True):
            if len(runs) == 1:  # the common case: one run
                if not runs[0][0] <= n <= runs[0][1]:
                    return False
            elif not _holds(runs, n):
                return False
        return True

    def size(self) -> int:
        return math.prod(_count(r) for r in self.sets)

    def items(self) -> Iterator[tuple[str, Hashable]]:
        """Every (name, value) of the row, in sorted name order: within one skeleton names
        sort as their numbers' texts do, since a number segment is followed by a dot or
        the end, both before any digit."""
        template = self.skeleton
        for numbers in itertools.product(*(_strings(r) for r in self.sets)):
            yield template.format(*numbers), self.value


class _Node:
    """The rows of one skeleton that can hold a name, split by the numbers of one segment
    where they are more than :data:`SCAN_ROWS` (built on the first lookup that reaches it).
    The segment chosen is the one whose sets are smallest in all, so a node costs about
    the sum of its rows' sets in that segment, never a name per parameter of a big row."""

    __slots__ = ("children", "rows", "slot", "used")

    def __init__(self, rows: list[_Row], used: frozenset[int] = frozenset()) -> None:
        self.rows = rows
        self.used = used
        self.slot: int | None = None
        self.children: dict[int, _Node] | None = None

    def find(self, numbers: tuple[int, ...]) -> _Row | None:
        node = self
        while len(node.rows) > SCAN_ROWS and len(node.used) < len(numbers):
            if node.children is None:
                node._split(len(numbers))
            assert node.children is not None and node.slot is not None
            child = node.children.get(numbers[node.slot])
            if child is None:
                return None
            node = child
        return next((row for row in node.rows if row.holds(numbers)), None)

    def _split(self, width: int) -> None:
        free = [i for i in range(width) if i not in self.used]
        slot = min(free, key=lambda i: sum(_count(row.sets[i]) for row in self.rows))
        children: dict[int, list[_Row]] = defaultdict(list)
        for row in self.rows:
            for v in _values(row.sets[slot]):
                children[v].append(row)
        used = self.used | {slot}
        self.children = {v: _Node(rows, used) for v, rows in children.items()}
        self.slot = slot


class ParamTable(Mapping[str, V]):
    """Every parameter name of a model -> its value, held as folded rows (module
    docstring). ``rows`` is the table as written; lookups, ``in``, ``len`` and the prefix
    test :meth:`has_module` never expand it, iteration expands it lazily. Values are never
    ``None``."""

    def __init__(self, rows: Mapping[str, V]) -> None:
        parsed = []
        for key, value in rows.items():
            segments, sets = parse_row(key)
            parsed.append(_Row(key, segments, sets, value))
        self._rows: tuple[_Row, ...] = tuple(parsed)
        by_skeleton: dict[str, list[_Row]] = defaultdict(list)
        for row in self._rows:
            by_skeleton[row.skeleton].append(row)
        for same in by_skeleton.values():
            if len(same) > CHECK_ROWS:
                continue
            for x, y in itertools.combinations(same, 2):
                if all(_overlap(a, b) for a, b in zip(x.sets, y.sets, strict=True)):
                    raise TableError(f"rows {x.key!r} and {y.key!r} name the same parameter")
        self._by_skeleton = {k: _Node(rows) for k, rows in by_skeleton.items()}
        # A name's first and last segments, checked before it is parsed: most names looked
        # up in vain (parts of optimizer-state keys) end or start in a segment no row has.
        self._ends = [
            {_unescape(row.segments[i]) for row in self._rows if row.segments[i] != "{}"}
            for i in (0, -1)
        ]
        self._number_ends = [any(row.segments[i] == "{}" for row in self._rows) for i in (0, -1)]
        self._prefixes: dict[str, list[_Row]] | None = None
        self._len: int | None = None
        self._last: tuple[str | None, V | None] = (None, None)  # the last lookup, and its answer

    @classmethod
    def from_names(cls, items: Mapping[str, V] | Iterable[tuple[str, V]]) -> ParamTable[V]:
        """The table of plain names (each its own text, braces included) and their values."""
        pairs = items.items() if isinstance(items, Mapping) else items
        return cls(fold(pairs))

    @property
    def rows(self) -> dict[str, V]:
        """The rows as written: folded name -> value."""
        return {row.key: row.value for row in self._rows}  # type: ignore[misc]

    def _find(self, name: str) -> V | None:
        last = self._last  # the runtime asks for one name several times in a row
        if last[0] == name:
            return last[1]
        value = self._parse_and_find(name)
        self._last = (name, value)
        return value

    def _parse_and_find(self, name: str) -> V | None:
        for end, segment in enumerate((name.partition(".")[0], name.rpartition(".")[2])):
            if segment not in self._ends[end] and not (
                self._number_ends[end] and _is_number(segment)
            ):
                return None
        skeleton, numbers = split_name(name)
        node = self._by_skeleton.get(skeleton)
        row = node.find(numbers) if node is not None else None
        return None if row is None else row.value  # type: ignore[return-value]

    def __getitem__(self, name: str) -> V:
        value = self._find(name) if isinstance(name, str) else None
        if value is None:
            raise KeyError(name)
        return value

    def get(self, name: str, default: V | None = None) -> V | None:  # type: ignore[override]
        value = self._find(name) if isinstance(name, str) else None
        return default if value is None else value

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._find(name) is not None

    def __len__(self) -> int:
        if self._len is None:
            self._len = sum(row.size() for row in self._rows)
        return self._len

    def _items(self) -> Iterator[tuple[str, V]]:
        rows = (row.items() for row in self._rows)
        return heapq.merge(*rows, key=lambda item: item[0])  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._items())

    def items(self) -> ItemsView[str, V]:
        return _Items(self)

    def values(self) -> ValuesView[V]:
        return _Values(self)

    def value_rows(self) -> Iterator[tuple[str, V, int]]:
        """Each row's key, value and number of names, in row order."""
        for row in self._rows:
            yield row.key, row.value, row.size()  # type: ignore[misc]

    def has_module(self, prefix: str) -> bool:
        """Whether some name starts with ``prefix`` and a dot: ``prefix`` is a module
        holding parameters, or a module around such modules."""
        if self._prefixes is None:
            self._prefixes = defaultdict(list)
            for row in self._rows:
                for depth in range(1, len(row.segments)):
                    self._prefixes[".".join(row.segments[:depth])].append(row)
        skeleton, numbers = split_name(prefix)
        return any(
            all(_holds(r, n) for r, n in zip(row.sets, numbers, strict=False))
            for row in self._prefixes.get(skeleton, ())
        )

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ParamTable):
            return self.rows == other.rows or dict(self.items()) == dict(other.items())
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"ParamTable({self.rows!r})"


class _Items(ItemsView[str, V]):
    _mapping: ParamTable[V]

    def __iter__(self) -> Iterator[tuple[str, V]]:
        return self._mapping._items()


class _Values(ValuesView[V]):
    _mapping: ParamTable[V]

    def __iter__(self) -> Iterator[V]:
        return (value for _, value in self._mapping._items())
