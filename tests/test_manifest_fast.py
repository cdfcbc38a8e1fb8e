"""The manifest's fast reader (the standard library's decoder, an :class:`Entry` per entry
as it is read) against the reference (pydantic validating the whole file): on every text,
the fast reader gives what the reference gives, or leaves the text to it. Texts are
generated manifests with entries of every field and type, whole manifests with fields of
every type, and mutations of valid texts (characters changed, inserted, deleted)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardspec.inputs import manifest as M
from shardspec.inputs.manifest import (
    Entry,
    ManifestError,
    _read_fast,
    _read_reference,
    load_manifest,
)
from tests.mutations import mutated

FORMATS = ["shardspec-manifest/1", "shardspec-manifest/2"]
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "param", "buffer", "extra_state", "float32", "bf16", "linear", "é\x00"]),
    st.text(max_size=6),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=6,
)
NAMES = st.one_of(st.sampled_from(["a", "b.0.w", "a", "", "é"]), st.text(max_size=5))
# Each field's values that the file may hold; any other value is drawn now and then.
GOOD: dict[str, Any] = {
    "fqn": NAMES,
    "kind": st.sampled_from(["param", "buffer", "extra_state"]),
    "shape": st.lists(st.integers(-2, 2**40), max_size=3),
    "dtype": st.sampled_from(["float32", "bfloat16", "", "not_a_dtype"]),
    "module": st.sampled_from(["linear", "embedding", None]),
    "class": st.sampled_from(["torch.nn.Linear", None]),
    "forward": st.one_of(st.none(), st.text(max_size=4)),
    "tied_to": st.one_of(st.none(), NAMES),
}
ODD: dict[str, Any] = {
    "shape": st.lists(st.sampled_from([4, 4.0, 4.5, True, "4", None, -1, 2**64]), max_size=3),
    "kind": st.sampled_from(["Param", ""]),
    "cls": VALUES,  # no field of the file
    "extra": VALUES,
}


@st.composite
def entries(draw: st.DrawFn) -> Any:
    keys = draw(st.sets(st.sampled_from(sorted(GOOD)), max_size=7)) | {"fqn"}
    entry = {k: draw(GOOD[k]) for k in sorted(keys)}
    if draw(st.integers(0, 3)) == 3:  # now and then a field of another value or type
        key = draw(st.sampled_from(sorted({*GOOD, *ODD})))
        entry[key] = draw(st.one_of(ODD.get(key, VALUES), VALUES))
    if draw(st.integers(0, 9)) == 9:
        del entry["fqn"]
    return draw(VALUES) if draw(st.integers(0, 19)) == 19 else entry


STATE_DICT = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {
            "hooks": st.dictionaries(st.sampled_from(["", "m"]), st.lists(st.text(max_size=3))),
            "keys": st.lists(
                st.fixed_dictionaries(
                    {"fqn": NAMES, "change": st.sampled_from(["added", "dropped", "x"])},
                    optional={"from": st.lists(NAMES, max_size=2), "shape": GOOD["shape"]},
                ),
                max_size=2,
            ),
        }
    ),
    VALUES,
)


@st.composite
def manifests(draw: st.DrawFn) -> dict[str, Any]:
    good = {
        "format": st.sampled_from(FORMATS),
        "entries": st.lists(entries(), max_size=5),
        "factory": st.one_of(st.none(), st.text(max_size=5)),
        "factory_args": st.dictionaries(st.sampled_from(["ep", "tp", "n"]), SCALARS),
        "state_dict": STATE_DICT,
        "other": VALUES,  # no field of the file
    }
    keys = {"format", "entries"} | draw(
        st.sets(st.sampled_from(["factory", "factory_args", "state_dict"]))
    )
    if draw(st.integers(0, 9)) == 9:
        keys ^= {draw(st.sampled_from(sorted(good)))}
    out = {k: draw(good[k]) for k in sorted(keys)}
    if draw(st.integers(0, 4)) == 4:  # now and then a field of any value or type
        out[draw(st.sampled_from(sorted(good)))] = draw(VALUES)
    return out


def _text(value: Any, draw_indent: int) -> str:
    return json.dumps(value, indent=draw_indent or None, ensure_ascii=bool(draw_indent % 2))


def _same(text: str) -> str:
    """Both readers on ``text``: they agree (or the fast one left the text to the
    reference). Returns which reader read it."""
    fast = _read_fast(text)
    try:
        ref = _read_reference(text, lambda i: (1, 1))
    except ManifestError as e:
        assert fast is None, (text, e)
        return "refused"
    if fast is None:
        return "reference"
    assert _shown(fast) == _shown(ref), text
    return "fast"


def _shown(read: M._Read) -> str:
    """Everything read, with types (``1`` is not ``True`` is not ``1.0``)."""
    args = sorted((k, repr(v), type(v).__name__) for k, v in read.factory_args.items())
    return repr((read.format, read.factory, args, read.entries, read.state_dict))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(manifests(), st.integers(0, 3))
def test_generated_manifests(value: dict[str, Any], indent: int) -> None:
    _same(_text(value, indent))


VALID = json.dumps(
    {
        "format": "shardspec-manifest/2",
        "factory": "m:f",
        "factory_args": {"ep": 2, "x": 0.5, "t": True, "s": "a"},
        "entries": [
            {"fqn": "a.weight", "kind": "param", "shape": [4, 8], "dtype": "float32",
             "module": "linear", "class": "torch.nn.modules.linear.Linear"},
            {"fqn": "b.weight", "shape": [4, 8], "dtype": "float32", "tied_to": "a.weight",
             "forward": "x.Y"},
            {"fqn": "c.buf", "kind": "buffer", "shape": [], "dtype": "int64"},
            {"fqn": "d._extra_state", "kind": "extra_state"},
        ],
        "state_dict": {"hooks": {"": ["state_dict hook"]},
                       "keys": [{"fqn": "c.buf", "change": "dropped"}]},
    },
    indent=1,
)  # fmt: skip
PIECES = ['"', "\\", "\\ud800", "\\ud83d\\ude00", "{", "}", "[", "]", ",", ":", "1", "-",
          ".5", "e9", "true", "null", "NaN", " ", "\x00", '"fqn": "a", ', "é"]  # fmt: skip


@settings(max_examples=600, deadline=None)
@given(mutated(VALID, PIECES, edits=3, cut=3))
def test_mutated_manifests(text: str) -> None:
    _same(text)


def test_the_fast_reader_reads_plain_manifests() -> None:
    """The readers agree above by leaving everything to the reference: the fast one must
    read the manifests shardspec writes."""
    assert _same(VALID) == "fast"
    synthetic = json.dumps(
        {"format": "shardspec-manifest/1", "factory": None, "factory_args": {"ep": 8},
         "entries": [{"fqn": f"l.{i}.w", "kind": "param", "shape": [8, 8], "dtype": "bfloat16"}
                     for i in range(100)]}
    )  # fmt: skip
    assert _same(synthetic) == "fast"
    read = _read_fast(synthetic)
    assert read is not None and read.entries[7] == Entry("l.7.w", "param", (8, 8), "bfloat16")
    assert len({id(e.shape) for e in read.entries}) == 1  # one tuple per distinct shape
    assert len({id(e.dtype) for e in read.entries}) == 1
    for leave in ['"\\ud800"', '"\\uD83D\\uDE00"', "[4.0]", '["4"]', "[true]", "null"]:
        text = VALID.replace('"shape": [\n    4,\n    8\n   ]', f'"shape": {leave}', 1)
        assert text != VALID and _same(text) in ("reference", "refused"), leave


@pytest.mark.parametrize("use_fast", [True, False])
def test_load_manifest_either_way(
    tmp_path: Path, use_fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole load, fast reader or not: the same manifest, the same errors at the same
    places."""
    if not use_fast:
        monkeypatch.setattr(M, "_read_fast", lambda text: None)
    path = tmp_path / "m.json"
    path.write_text(VALID)
    m = load_manifest(path)
    assert [e.fqn for e in m.entries] == ["a.weight", "b.weight", "c.buf", "d._extra_state"]
    assert m.entries[0].cls == "torch.nn.modules.linear.Linear" and m.factory_args["t"] is True
    assert m.state_dict is not None and m.state_dict.keys[0].change == "dropped"
    bad = {
        '"shape": [\n    4,\n    8\n   ]': ("has a negative size", '"shape": [-4, 8]'),
        '"dtype": "int64"': ("which is no torch dtype", '"dtype": "int46"'),
        '"fqn": "b.weight"': ("lists 'a.weight' twice", '"fqn": "a.weight"'),
        '"tied_to": "a.weight"': ("which is no parameter", '"tied_to": "c.buf"'),
    }
    for size in ("true", "4.0", '"4"'):  # sizes are JSON integers: no bool, float or text
        path.write_text(VALID.replace('"shape": [\n    4,', f'"shape": [\n    {size},', 1))
        with pytest.raises(ManifestError, match=r"shape\.0: Input should be a valid integer"):
            load_manifest(path)
    for old, (message, new) in bad.items():
        path.write_text(VALID.replace(old, new, 1))
        with pytest.raises(ManifestError, match=message) as e:
            load_manifest(path)
        assert e.value.line > 1, message
