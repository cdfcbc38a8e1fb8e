"""The trust boundary of DCP checkpoints, and readers that keep to it.

What loading a checkpoint with DCP's ``FileSystemReader`` trusts:

* ``.metadata`` is a pickle, and ``FileSystemReader.read_metadata`` loads it with
  ``pickle.load``: a crafted one runs any code it names, before a byte of data is read.
* Entries that are not tensors (an optimizer's ``param_groups``, a step count kept as a
  number) are stored as ``torch.save`` records, and DCP's and shardspec's load planners
  unpickle them with ``torch.load(weights_only=False)``: the same, from a data file.
* Tensor chunks are read with ``torch.load(weights_only=True)``, torch's allowlisting
  unpickler; shardspec's ``.shardspec.json`` is JSON.

:class:`SafeMetadata` is a mixin for DCP readers that keeps to a boundary instead:
``read_metadata`` unpickles ``.metadata`` with an allowlisting unpickler that builds only
DCP's own metadata classes (``Metadata``, ``TensorStorageMetadata``, ``BytesStorageMetadata``,
``ChunkStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``,
``_StorageInfo``; ``torch.Size``, dtypes, layouts and memory formats; ``pathlib`` paths;
builtin containers and scalars) and refuses anything else with a :class:`CheckpointError`
naming the offending global, without calling it. It then checks the result's structure
(:mod:`~shardspec.runtime.checkpoint.metadata`); that every data file named in it is a
plain file name inside the checkpoint folder, every reader of shardspec checks, trusted or
not (:class:`~shardspec.runtime.checkpoint.integrity.MetadataChecks`). Pickled
entries are checked with torch's ``weights_only`` unpickler before the planner unpickles
them (objects of other classes are refused; ``torch.serialization.add_safe_globals``
admits more).

:class:`SafeFileSystemReader` is DCP's ``FileSystemReader`` with it, and
:class:`SafeChecksumReader` adds the checksums of :mod:`shardspec.runtime.checkpoint.integrity`::

    load(spec, state, path, storage_reader=SafeChecksumReader(path))

Checksums are not a security measure: whoever can write the data files can write the
metadata, checksums included.
"""

from __future__ import annotations

import collections
import io
import os
import pathlib
import pickle
import re
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader

from shardspec.runtime.checkpoint.integrity import ChecksumReader, MetadataChecks
from shardspec.runtime.checkpoint.metadata import _short, _show, _structure_problem
from shardspec.runtime.units import CheckpointError

__all__ = [
    "SafeChecksumReader",
    "SafeFileSystemReader",
    "SafeMetadata",
    "_structure_problem",
    "load_metadata",
    "loads_metadata",
]

_METADATA_CLASSES = (
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
)


class _Layout:
    """What the unpickler gives for ``torch.serialization._get_layout`` (how torch pickles
    a layout): a lookup of torch's layouts by name that holds no state a pickle could
    change (torch's own function keeps a cache in an attribute)."""

    __slots__ = ()

    def __call__(self, name: Any) -> torch.layout:
        for value in vars(torch).values():
            if isinstance(value, torch.layout) and str(value) == name:
                return value
        raise CheckpointError(f"unknown torch layout {_show(name)}")


_LAYOUT = _Layout()


def _tables() -> tuple[dict[tuple[str, str], Any], frozenset[type]]:
    """Globals the metadata unpickler resolves, and the classes whose instances it may
    fill (``BUILD``)."""
    from torch.distributed.checkpoint import filesystem, metadata

    table: dict[tuple[str, str], Any] = {}
    fill: set[type] = set()
    for name in (*_METADATA_CLASSES, "_MEM_FORMAT_ENCODING"):
        cls = getattr(metadata, name, None)
        if cls is not None:
            table[("torch.distributed.checkpoint.metadata", name)] = cls
            if name != "_MEM_FORMAT_ENCODING":
                fill.add(cls)
    table[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = filesystem._StorageInfo
    fill.add(filesystem._StorageInfo)
    sharded: Any
    try:  # where TensorProperties lived before DCP had its own (torch 2.0 checkpoints)
        from torch.distributed._shard.sharded_tensor import metadata as sharded
    except ImportError:  # pragma: no cover - depends on the torch build
        sharded = None
    for name in ("TensorProperties", "MEM_FORMAT_ENCODING"):
        cls = getattr(sharded, name, None)
        if cls is not None:
            table[("torch.distributed._shard.sharded_tensor.metadata", name)] = cls
            if name == "TensorProperties":
                fill.add(cls)
    table[("torch", "Size")] = torch.Size
    table[("torch.serialization", "_get_layout")] = _LAYOUT
    # checkpoint_id: a path (written on Linux or Windows; the other flavour stays pure).
    native = pathlib.Path().__class__
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        cls = getattr(pathlib, name)
        if name in ("PosixPath", "WindowsPath") and cls is not native:
            cls = getattr(pathlib, "Pure" + name)
        table[("pathlib", name)] = cls
    table[("collections", "OrderedDict")] = collections.OrderedDict
    table[("builtins", "set")] = set
    table[("builtins", "frozenset")] = frozenset
    return table, frozenset(fill)


_TABLES: tuple[dict[tuple[str, str], Any], frozenset[type]] | None = None


def _allowed() -> tuple[dict[tuple[str, str], Any], frozenset[type]]:
    global _TABLES
    if _TABLES is None:
        _TABLES = _tables()
    return _TABLES


def _refuse(what: str) -> CheckpointError:
    return CheckpointError(
        f"it {what}, and DCP's metadata holds only DCP's own metadata classes (a crafted "
        "file, or not a DCP checkpoint's metadata); nothing in it was run"
    )


class _MetadataUnpickler(pickle._Unpickler):
    """An allowlisting unpickler (pure Python, like torch's ``weights_only`` one): it
    resolves only the globals of :func:`_tables`, calls only those that are classes or
    the layout lookup, fills (``BUILD``) only instances of DCP's metadata classes, adds
    items only to builtin containers, and knows no opcode that imports or calls anything
    else (``INST``, ``OBJ``, persistent ids and the extension registry are refused)."""

    dispatch: ClassVar[dict[int, Any]] = {}
    # pickle._Unpickler's own state (the pure-Python unpickler; not in typeshed's stubs)
    stack: list[Any]
    pop_mark: Callable[[], list[Any]]

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        table, fill = _allowed()
        self._table = table
        self._fill = fill
        self._callable = {id(v) for v in table.values() if callable(v)}

    def find_class(self, module: str, name: str) -> Any:
        hit = self._table.get((module, name))
        if hit is not None:
            return hit
        if module == "torch" and name.isidentifier():
            value = vars(torch).get(name)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        raise _refuse(f"names the global {module}.{name}")

    # -- opcodes that call or change objects: checked

    def load_reduce(self) -> None:
        stack = self.stack
        args = stack.pop()
        func = stack[-1]
        if id(func) not in self._callable:
            raise _refuse(f"calls {_show(func)}, which is not a class it may build")
        if not isinstance(args, tuple):
            raise _refuse("calls a class with arguments that are not a tuple")
        stack[-1] = func(*args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        self.stack.append(self._new(cls, args, {}))

    def load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        args = self.stack.pop()
        cls = self.stack.pop()
        self.stack.append(self._new(cls, args, kwargs))

    def _new(self, cls: Any, args: Any, kwargs: Any) -> Any:
        if not isinstance(cls, type) or id(cls) not in self._callable:
            raise _refuse(f"creates an object of {_show(cls)}")
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise _refuse("creates an object with arguments that are not a tuple")
        return cls.__new__(cls, *args, **kwargs)

    def load_build(self) -> None:
        state = self.stack.pop()
        inst = self.stack[-1]
        if type(inst) not in self._fill:
            raise _refuse(f"sets the state of {type(inst).__name__!r} object")
        setstate = getattr(type(inst), "__setstate__", None)
        if setstate is not None and setstate is not getattr(object, "__setstate__", None):
            inst.__setstate__(state)  # TensorProperties: its own, a 5-tuple
            return
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise _refuse(f"sets the state of {type(inst).__name__!r} from {_show(state)}")
        inst.__dict__.update(state)

    def load_append(self) -> None:
        value = self.stack.pop()
        self._container(list).append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._container(list).extend(items)

    def load_setitem(self) -> None:
        value = self.stack.pop()
        key = self.stack.pop()
        self._container(dict)[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        target = self._container(dict)
        for i in range(0, len(items) - 1, 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._container(set).update(items)

    def _container(self, kind: type) -> Any:
        target = self.stack[-1]
        if type(target) is not kind and not (
            kind is dict and type(target) is collections.OrderedDict
        ):
            raise _refuse(f"adds items to a {type(target).__name__!r} object")
        return target

    def _refused_opcode(self) -> None:
        raise _refuse("uses an opcode that imports or calls objects by other means")


_SAFE_OPCODES = (
    "PROTO FRAME STOP MARK POP POP_MARK DUP PUT BINPUT LONG_BINPUT MEMOIZE GET BINGET "
    "LONG_BINGET NONE NEWTRUE NEWFALSE INT BININT BININT1 BININT2 LONG LONG1 LONG4 FLOAT "
    "BINFLOAT STRING BINSTRING SHORT_BINSTRING UNICODE BINUNICODE SHORT_BINUNICODE "
    "BINUNICODE8 BINBYTES SHORT_BINBYTES BINBYTES8 BYTEARRAY8 EMPTY_TUPLE TUPLE TUPLE1 "
    "TUPLE2 TUPLE3 EMPTY_LIST LIST EMPTY_DICT DICT EMPTY_SET FROZENSET GLOBAL STACK_GLOBAL"
).split()
_CHECKED_OPCODES = {
    "REDUCE": _MetadataUnpickler.load_reduce,
    "NEWOBJ": _MetadataUnpickler.load_newobj,
    "NEWOBJ_EX": _MetadataUnpickler.load_newobj_ex,
    "BUILD": _MetadataUnpickler.load_build,
    "APPEND": _MetadataUnpickler.load_append,
    "APPENDS": _MetadataUnpickler.load_appends,
    "SETITEM": _MetadataUnpickler.load_setitem,
    "SETITEMS": _MetadataUnpickler.load_setitems,
    "ADDITEMS": _MetadataUnpickler.load_additems,
}
_REFUSED_OPCODES = "INST OBJ PERSID BINPERSID EXT1 EXT2 EXT4 NEXT_BUFFER READONLY_BUFFER".split()


def _dispatch() -> dict[int, Any]:
    base = pickle._Unpickler.dispatch
    table: dict[int, Any] = {}
    for name in _SAFE_OPCODES:
        code = getattr(pickle, name, None)
        if code is not None and code[0] in base:
            table[code[0]] = base[code[0]]
    for name, fn in _CHECKED_OPCODES.items():
        table[getattr(pickle, name)[0]] = fn
    for name in _REFUSED_OPCODES:
        code = getattr(pickle, name, None)
        if code is not None:
            table[code[0]] = _MetadataUnpickler._refused_opcode
    return table


_MetadataUnpickler.dispatch = _dispatch()


def loads_metadata(data: bytes, where: str = "the metadata") -> Any:
    """Unpickle DCP checkpoint metadata from ``data`` with the allowlisting unpickler and
    check its structure. Anything else, damaged or crafted, is a :class:`CheckpointError`
    (naming the global it refused, if it refused one)."""
    try:
        metadata = _MetadataUnpickler(bytes(data)).load()
    except CheckpointError as e:
        raise CheckpointError(f"refused {where}: {e}") from None
    except (Exception, RecursionError) as e:  # damaged: whatever the opcodes made of it
        raise CheckpointError(
            f"{where} is not a DCP metadata pickle ({type(e).__name__}: {_short(e)})"
        ) from None
    try:
        problem = _structure_problem(metadata)
    except Exception as e:  # an object the opcodes left half-built
        problem = f"{type(e).__name__}: {_short(e)}"
    if problem is not None:
        raise CheckpointError(f"{where} is not DCP checkpoint metadata: {problem}")
    return metadata


def load_metadata(path: str | os.PathLike) -> Any:
    """:func:`loads_metadata` of a checkpoint folder's ``.metadata`` (or of that file)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, ".metadata")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None
    return loads_metadata(data, path)


_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


class SafeMetadata(MetadataChecks):
    """Mixin for a DCP ``FileSystemReader`` (or a subclass): reads ``.metadata`` with the
    allowlisting unpickler (:func:`loads_metadata`), and checks every pickled entry with
    torch's ``weights_only`` unpickler before the load planner unpickles it. Put it first:
    ``class R(SafeMetadata, FileSystemReader)``. What every reader of shardspec checks in
    ``.metadata`` besides (its recorded checksum, data files inside the folder) comes from
    :class:`~shardspec.runtime.checkpoint.integrity.MetadataChecks`."""

    def _unpickle(self, data: bytes, where: str) -> Any:
        return loads_metadata(data, where)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)  # type: ignore[misc]
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = getattr(metadata, "state_dict_metadata", None) or {}
        self._pickled_entries = {
            id(info): index
            for index, info in (self.storage_data or {}).items()  # type: ignore[attr-defined]
            if isinstance(md.get(getattr(index, "fqn", None)), BytesStorageMetadata)
        }

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        view = super()._slice_file(file, sinfo)  # type: ignore[misc]
        index = getattr(self, "_pickled_entries", {}).get(id(sinfo))
        if index is None:
            return view
        data = view.read()
        try:
            torch.load(io.BytesIO(data), weights_only=True)
        except pickle.UnpicklingError as e:
            found = _UNSUPPORTED.search(str(e))
            named = f"names the global {found.group(1)}" if found else _short(e)
            raise CheckpointError(
                f"refused: the pickled entry {index.fqn!r} in "
                f"{os.path.join(os.fspath(self.path), sinfo.relative_path)} {named}, which "
                "torch's weights_only unpickler does not allow (nothing was run; "
                "torch.serialization.add_safe_globals admits a class you trust)"
            ) from None
        except Exception as e:
            raise CheckpointError(
                f"the pickled entry {index.fqn!r} in "
                f"{os.path.join(os.fspath(self.path), sinfo.relative_path)} cannot be read "
                f"({type(e).__name__}: {_short(e)})"
            ) from None
        return io.BytesIO(data)


class SafeFileSystemReader(SafeMetadata, FileSystemReader):
    """DCP's ``FileSystemReader`` within the trust boundary of :class:`SafeMetadata`."""


class SafeChecksumReader(SafeMetadata, ChecksumReader):
    """:class:`~shardspec.runtime.checkpoint.integrity.ChecksumReader` within the trust boundary of
    :class:`SafeMetadata` (checksums verified first, then pickled entries checked)."""
