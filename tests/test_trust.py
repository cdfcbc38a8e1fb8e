"""The trust boundary (``shardspec.runtime.checkpoint.trust``): DCP's ``.metadata`` is a pickle, and
so are the checkpoint's non-tensor entries; ``SafeMetadata`` readers build only DCP's own
metadata classes and refuse anything else, naming it, without running it.

Real checkpoints (shardspec's ``save`` under the llama and deepseek_moe specs, plain
``dcp.save`` with an optimizer, with and without checksums) load through the safe readers;
crafted pickles are refused and a side-effect file shows that nothing ran."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import Metadata

from bench import bench_checkpoint as bc
from shardspec.runtime import checkpoint as ck
from shardspec.runtime import units
from shardspec.runtime.checkpoint import trust
from shardspec.runtime.checkpoint.integrity import ChecksumReader, ChecksumWriter
from shardspec.runtime.checkpoint.trust import (
    SafeChecksumReader,
    SafeFileSystemReader,
    load_metadata,
    loads_metadata,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _touch(path: str) -> str:
    """A side effect that a pickle can name: proof that the pickle ran."""
    Path(path).touch()
    return path


class Gadget:
    """An arbitrary class whose unpickling has a side effect (``__setstate__``)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __setstate__(self, state: dict) -> None:
        _touch(state["path"])
        self.__dict__.update(state)


class _System:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self) -> tuple:
        return (os.system, (self.command,))


class _Eval:
    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple:
        return (eval, (self.code,))


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (_touch, (self.path,))


def _world1(spec: Any) -> bc.FakeMesh:
    return bc.FakeMesh(spec.axes, tuple(1 for _ in spec.axes), tuple(0 for _ in spec.axes))


def _spec_state(spec: Any, seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    model = {
        k: torch.randn(p.shape, generator=gen, dtype=getattr(torch, p.dtype))
        for k, p in spec.params.items()
    }
    return {"model": model, "extra": {"step": torch.tensor(3.0), "groups": [{"lr": 0.1}]}}


def _equal(a: dict, b: dict) -> bool:
    fa, fb = units._flat(a)[0], units._flat(b)[0]
    return all(
        torch.equal(v, fb[k]) if isinstance(v, torch.Tensor) else v == fb[k] for k, v in fa.items()
    )


def _plain_metadata(path: str) -> Metadata:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)


# ----------------------------------------------------------------------------- real


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Any, str, dict]]:
    """name -> (spec or None, path, saved state)."""
    import generated.deepseek_moe as moe
    import generated.llama as llama

    root = tmp_path_factory.mktemp("real")
    out: dict[str, tuple[Any, str, dict]] = {}
    for name, mod in (("llama", llama), ("deepseek_moe", moe)):
        state = _spec_state(mod.SPEC, 1)
        path = str(root / name)
        ck.save(mod.SPEC, state, path, mesh=_world1(mod.SPEC))  # DCP's own writer
        out[name] = (mod.SPEC, path, state)
        path = str(root / f"{name}-checksums")
        dcp.save(
            state,
            storage_writer=ChecksumWriter(path),
            planner=ck.ShardspecSavePlanner(mod.SPEC, _world1(mod.SPEC)),
        )
        out[f"{name}-checksums"] = (mod.SPEC, path, state)
    # Plain dcp.save: a model and its Adam state (param_groups stored pickled).
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    net(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {"model": net.state_dict(), "optim": opt.state_dict()}
    path = str(root / "plain")
    dcp.save(state, checkpoint_id=path)
    out["plain"] = (None, path, state)
    return out


def test_real_metadata_unpickles_to_what_pickle_gives(checkpoints: dict) -> None:
    for name, (_, path, _) in checkpoints.items():
        assert load_metadata(path) == _plain_metadata(path), name


def test_real_checkpoints_load_through_the_safe_readers(checkpoints: dict) -> None:
    for name, (spec, path, state) in checkpoints.items():
        for make in (SafeFileSystemReader, SafeChecksumReader):
            reader = make(path)
            assert ck.reader_fills_sinks(reader)  # shardspec's load keeps its staging
            if spec is None:
                target = pickle.loads(pickle.dumps(state))
                for t in units._flat(target)[0].values():
                    if isinstance(t, torch.Tensor):
                        t.zero_()
                dcp.load(target, storage_reader=reader)
            else:
                target = _spec_state(spec, 2)
                ck.load(spec, target, path, mesh=_world1(spec), storage_reader=reader)
            assert _equal(state, target), (name, make.__name__)
            if name.endswith("-checksums") and make is SafeChecksumReader:
                assert reader.verified > 0


def test_what_dcp_pickles(checkpoints: dict) -> None:
    """Every global in real metadata is one the allowlist names (this is how the list was
    made: by recording what DCP's pickles name)."""

    seen: set[tuple[str, str]] = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            seen.add((module, name))
            return super().find_class(module, name)

    for _, path, _ in checkpoints.values():
        with open(os.path.join(path, ".metadata"), "rb") as f:
            Recorder(f).load()
    table, _ = trust._allowed()
    dtypes = {g for g in seen if g[0] == "torch" and isinstance(getattr(torch, g[1]), torch.dtype)}
    assert dtypes and {g for g in seen - dtypes if g not in table} == set()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    assert ("torch.distributed.checkpoint.filesystem", "_StorageInfo") in seen


# ----------------------------------------------------------------------------- crafted


def _crafted(tmp_path: Path) -> list[tuple[str, bytes, str]]:
    """(what, pickle bytes, text the refusal must contain); each would create ``side``
    if run."""
    side = str(tmp_path / "side")
    real = Metadata(state_dict_metadata={}, planner_data={"x": ("x",)}, storage_data={})
    cases = [
        ("os.system", pickle.dumps(_System(f"touch {side}")), f"{os.system.__module__}.system"),
        ("eval", pickle.dumps(_Eval(f"open({side!r}, 'w').close()")), "builtins.eval"),
        ("arbitrary class", pickle.dumps(Gadget(side)), f"{Gadget.__module__}.Gadget"),
        ("function", pickle.dumps(_Touch(side)), f"{__name__}._touch"),
    ]
    real.planner_data = {"x": _Touch(side)}
    cases.append(("inside real metadata", pickle.dumps(real), f"{__name__}._touch"))
    real.planner_data = None
    real.storage_meta = Gadget(side)  # type: ignore[assignment]
    cases.append(("storage_meta", pickle.dumps(real), "Gadget"))
    # Protocol 0's INST opcode imports and calls by itself.
    inst = b"(S'touch " + side.encode() + b"'\nios\nsystem\n."
    cases.append(("INST opcode", inst, "opcode"))
    # BUILD on a class object: would set attributes of DCP's Metadata class.
    module = b"torch.distributed.checkpoint.metadata"
    build = (
        b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x8c\x08Metadata\x93"
        b"N}\x8c\x08__init__\x8c\x01xs\x86b."  # (None, {"__init__": "x"}) as slot state
    )
    cases.append(("BUILD on a class", build, "'type' object"))
    return cases


def test_crafted_metadata_is_refused_without_running(tmp_path: Path) -> None:
    side = tmp_path / "side"
    init = Metadata.__init__
    for what, data, needle in _crafted(tmp_path):
        with pytest.raises(ck.CheckpointError) as e:
            loads_metadata(data, "crafted")
        assert "refused crafted" in str(e.value) and needle in str(e.value), (what, str(e.value))
        assert not side.exists(), f"{what}: it ran"
    assert Metadata.__init__ is init


def test_dcp_reader_runs_what_the_safe_reader_refuses(tmp_path: Path) -> None:
    """The boundary itself: DCP's own reader runs a crafted .metadata."""
    path = tmp_path / "c"
    path.mkdir()
    side = tmp_path / "side"
    (path / ".metadata").write_bytes(pickle.dumps(_Touch(str(side))))
    with pytest.raises(ck.CheckpointError, match="_touch"):
        SafeFileSystemReader(str(path)).read_metadata()
    assert not side.exists()
    with pytest.raises(AttributeError):  # it ran the pickle, then found no Metadata
        dcp.FileSystemReader(str(path)).read_metadata()
    assert side.exists()


def test_crafted_metadata_in_a_checkpoint_fails_load(checkpoints: dict, tmp_path: Path) -> None:
    spec, good, _ = checkpoints["llama-checksums"]
    path = str(tmp_path / "c")
    shutil.copytree(good, path)
    side = tmp_path / "side"
    md = _plain_metadata(path)
    md.planner_data = {"model.x": _Touch(str(side))}
    Path(path, ".metadata").write_bytes(pickle.dumps(md))
    target = _spec_state(spec, 2)
    before = pickle.loads(pickle.dumps(target))
    for make in (SafeFileSystemReader, SafeChecksumReader):
        with pytest.raises(ck.CheckpointError, match=r"_touch.*nothing in it was run"):
            ck.load(spec, target, path, mesh=_world1(spec), storage_reader=make(path))
        assert not side.exists()
        assert _equal(before, target)


def test_data_files_outside_the_checkpoint_are_refused(checkpoints: dict) -> None:
    _, path, _ = checkpoints["llama"]
    for bad in ("../elsewhere.distcp", "/etc/passwd", "sub/x.distcp", "..", ""):
        md = _plain_metadata(path)
        next(iter(md.storage_data.values())).relative_path = bad
        with pytest.raises(ck.CheckpointError, match="data file"):
            loads_metadata(pickle.dumps(md))


def test_crafted_pickled_entry_is_refused(tmp_path: Path) -> None:
    """Non-tensor entries are unpickled by the load planners with weights_only=False:
    the safe readers check them with torch's weights_only unpickler first."""
    import generated.llama as mod

    spec, mesh = mod.SPEC, _world1(mod.SPEC)
    side = tmp_path / "side"
    state = _spec_state(spec, 1)
    state["extra"]["hook"] = _Touch(str(side))
    path = str(tmp_path / "c")
    dcp.save(
        state, storage_writer=ChecksumWriter(path), planner=ck.ShardspecSavePlanner(spec, mesh)
    )
    target = _spec_state(spec, 2)
    target["extra"]["hook"] = None
    for make in (SafeFileSystemReader, SafeChecksumReader):
        with pytest.raises(ck.CheckpointError, match=r"'extra.hook'.*_touch.*nothing was run"):
            ck.load(spec, target, path, mesh=mesh, storage_reader=make(path))
        assert not side.exists()
        assert target["extra"]["hook"] is None
    ck.load(spec, target, path, mesh=mesh, storage_reader=ChecksumReader(path))
    assert side.exists()  # the checksum is right: only the boundary stops it


# ----------------------------------------------------------------------------- fuzz


@settings(max_examples=150, deadline=None)
@given(data=st.binary(max_size=600))
def test_fuzz_random_bytes_are_checkpoint_errors(data: bytes) -> None:
    with pytest.raises(ck.CheckpointError):
        loads_metadata(data)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["flip", "set", "truncate", "insert", "splice"]),
    pos=st.integers(min_value=0),
    arg=st.integers(min_value=0, max_value=1 << 16),
)
def test_fuzz_damaged_real_metadata(checkpoints: dict, kind: str, pos: int, arg: int) -> None:
    """Damaged real metadata either still unpickles to well-formed DCP metadata or is a
    CheckpointError; never another exception."""
    _, path, _ = checkpoints["llama-checksums"]
    data = bytearray(Path(path, ".metadata").read_bytes())
    pos %= len(data)
    if kind == "flip":
        data[pos] ^= 1 << (arg % 8)
    elif kind == "set":
        data[pos] = arg % 256
    elif kind == "truncate":
        del data[pos:]
    elif kind == "insert":
        data[pos:pos] = bytes([arg % 256])
    else:  # a piece of the pickle repeated elsewhere
        data[pos:pos] = data[arg % len(data) : arg % len(data) + 1 + arg % 64]
    try:
        md = loads_metadata(bytes(data))
    except ck.CheckpointError:
        return
    assert isinstance(md, Metadata) and trust._structure_problem(md) is None


def test_safe_reader_read_metadata_wraps_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ck.CheckpointError, match="cannot read"):
        SafeFileSystemReader(str(tmp_path)).read_metadata()
