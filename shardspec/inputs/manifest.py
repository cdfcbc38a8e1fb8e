"""The model manifest: every parameter, persistent buffer and extra state of a model, with
shapes and dtypes, read without torch.

``shardspec manifest pkg.module:factory`` writes one (see :mod:`shardspec.inputs.manifest_build`);
lint and compile read it here. The format::

    {
      "format": "shardspec-manifest/2",
      "factory": "examples.models.llama:tiny",
      "factory_args": {"ep": 2},
      "entries": [
        {"fqn": "tok_embeddings.weight", "kind": "param", "shape": [256, 64], "dtype": "float32",
         "module": "embedding", "class": "torch.nn.modules.sparse.Embedding"},
        {"fqn": "output.weight", "kind": "param", "shape": [256, 64], "dtype": "float32",
         "module": "linear", "class": "torch.nn.modules.linear.Linear",
         "tied_to": "tok_embeddings.weight"},
        {"fqn": "layers.0.attn.fp8_meta._extra_state", "kind": "extra_state"}
      ],
      "state_dict": {
        "hooks": {"layers.0.attention": ["state_dict hook", "load_state_dict pre-hook"]},
        "keys": [
          {"fqn": "layers.0.attention.qkv_linear.wqkv.weight", "change": "dropped", ...},
          {"fqn": "layers.0.attention.wq.weight", "change": "added", "module":
           "layers.0.attention", "from": ["layers.0.attention.qkv_linear.wqkv.weight"],
           "shape": [64, 64], "dtype": "float32"}
        ]
      }
    }

Format 2 lists the entries as the model holds them (``named_parameters()``, persistent
buffers, modules with extra state), whatever its state-dict hooks do; the optional
``state_dict`` section records what ``state_dict()`` shows differently (keys that hooks add
in place of parameters, drop or reshape) and the modules whose hooks do it. Format 1 (read
as before) listed ``state_dict()``'s keys, so a key a hook wrote looked like a buffer.

``factory_args`` named after a mesh axis record the size the model's local shards were
built for; lint checks them against the mesh (``SS013``).

A parameter's entry may also record (format 2; manifests without these fields read as
before, and the checks that need them do not run): ``class``, the qualified name of the
module class holding it; ``forward``, the class whose ``forward`` that module runs where
it inherits it (absent: its own class's); ``tied_to``, for a parameter that is the same
tensor as an earlier name of ``named_parameters(remove_duplicate=False)`` (a tied
embedding and head), that name. ``dtype`` is a torch dtype's name (``float32``), or empty
where unknown.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from shardspec.core.jsontext import JSONTextError, loads
from shardspec.findings.suggest import closest
from shardspec.frontend.textfile import JSON_STRING, positions, read_text

FORMAT = "shardspec-manifest/2"
FORMATS = ("shardspec-manifest/1", FORMAT)  # what load_manifest reads
# torch's dtype names (``str(dtype)`` without ``torch.``), as of torch 2.13: the compiler
# does not import torch (tests/test_manifest_build.py keeps the table in step with torch).
TORCH_DTYPES = frozenset(
    """bfloat16 bits16 bits1x8 bits2x4 bits4x2 bits8 bool complex128 complex32 complex64
    float16 float32 float4_e2m1fn_x2 float64 float8_e4m3fn float8_e4m3fnuz float8_e5m2
    float8_e5m2fnuz float8_e8m0fnu int1 int16 int2 int3 int32 int4 int5 int6 int64 int7 int8
    qint32 qint8 quint2x4 quint4x2 quint8 uint1 uint16 uint2 uint3 uint32 uint4 uint5 uint6
    uint64 uint7 uint8""".split()
)
# torch's other names of those dtypes (``torch.float`` is float32): a hint, never accepted.
DTYPE_ALIASES = {
    "short": "int16",
    "int": "int32",
    "long": "int64",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "chalf": "complex32",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "bit": "uint1",
}
_FQN = re.compile(r'"fqn":\s*(' + JSON_STRING + ")")


class Entry(NamedTuple):
    """A parameter, persistent buffer or extra state of the model. A named tuple: a
    manifest of a million entries holds 104 bytes an entry and builds each at C speed (a
    pydantic model held 700 bytes, a slotted pydantic dataclass 170 and took microseconds
    to validate). What a manifest's JSON may say for one is :class:`_EntryModel`."""

    fqn: str
    kind: Literal["param", "buffer", "extra_state"] = "param"
    shape: tuple[int, ...] = ()
    dtype: str = ""
    # The kind of module that holds a parameter: "linear", "embedding" or the class name.
    module: str | None = None
    # Its module's class (qualified name; "class" in the file), and the class whose
    # forward it runs where that is a base class's (None: its own, or an older manifest
    # without classes).
    cls: str | None = None
    forward: str | None = None
    tied_to: str | None = None  # the first name of the same tensor (a tied parameter)

    @property
    def forward_class(self) -> str | None:
        """The class whose forward the parameter's module runs (None: not recorded)."""
        return self.forward or self.cls


@pydantic_dataclass(frozen=True, slots=True, config=ConfigDict(extra="forbid"))
class _EntryModel:
    """An entry as the file's JSON may write it: the reference that pydantic validates,
    and words for what is wrong (the fast reader, :func:`_read_fast`, leaves any entry it
    does not read to it)."""

    fqn: str
    kind: Literal["param", "buffer", "extra_state"] = "param"
    shape: tuple[StrictInt, ...] = ()
    dtype: str = ""
    module: str | None = None
    cls: str | None = Field(default=None, validation_alias="class")
    forward: str | None = None
    tied_to: str | None = None


class StateDictKey(BaseModel):
    """A key ``state_dict()`` shows differently from the model's own entries: ``added`` (a
    key no entry has, written in place of the ``from`` entries), ``dropped`` (an entry
    ``state_dict()`` lacks) or ``reshaped`` (another shape or dtype there)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    fqn: str
    change: Literal["added", "dropped", "reshaped"]
    module: str = ""  # the module whose hooks (or overridden methods) do it; "" the model
    from_: tuple[str, ...] = Field((), alias="from")
    shape: tuple[StrictInt, ...] | None = None  # as state_dict() has it (None: not a tensor)
    dtype: str = ""


class StateDict(BaseModel):
    """What the model's state-dict hooks change (the manifest's ``state_dict`` section)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # module name ("" for the model) -> its hooks and overridden state-dict methods
    hooks: dict[str, tuple[str, ...]] = {}
    keys: tuple[StateDictKey, ...] = ()
    error: str | None = None  # why state_dict() could not be compared (it raised)

    def added(self) -> list[StateDictKey]:
        """The keys only ``state_dict()`` has."""
        return [k for k in self.keys if k.change == "added"]


class ManifestFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    format: Literal["shardspec-manifest/1", "shardspec-manifest/2"]
    factory: str | None = None
    factory_args: dict[str, int | float | str | bool] = {}
    entries: list[_EntryModel]
    state_dict: StateDict | None = None

    @field_validator("factory_args")
    @classmethod
    def _finite(cls, args: dict[str, int | float | str | bool]) -> dict:
        bad = [k for k, v in args.items() if isinstance(v, float) and not math.isfinite(v)]
        if bad:
            raise ValueError(
                f"factory argument {bad[0]!r} is {args[bad[0]]}: arguments must be finite "
                "numbers, text or true/false"
            )
        return args


@dataclass(frozen=True)
class Manifest:
    path: str
    factory: str | None
    factory_args: dict[str, int | float | str | bool]
    entries: tuple[Entry, ...]
    format: str = FORMAT
    state_dict: StateDict | None = None  # format 2, where state-dict hooks change keys
    read_as: tuple[int, int] | None = None  # the file's (size, mtime_ns) when it was read

    @cached_property
    def text(self) -> str:
        """The file's text, for findings' places and source lines: read again when first
        asked for (lint does not hold a large manifest's text beside its entries), and
        empty where the file is no longer the one that was read (findings then point at
        its first line)."""
        try:
            st = os.stat(self.path)
            if self.read_as is None or (st.st_size, st.st_mtime_ns) != self.read_as:
                return ""
            return read_text(self.path)
        except (OSError, UnicodeDecodeError):
            return ""

    @cached_property
    def _positions(self) -> dict[str, tuple[int, int]]:
        return positions(self.text, _FQN)

    def position(self, fqn: str) -> tuple[int, int]:
        """(line, col) of an entry's name in the manifest file, for diagnostics."""
        return self._positions.get(fqn, (1, 1))

    @property
    def params(self) -> list[Entry]:
        return [e for e in self.entries if e.kind == "param"]

    @property
    def from_state_dict(self) -> bool:
        """Whether the entries are ``state_dict()``'s keys (format 1), which state-dict
        hooks may have renamed, rather than the model's own parameters and buffers."""
        return self.format == "shardspec-manifest/1"


class ManifestError(ValueError):
    """Why a manifest could not be read; ``line`` is 1-based where known."""

    def __init__(self, message: str, line: int = 1, col: int = 1) -> None:
        super().__init__(message)
        self.line, self.col = line, col


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate a manifest. Raises :class:`ManifestError` (with the line of the
    offending entry where it can be told) when it cannot be read or is malformed."""
    p = Path(path)
    try:
        text = read_text(p)  # tolerate a byte order mark
        st = os.stat(p)
    except (OSError, UnicodeDecodeError) as e:
        raise ManifestError(
            f"cannot read manifest {str(p)!r}: {getattr(e, 'strerror', None) or e}"
        ) from None
    read_as = (st.st_size, st.st_mtime_ns)

    def at(i: int) -> tuple[int, int]:
        # Positions are only needed for an error message: scan the text only then.
        starts = entry_positions(text)
        return starts[i] if i < len(starts) else (1, 1)

    mf = _read_fast(text) or _read_reference(text, at)
    seen: set[str] = set()
    for i, entry in enumerate(mf.entries):
        if entry.fqn in seen:
            raise ManifestError(f"manifest lists {entry.fqn!r} twice", *at(i))
        seen.add(entry.fqn)
        if entry.kind != "extra_state" and any(s < 0 for s in entry.shape):
            raise ManifestError(f"manifest entry {entry.fqn!r} has a negative size", *at(i))
        if entry.dtype and entry.dtype not in TORCH_DTYPES:
            raise ManifestError(bad_dtype(f"manifest entry {entry.fqn!r}", entry.dtype), *at(i))
    _check_ties(mf, at)
    if mf.state_dict is not None:
        _check_state_dict(mf, text, seen)
    return Manifest(
        str(path),
        mf.factory,
        dict(mf.factory_args),
        tuple(mf.entries),
        mf.format,
        mf.state_dict,
        read_as,
    )


class _Read(NamedTuple):
    """A manifest file's fields, read (by either reader) but not yet checked as a whole."""

    format: str
    factory: str | None
    factory_args: dict[str, int | float | str | bool]
    entries: list[Entry]
    state_dict: StateDict | None


_TOP_KEYS = frozenset(ManifestFile.model_fields)
_ENTRY_KEYS = frozenset(("fqn", "kind", "shape", "dtype", "module", "class", "forward", "tied_to"))
_KINDS = {"param": "param", "buffer": "buffer", "extra_state": "extra_state"}


def _read_fast(text: str) -> _Read | None:
    """The manifest read by the standard library's JSON decoder, each entry turned into an
    :class:`Entry` as soon as it is read (``object_hook``: no dict per entry outlives it),
    its shape and names shared with every entry like it. It reads what :func:`_read_reference`
    accepts, to the same values; anything else (an entry not in plain form, a field of
    another type, JSON that only one of the two parsers accepts) is None, for the
    reference to read or explain (tests/test_manifest_fast.py holds the two together)."""
    if "\\ud" in text or "\\uD" in text:  # json reads a lone surrogate; pydantic does not
        return None
    shared: dict[object, object] = {}
    share = shared.setdefault

    def entry(d: dict) -> object:
        if "fqn" not in d or not d.keys() <= _ENTRY_KEYS:
            return d
        fqn, kind = d["fqn"], d.get("kind", "param")
        shape, dtype = d.get("shape", ()), d.get("dtype", "")
        module, cls = d.get("module"), d.get("class")
        forward, tied_to = d.get("forward"), d.get("tied_to")
        if (
            type(fqn) is not str
            or type(kind) is not str
            or kind not in _KINDS
            or type(dtype) is not str
            or (module is not None and type(module) is not str)
            or (cls is not None and type(cls) is not str)
            or (forward is not None and type(forward) is not str)
            or (tied_to is not None and type(tied_to) is not str)
        ):
            return d
        if shape != ():
            if type(shape) is not list:
                return d
            for size in shape:
                if type(size) is not int:
                    return d
            shape = tuple(shape)
        return Entry(
            fqn, _KINDS[kind], share(shape, shape), share(dtype, dtype),  # type: ignore[arg-type]
            share(module, module), share(cls, cls), share(forward, forward), tied_to,  # type: ignore[arg-type]
        )  # fmt: skip

    try:
        raw = json.loads(text, object_hook=entry)
    except (ValueError, RecursionError):
        return None
    if type(raw) is not dict or not raw.keys() <= _TOP_KEYS:
        return None
    entries = raw.pop("entries", None)
    if type(entries) is not list or any(type(e) is not Entry for e in entries):
        return None
    try:  # the few other fields, as the reference reads them
        head = ManifestFile.model_validate_json(json.dumps({**raw, "entries": []}))
    except (ValidationError, ValueError, TypeError):
        return None
    return _Read(head.format, head.factory, head.factory_args, entries, head.state_dict)


def _read_reference(text: str, at: Callable[[int], tuple[int, int]]) -> _Read:
    """The manifest as pydantic validates it, or the :class:`ManifestError` that says
    what is wrong first (at the entry's place where it is in an entry)."""
    try:
        mf = ManifestFile.model_validate_json(text)
    except ValidationError as e:
        if any(err["type"] == "json_invalid" for err in e.errors()):
            _raise_json_error(text)
        first = e.errors()[0]
        loc = first["loc"]
        where = ".".join(str(x) for x in loc)
        line, col = (1, 1)
        if len(loc) >= 2 and loc[0] == "entries" and isinstance(loc[1], int):
            line, col = at(loc[1])
        msg = f"manifest field {where or '(root)'}: {first['msg']}"
        raise ManifestError(msg, line, col) from None
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    entries = [
        Entry(
            e.fqn,
            e.kind,
            shapes.setdefault(e.shape, e.shape),  # one tuple per distinct shape
            e.dtype,
            e.module,
            e.cls,
            e.forward,
            e.tied_to,
        )
        for e in mf.entries
    ]
    return _Read(mf.format, mf.factory, mf.factory_args, entries, mf.state_dict)


def bad_dtype(what: str, dtype: str) -> str:
    """The message for ``what`` (an entry) whose dtype is no torch dtype's name."""
    short = len(dtype) <= 40  # quote and compare a name, not a megabyte
    name = dtype.removeprefix("torch.")
    near = DTYPE_ALIASES.get(name) or (closest(name, sorted(TORCH_DTYPES)) if short else None)
    say = f"; did you mean {near!r}?" if near else " (torch's names: float32, bfloat16, int64, ...)"
    shown = repr(dtype) if short else f"{dtype[:40]!r}... ({len(dtype)} characters)"
    return f"{what} has dtype {shown}, which is no torch dtype{say}"


def _check_ties(mf: _Read, at: Callable[[int], tuple[int, int]]) -> None:
    """``tied_to`` names an earlier parameter entry that is no alias itself, of the same
    shape and dtype, and only a parameter is tied."""
    tied = [i for i, e in enumerate(mf.entries) if e.tied_to is not None]
    if not tied:
        return  # (no index of a million names)
    index = {e.fqn: i for i, e in enumerate(mf.entries)}
    for i in tied:
        entry = mf.entries[i]
        assert entry.tied_to is not None
        source = mf.entries[index[entry.tied_to]] if entry.tied_to in index else None
        what = f"manifest entry {entry.fqn!r} is tied to {entry.tied_to!r}"
        if entry.kind != "param":
            problem = f"manifest entry {entry.fqn!r} is a {entry.kind}: only parameters are tied"
        elif source is None or source.kind != "param":
            problem = f"{what}, which is no parameter of the manifest"
        elif source.fqn == entry.fqn or source.tied_to is not None:
            problem = f"{what}, which is no first name of a tensor (it is tied itself)"
        elif (source.shape, source.dtype) != (entry.shape, entry.dtype):
            problem = f"{what}, whose shape or dtype differs"
        else:
            continue
        raise ManifestError(problem, *at(i))


def _check_state_dict(mf: _Read, text: str, entries: set[str]) -> None:
    """The ``state_dict`` section agrees with the entries: an added key is no entry, a
    dropped or reshaped one (and every ``from``) is; no key is listed twice."""
    assert mf.state_dict is not None
    if mf.format != FORMAT:
        raise ManifestError(f"manifest field state_dict: a {FORMAT} manifest's section")

    def fail(message: str, fqn: str) -> None:  # at the name's first "fqn" in the text
        line, col = positions(text, _FQN, whole=True).get(fqn, (1, 1))
        raise ManifestError(f"manifest field state_dict: {message}", line, col)

    seen: set[str] = set()
    for key in mf.state_dict.keys:
        if key.fqn in seen:
            fail(f"key {key.fqn!r} is listed twice", key.fqn)
        seen.add(key.fqn)
        if key.change == "added" and key.fqn in entries:
            fail(f"added key {key.fqn!r} is also an entry", key.fqn)
        if key.change != "added" and key.fqn not in entries:
            fail(f"{key.change} key {key.fqn!r} is no entry", key.fqn)
        unknown = [f for f in key.from_ if f not in entries]
        if unknown:
            fail(f"key {key.fqn!r} is from {unknown[0]!r}, which is no entry", key.fqn)
        if key.shape is not None and any(s < 0 for s in key.shape):
            fail(f"key {key.fqn!r} has a negative size", key.fqn)
        if key.dtype and key.dtype not in TORCH_DTYPES:
            fail(bad_dtype(f"key {key.fqn!r}", key.dtype), key.fqn)


def _raise_json_error(text: str) -> None:
    """Re-parse invalid JSON with the standard library, for its line and column."""
    try:
        loads(text)
    except JSONTextError as e:
        raise ManifestError(f"manifest is not valid JSON: {e.reason}", e.line, e.col) from None
    raise ManifestError("manifest is not valid JSON")


def entry_positions(text: str) -> list[tuple[int, int]]:
    """(line, col) of each element of the top-level ``"entries"`` list (the ``{`` of an
    entry), in order, for JSON text that is known to parse (json's last ``"entries"``,
    where there are two). See :func:`_entry_offsets`; lines are counted at C speed."""
    out: list[tuple[int, int]] = []
    line, counted = 1, 0
    for at in _entry_offsets(text):
        line += text.count("\n", counted, at)
        counted = at
        out.append((line, at - text.rfind("\n", 0, at)))
    return out


_DECODER = json.JSONDecoder()
_BLANK = re.compile(r"[ \t\n\r]*")


def _past_blanks(text: str, i: int) -> int:
    """The offset of the first character at or after ``i`` that is no JSON white space."""
    m = _BLANK.match(text, i)
    return m.end() if m else i


def _entry_offsets(text: str) -> list[int]:
    """The offset of each element of the top-level object's ``"entries"`` list. Only the
    top level is walked in Python, a key and a value at a time; each value (and each entry)
    is skipped by the standard library's decoder. Text that is not JSON gives the offsets
    found before the walk lost its way."""
    skip, decode = _past_blanks, _DECODER.raw_decode
    found: list[int] = []
    try:
        i = skip(text, 0)
        if text[i] != "{":
            return []
        i = skip(text, i + 1)
        while text[i] == '"':
            key, i = decode(text, i)
            i = skip(text, skip(text, i) + 1)  # past the ':'
            if key == "entries" and text[i] == "[":
                found = []  # the last of two wins, as in json.loads
                i = skip(text, i + 1)
                while text[i] != "]":
                    found.append(i)
                    _, i = decode(text, i)
                    i = skip(text, i)
                    if text[i] == ",":
                        i = skip(text, i + 1)
                i += 1
            else:
                _, i = decode(text, i)
            i = skip(text, i)
            if text[i] == ",":
                i = skip(text, i + 1)
    except (ValueError, IndexError, RecursionError):
        pass
    return found


def dump_manifest(
    entries: list[dict],
    factory: str | None,
    factory_args: dict | None = None,
    state_dict: dict | None = None,
) -> str:
    """The canonical JSON text of a manifest: one entry per line, sorted, stable; then the
    ``state_dict`` section (when given), one hook module and one key per line."""
    ordered = sorted(entries, key=lambda e: e["fqn"])
    lines = [json.dumps(e, separators=(", ", ": ")) for e in ordered]
    head = {"format": FORMAT, "factory": factory, "factory_args": factory_args or {}}
    body = ",\n    ".join(lines)
    inner = json.dumps(head)[1:-1]
    out = "{" + inner + ',\n  "entries": [\n    ' + body + "\n  ]"
    if state_dict is not None:
        out += ',\n  "state_dict": {' + _dump_state_dict(state_dict) + "\n  }"
    return out + "\n}\n"


def _dump_state_dict(section: dict) -> str:
    parts = []
    hooks = section.get("hooks", {})
    rows = [f"{json.dumps(m)}: {json.dumps(list(k))}" for m, k in sorted(hooks.items())]
    parts.append('\n    "hooks": {' + _rows(rows, "}"))
    keys = sorted(section.get("keys", []), key=lambda k: (k["fqn"], k["change"]))
    rows = [json.dumps(k, separators=(", ", ": ")) for k in keys]
    parts.append('\n    "keys": [' + _rows(rows, "]"))
    if section.get("error") is not None:
        parts.append(f'\n    "error": {json.dumps(section["error"])}')
    return ",".join(parts)


def _rows(rows: list[str], close: str) -> str:
    if not rows:
        return close
    return "\n      " + ",\n      ".join(rows) + "\n    " + close
