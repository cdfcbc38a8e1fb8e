"""The folded parameter table (``shardspec.core.paramtable``): rows of names that differ only
in numbers, against a plain dict of the same names (property tests), its row syntax and
errors, and the runtime's use of it: lookups never list the table."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.core.layout import Mesh, RuleSpec
from shardspec.core.paramtable import (
    SCAN_ROWS,
    ParamTable,
    TableError,
    absolute_name,
    fold,
    parse_row,
    relative_name,
    split_name,
)
from shardspec.runtime import CompiledSpec, Param, units


def _prefixes(names: list[str]) -> set[str]:
    return {n[:i] for n in names for i, ch in enumerate(n) if ch == "."}


def _same_as_dict(table: ParamTable, plain: dict[str, object]) -> None:
    """Everything a dict of the names answers, the table answers alike."""
    assert len(table) == len(plain)
    assert list(table) == sorted(plain)  # the manifest's order
    assert list(table.items()) == sorted(plain.items(), key=lambda kv: kv[0])
    assert list(table.values()) == [plain[k] for k in sorted(plain)]
    for name, value in plain.items():
        assert name in table and table[name] == value and table.get(name) == value
    modules = _prefixes(list(plain))
    for name in modules:
        assert table.has_module(name), name
    for name in list(plain)[:50]:
        assert not table.has_module(name) or name in modules


# ----------------------------------------------------------------------------- folding


def test_a_model_folds_into_one_row_per_kind() -> None:
    names: dict[str, object] = {"embed.weight": "E", "norm.weight": "N"}
    for i in range(6):
        names[f"layers.{i}.norm.weight"] = "N"
        if i < 2:
            names[f"layers.{i}.mlp.w1.weight"] = "dense"
            continue
        for e in range(8):
            names[f"layers.{i}.mlp.experts.{e}.w1.weight"] = "expert"
    names["layers.9.norm.weight"] = "N"  # a gap: a second run
    rows = fold(names.items())
    assert rows == {
        "embed.weight": "E",
        "layers.{0..1}.mlp.w1.weight": "dense",
        "layers.{2..5}.mlp.experts.{0..7}.w1.weight": "expert",
        "layers.{0..5,9}.norm.weight": "N",
        "norm.weight": "N",
    }
    _same_as_dict(ParamTable(rows), names)


def test_rows_split_where_values_differ() -> None:
    names = {f"layers.{i}.w": (i % 3 == 0,) for i in range(7)}
    rows = fold(names.items())
    assert rows == {"layers.{0,3,6}.w": (True,), "layers.{1..2,4..5}.w": (False,)}
    _same_as_dict(ParamTable(rows), names)


def test_only_plain_numbers_fold() -> None:
    """``007``, numbers of more than 18 digits and non-ASCII digits stay literal text, so
    that a folded row expands to exactly the names it came from."""
    names = {"a.007.w": 1, "a.7.w": 1, "a.8.w": 1, "b." + "9" * 19 + ".w": 2, "c.\u0661.w": 3}
    rows = fold(names.items())
    assert rows == {
        "a.007.w": 1,
        "a.{7..8}.w": 1,
        "b." + "9" * 19 + ".w": 2,
        "c.\u0661.w": 3,
    }
    _same_as_dict(ParamTable(rows), names)


def test_names_with_many_numbers_fold_their_first_sixteen() -> None:
    """A name of thousands of numeric segments (a hostile manifest) folds in a few levels:
    numbers past the sixteenth stay literal text, for the table and its lookups alike."""
    deep = ["a." + ".".join(str(i) for i in range(k, k + 5000)) for k in (0, 1)]
    names = {deep[0]: 1, deep[1]: 1}
    rows = fold(names.items())
    assert len(rows) == 2 and all(key.count("{") == 0 for key in rows)  # lone numbers
    table = ParamTable(rows)
    _same_as_dict(table, names)
    assert split_name(deep[0])[1] == tuple(range(16))
    with pytest.raises(TableError, match="more than 16 number segments"):
        ParamTable({".".join(["{0..1}"] * 17): 1})


def test_literal_braces_are_doubled() -> None:
    names = {"m.{x}.0.w": 1, "m.{x}.1.w": 1, "{}": 2, "a}{.2": 3}
    rows = fold(names.items())
    assert rows == {"a}}{{.2": 3, "m.{{x}}.{0..1}.w": 1, "{{}}": 2}
    _same_as_dict(ParamTable(rows), names)


def test_split_name() -> None:
    assert split_name("layers.12.experts.0.w") == ("layers.{}.experts.{}.w", (12, 0))
    assert split_name("w{1}.01") == ("w{{1}}.01", ())


segment = st.one_of(
    st.integers(0, 40).map(str),
    st.sampled_from(["layers", "w", "experts", "0", "00", "01", "{", "}", "{}", "", "x{0..1}"]),
    st.text(alphabet="ab1{}_", max_size=4),
)
name = st.lists(segment, min_size=1, max_size=5).map(".".join)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(name, st.integers(0, 2), max_size=60))
def test_any_names_fold_and_read_back_as_the_dict(names: dict[str, int]) -> None:
    rows = fold(names.items())
    table = ParamTable(rows)
    _same_as_dict(table, names)
    assert ParamTable.from_names(names) == table
    assert ParamTable(fold(reversed(list(names.items())))).rows == rows  # order-free


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(name, st.integers(0, 2), max_size=40), st.lists(name, max_size=20))
def test_names_not_in_the_table_are_not_found(names: dict[str, int], others: list[str]) -> None:
    table = ParamTable(fold(names.items()))
    modules = _prefixes(list(names))
    for other in others:
        assert (other in table) == (other in names)
        assert table.get(other) == names.get(other)
        assert table.has_module(other) == (other in modules)
        if other not in names:
            with pytest.raises(KeyError):
                table[other]


@settings(max_examples=100, deadline=None)
@given(st.sets(st.tuples(st.integers(0, 12), st.integers(0, 12)), min_size=1, max_size=80))
def test_number_pairs_fold_exactly(points: set[tuple[int, int]]) -> None:
    """Any set of (layer, expert) numbers, gaps and ragged edges included, folds into rows
    that name each name once (the rows do not overlap: the table would refuse them)."""
    names = {f"layers.{i}.experts.{e}.w": 0 for i, e in points}
    table = ParamTable(fold(names.items()))
    _same_as_dict(table, names)
    assert sum(n for _, _, n in table.value_rows()) == len(names)


def _index_entries(table: ParamTable) -> int:
    """How many numbers the lookup trees of a table hold, over every node built so far."""
    todo, count = list(table._by_skeleton.values()), 0
    while todo:
        node = todo.pop()
        count += len(node.children or {})
        todo.extend((node.children or {}).values())
    return count


@pytest.mark.parametrize(
    "value",
    [
        lambda i, e: (i,),  # a shape per layer: a row per layer
        lambda i, e: (e,),  # a shape per expert: a row per expert
        lambda i, e: (i * e % 5,),  # ragged: many rows, neither segment alone tells them
    ],
)
def test_many_rows_of_one_kind_are_split_by_a_segment(value) -> None:
    """Past SCAN_ROWS rows of one kind a lookup goes down a tree split by one segment's
    numbers at a time, not through every row."""
    names = {
        f"layers.{i}.experts.{e}.w": value(i, e)
        for i in range(3 * SCAN_ROWS)
        for e in range(2 * SCAN_ROWS)
    }
    table = ParamTable(fold(names.items()))
    assert len(table.rows) > SCAN_ROWS
    _same_as_dict(table, names)
    for other in ("layers.99.experts.0.w", "layers.0.experts.99.w", "layers.0.experts.w"):
        assert other not in table


def test_big_rows_of_one_kind_are_split_by_their_small_segment() -> None:
    """Twenty experts of a million layers, each expert its own shape: the lookup splits by
    expert (20 numbers), never by layer (20 million)."""
    rows = {f"layers.{{0..999999}}.experts.{e}.w": (e,) for e in range(20)}
    table = ParamTable(rows)
    assert table["layers.123456.experts.7.w"] == (7,) and "layers.5.experts.20.w" not in table
    assert _index_entries(table) == 20


# ----------------------------------------------------------------------------- rows


def test_row_syntax() -> None:
    assert parse_row("layers.{0..3,5}.experts.{7}.w") == (
        ("layers", "{}", "experts", "{}", "w"),
        (((0, 3), (5, 5)), ((7, 7),)),
    )
    assert parse_row("layers.3.w") == (("layers", "{}", "w"), (((3, 3),),))
    assert parse_row("a.{{0}}.b") == (("a", "{{0}}", "b"), ())
    table = ParamTable({"layers.{0..1,2}.w": 1})  # adjacent runs are one
    assert list(table) == ["layers.0.w", "layers.1.w", "layers.2.w"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ({"a.{0..3": 1}, "lone '{'"),
        ({"a.}": 1}, "lone '}'"),
        ({"a.{x}.w": 1}, "not a set of numbers"),
        ({"a.{1..}.w": 1}, "not a set of numbers"),
        ({"a.{01}.w": 1}, "not a set of numbers"),
        ({"a.{" + "1" * 19 + "}.w": 1}, "not a set of numbers"),
        ({"a.{3..1}.w": 1}, "not in increasing order"),
        ({"a.{5,2}.w": 1}, "not in increasing order"),
        ({"a.w{0..3}.w": 1}, "whole segment"),
        ({"a.{0..3}{4}.w": 1}, "whole segment"),
        ({"a.{0..3}.w": 1, "a.{3..5}.w": 2}, "name the same parameter"),
        ({"a.{0..3}.w": 1, "a.2.w": 1}, "name the same parameter"),
    ],
)
def test_malformed_rows_are_refused(rows: dict[str, int], message: str) -> None:
    with pytest.raises(TableError, match=message):
        ParamTable(rows)


def test_a_huge_table_is_never_expanded() -> None:
    """A trillion names in one row: length, lookups and module tests answer at once."""
    table = ParamTable({"layers.{0..999999}.experts.{0..999999}.w": 1, "norm.w": 2})
    assert len(table) == 10**12 + 1
    assert table["layers.123456.experts.999999.w"] == 1
    assert "layers.1000000.experts.0.w" not in table
    assert table.has_module("layers.5.experts") and table.has_module("layers.5.experts.17")
    assert not table.has_module("layers.5.experts.1000000")
    assert next(iter(table)) == "layers.0.experts.0.w"  # iteration is lazy too


# ----------------------------------------------------------------------------- the runtime


class _Unlisted(ParamTable):
    """A table that fails the test if anything lists it (every name, one by one)."""

    def _items(self) -> Iterator[tuple[str, object]]:  # type: ignore[override]
        raise AssertionError("the runtime listed the whole parameter table")


def _big_spec() -> CompiledSpec:
    rows = {
        "layers.{0..99999}.experts.{0..9999}.w": Param(0, (8, 4), "float32"),
        "norm.weight": Param(1, (4,), "float32"),
    }
    rules = (
        RuleSpec(pattern="layers.*.experts.*.w", dims=("a", "b"), shard=(("a", ("dp",)),)),
        RuleSpec(pattern="norm.weight", dims=("h",)),
    )
    return CompiledSpec(
        name="big",
        axes=("dp",),
        sizes={"dp": 2},
        world=2,
        rules=rules,
        params=_Unlisted(rows),
    )


def test_save_and_load_plans_look_names_up_without_listing_the_table() -> None:
    """Before, every plan built a set of every name (``Names``) and every module
    (``CompiledSpec.modules``): O(parameters) per call, a billion here."""
    spec = _big_spec()
    assert len(spec.params or ()) == 10**9 + 1
    mesh = Mesh(("dp",), (2,))
    flat = {
        "layers.7.experts.3.w": torch.empty(8, 4, device="meta"),
        "norm.weight": torch.empty(4, device="meta"),
        "layers.7.experts.3.scale": torch.empty(2, device="meta"),  # in a module: uncovered
        "step": torch.zeros(()),  # the caller's own: not the model's
    }
    units.clear_plan_cache()
    for saving in (True, False):
        plan, _, local = units.canonical_plan(spec, mesh, 1, flat, saving=saving)
        assert set(local) == {"layers.7.experts.3.w", "norm.weight"}
        assert plan.uncovered == (
            "layers.7.experts.3.scale (no parameter, no buffer of the manifest, no ignore)",
        )
    layout = spec.layout("layers.99999.experts.9999.w", mesh)
    assert [d.size for d in layout.dims] == [8, 4]
    assert spec.is_module("layers.99999.experts") and not spec.is_module("layers.100000")
    assert spec.style_of("norm.weight") == {}


def test_a_plain_mapping_is_folded_into_a_table() -> None:
    params = {f"layers.{i}.w": Param(0, (4,), "float32") for i in range(3)}
    spec = CompiledSpec(
        name="s",
        axes=("dp",),
        sizes={"dp": 1},
        world=1,
        rules=(RuleSpec(pattern="layers.*.w", dims=("h",)),),
        params=params,
    )
    assert isinstance(spec.params, ParamTable)
    assert spec.params.rows == {"layers.{0..2}.w": Param(0, (4,), "float32")}
    assert dict(spec.params.items()) == params


def test_rows_of_every_kind_expand_to_their_names() -> None:
    """``value_rows`` counts, per row, the names ``items`` yields for it."""
    rows = {"a.{0..2}.b.{4,6}.w": 1, "a.9.w": 2, "c": 3}
    table = ParamTable(rows)
    assert [(k, v, n) for k, v, n in table.value_rows()] == [
        ("a.{0..2}.b.{4,6}.w", 1, 6),
        ("a.9.w", 2, 1),
        ("c", 3, 1),
    ]
    expected = [f"a.{i}.b.{e}.w" for i, e in itertools.product(range(3), (4, 6))]
    assert sorted([*expected, "a.9.w", "c"]) == list(table)


# ------------------------------------------------------------ names relative to their key

star_segment = st.one_of(segment, st.sampled_from(["*", "**", "0", "1", "12"]))
star_name = st.lists(star_segment, min_size=1, max_size=5).map(".".join)


@settings(max_examples=300, deadline=None)
@given(star_name, star_name)
def test_a_name_relative_to_a_key_reads_back(name: str, key: str) -> None:
    assert absolute_name(relative_name(name, key), key) == name


def test_every_layers_hook_shares_one_row() -> None:
    """A hook key's module and sources, written relative to the key, are the same for
    every layer: HOOK_KEYS folds into one row per key kind, and reads back whole."""
    from shardspec.runtime.spec import Hook, HookKeys

    keys = {
        f"layers.{i}.attention.w{p}.weight": (
            f"layers.{i}.attention",
            (f"layers.{i}.attention.qkv_linear.wqkv.weight", "layers.0.shared.weight"),
        )
        for i in range(40)
        for p in "qkv"
    }
    keys["model_only"] = ("", ("tok.weight",))  # the model's own state_dict() hook
    hooks = HookKeys(keys)
    # One row per kind for layers 1-39; layer 0's own (its shared source is "its layer"
    # there); the model's.
    assert len(hooks.table.rows) == 3 + 3 + 1
    assert hooks.table["layers.7.attention.wk.weight"] == Hook(
        "layers.*.attention",
        ("layers.*.attention.qkv_linear.wqkv.weight", "layers.0.shared.weight"),
    )
    assert dict(hooks.items()) == keys
    assert "layers.40.attention.wq.weight" not in hooks
    assert HookKeys(hooks.table) == hooks == keys
