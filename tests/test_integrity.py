"""Checksums per stored chunk (``shardspec.runtime.checkpoint.integrity``): written by
``ChecksumWriter``, verified by ``ChecksumReader`` in shardspec's ``load``.

One process, world 1, the tiny llama spec (fused q/k/v and gate/up units, so stored keys
differ from the model's), plus entries that DCP stores pickled. The multi-rank case (2
gloo ranks, ``generated/llama.py``'s planners) is in ``integrity_scenarios.py``."""

from __future__ import annotations

import copy
import io
import itertools
import json
import os
import pickle
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import bench_checkpoint as bc
from shardspec.runtime import checkpoint as ck
from shardspec.runtime import units
from shardspec.runtime.checkpoint import integrity as ig
from shardspec.runtime.checkpoint.integrity import ChecksumReader, ChecksumWriter, checksum
from shardspec.testing import run_ranks
from tests import integrity_scenarios

SPEC = bc.bench_spec({})
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _mesh() -> bc.FakeMesh:
    return bc._Sim(SPEC, 1, 1, None).mesh(0)


def _state(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    model = {
        k: torch.randn(p.shape, generator=gen, dtype=getattr(torch, p.dtype))
        for k, p in SPEC.params.items()
    }
    extra = {
        "step": torch.tensor(float(seed)),
        "groups": [{"lr": 0.1 * seed, "betas": (0.9, 0.95)}],  # stored pickled
        "name": f"run-{seed}",
    }
    return {"model": model, "extra": extra}


def _flat(state: dict) -> dict[str, Any]:
    return units._flat(state)[0]


def _snapshot(state: dict) -> dict[str, Any]:
    """A copy of every entry of the state, tensors and pickled ones (``load`` stages both)."""
    return {
        k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in _flat(state).items()
    }


def _diff(a: dict, b: dict) -> list[str]:
    out = []
    for k, v in a.items():
        w = b[k]
        same = torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w
        if not same:
            out.append(k)
    return out


def _save(path: str, state: dict, writer: Any = None) -> None:
    writer = writer if writer is not None else ChecksumWriter(path)
    dcp.save(state, storage_writer=writer, planner=ck.ShardspecSavePlanner(SPEC, _mesh()))


def _load(path: str, state: dict, reader: Any) -> ck.ShardspecLoadPlanner:
    return ck.load(SPEC, state, path, mesh=_mesh(), storage_reader=reader)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("ck") / "c")
    state = _state(1)
    _save(path, state)
    return path, state


def _items(path: str) -> list[tuple[Any, Any]]:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        md = pickle.load(f)
    return sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset))


@pytest.fixture
def scratch(saved: tuple[str, dict], tmp_path: Path) -> tuple[str, dict]:
    """A copy of the saved checkpoint that a test may damage."""
    path = str(tmp_path / "c")
    shutil.copytree(saved[0], path)
    return path, saved[1]


# ----------------------------------------------------------------------------- checksum


@settings(max_examples=60, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=3000),
    cuts=st.lists(st.integers(min_value=0, max_value=3000), max_size=6),
)
def test_running_checksum_equals_one_shot_for_any_write_pieces(data: bytes, cuts: list) -> None:
    """The writer hashes bytes as they are written, in pieces of any size: the result is
    the checksum of the whole, as the reader computes it."""
    run = ig._Running()
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    for a, b in itertools.pairwise(bounds):
        run.update(memoryview(data)[a:b])
    assert run.length == len(data)
    assert run.digest() == checksum(bytearray(data))


@settings(max_examples=80, deadline=None)
@given(
    data=st.binary(min_size=1, max_size=4000),
    where=st.integers(min_value=0),
    bit=st.integers(min_value=0, max_value=7),
)
def test_any_single_bit_flip_changes_the_checksum(data: bytes, where: int, bit: int) -> None:
    flipped = bytearray(data)
    flipped[where % len(data)] ^= 1 << bit
    assert checksum(flipped) != checksum(bytearray(data))


def test_checksum_spells_its_algorithm() -> None:
    data = bytearray(os.urandom(1500))
    assert checksum(data).startswith("rowsum64:")
    for alg in ig.ALGORITHMS:
        assert checksum(data, algorithm=alg).split(":", 1)[0] == alg
    with pytest.raises(ck.CheckpointError, match="unknown checksum algorithm"):
        checksum(data, algorithm="md4x")


# ----------------------------------------------------------------------------- round trip


def test_every_item_has_the_checksum_of_its_stored_bytes(saved: tuple[str, dict]) -> None:
    path, _ = saved
    items = _items(path)
    assert len(items) > 20
    files: dict[str, bytearray] = {}
    for _, info in items:
        data = files.setdefault(
            info.relative_path, bytearray(Path(path, info.relative_path).read_bytes())
        )
        assert info.checksum == checksum(data, info.length, info.offset)
    # Pickled entries are checksummed too.
    assert any(index.offset is None for index, _ in items)


def test_writer_computes_as_it_writes_or_reads_back_the_same(tmp_path: Path) -> None:
    state = _state(2)
    fused, back = (
        ChecksumWriter(str(tmp_path / "a")),
        ChecksumWriter(str(tmp_path / "b"), fused=False),
    )
    _save(str(tmp_path / "a"), state, fused)
    _save(str(tmp_path / "b"), state, back)
    assert fused.read_back == 0 and back.read_back > 20
    a = {i.fqn: s.checksum for i, s in _items(str(tmp_path / "a"))}
    b = {i.fqn: s.checksum for i, s in _items(str(tmp_path / "b"))}
    assert a == b


@pytest.mark.parametrize("fused", [True, False])
def test_load_verifies_every_item_and_keeps_staging(saved: tuple[str, dict], fused: bool) -> None:
    path, state = saved
    target = _state(2)
    reader = ChecksumReader(path, fused=fused)
    assert ck.reader_fills_sinks(reader)  # DCP's read_data: load() keeps chunks as read
    planner = _load(path, target, reader)
    assert planner.capture
    assert _diff(_flat(state), _flat(target)) == []
    assert reader.verified == len(_items(path))


def test_plain_dcp_load_reads_a_checkpoint_with_checksums(
    saved: tuple[str, dict], tmp_path: Path
) -> None:
    path, state = saved
    # shardspec's planner with DCP's own reader
    target = _state(3)
    dcp.load(
        target,
        storage_reader=dcp.FileSystemReader(path),
        planner=ck.ShardspecLoadPlanner(SPEC, _mesh()),
    )
    assert _diff(_flat(state), _flat(target)) == []
    # DCP's default planners and reader, on a plain nested state dict
    plain = {"w": torch.randn(5, 7), "opt": {"lr": 0.5, "m": torch.arange(6)}}
    dcp.save(plain, storage_writer=ChecksumWriter(str(tmp_path / "p")))
    back = {"w": torch.zeros(5, 7), "opt": {"lr": 0.0, "m": torch.zeros(6, dtype=torch.int64)}}
    dcp.load(back, checkpoint_id=str(tmp_path / "p"))
    assert torch.equal(back["w"], plain["w"]) and torch.equal(back["opt"]["m"], plain["opt"]["m"])
    assert back["opt"]["lr"] == 0.5


def test_checkpoint_without_checksums(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    state = _state(4)
    _save(path, state, dcp.FileSystemWriter(path))
    target = _state(5)
    reader = ChecksumReader(path)
    _load(path, target, reader)
    assert reader.verified == 0
    assert _diff(_flat(state), _flat(target)) == []
    with pytest.raises(ck.CheckpointError, match="has no checksums"):
        _load(path, _state(5), ChecksumReader(path, require=True))


# ----------------------------------------------------------------------------- damage


def _flip(path: str, name: str, pos: int, bit: int = 0) -> None:
    with open(os.path.join(path, name), "r+b") as f:
        f.seek(pos)
        byte = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([byte ^ (1 << bit)]))


def _positions(path: str) -> list[tuple[Any, Any, int]]:
    """(index, storage info, byte) for the first, a quarter, the middle and the last byte
    of every stored item: zip headers, pickle, data and the zip directory."""
    out = []
    for index, info in _items(path):
        for frac in (0.0, 0.25, 0.5, 1.0):
            out.append((index, info, info.offset + min(info.length - 1, int(info.length * frac))))
    return out


def _expect_named_error(path: str, target: dict, reader: Any, index: Any, info: Any) -> str:
    before = _snapshot(target)
    with pytest.raises(ig.ChecksumError) as e:  # a CheckpointError
        _load(path, target, reader)
    msg = str(e.value)
    assert info.relative_path in msg, msg
    assert repr(index.fqn) in msg, msg
    if index.offset is not None:
        assert f"chunk at offsets {list(index.offset)}" in msg, msg
    assert _diff(before, _snapshot(target)) == [], "a failed load changed the state"
    return msg


@pytest.mark.parametrize("fused", [True, False])
def test_single_byte_flips_anywhere_are_detected_and_change_nothing(
    scratch: tuple[str, dict], fused: bool
) -> None:
    path, _ = scratch
    positions = _positions(path)
    assert len(positions) > 80
    rng = random.Random(0)
    for index, info, pos in positions:
        bit = rng.randrange(8)
        _flip(path, info.relative_path, pos, bit)
        msg = _expect_named_error(path, _state(6), ChecksumReader(path, fused=fused), index, info)
        assert "checksum mismatch" in msg
        _flip(path, info.relative_path, pos, bit)  # restored
    _load(path, _state(6), ChecksumReader(path))  # and the copy is whole again


def test_without_checksums_flips_load_silently(scratch: tuple[str, dict]) -> None:
    """What the issue saw: DCP's reader loads most flipped copies without a word."""
    path, state = scratch
    silent = 0
    tensors = [(i, s) for i, s in _items(path) if i.offset is not None]
    for _, info in tensors[:12]:
        pos = info.offset + info.length // 2  # in the tensor's data
        _flip(path, info.relative_path, pos, 3)
        target = _state(7)
        try:
            _load(path, target, dcp.FileSystemReader(path))
            silent += _diff(_flat(state), _flat(target)) != []
        except ck.CheckpointError:
            pass
        _flip(path, info.relative_path, pos, 3)
    assert silent >= 10


def test_verify_false_skips_the_checks(scratch: tuple[str, dict]) -> None:
    path, state = scratch
    info = next(s for i, s in _items(path) if i.offset is not None)
    _flip(path, info.relative_path, info.offset + info.length // 2, 5)
    target = _state(8)
    reader = ChecksumReader(path, verify=False)
    _load(path, target, reader)  # no error: nothing verified
    assert reader.verified == 0
    assert _diff(_flat(state), _flat(target)) != []


def test_truncated_data_file_names_file_key_and_chunk(scratch: tuple[str, dict]) -> None:
    path, _ = scratch
    items = _items(path)
    index, info = items[len(items) // 2]
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.truncate(info.offset + info.length // 2)
    for fused in (True, False):
        msg = _expect_named_error(path, _state(9), ChecksumReader(path, fused=fused), index, info)
        assert "truncated" in msg


def test_metadata_with_some_checksums_missing_is_refused(scratch: tuple[str, dict]) -> None:
    path, _ = scratch
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)
    del next(iter(md.storage_data.values())).checksum
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ck.CheckpointError, match="have no checksum"):
        _load(path, _state(10), ChecksumReader(path))


def test_unknown_checksum_kind_and_format_are_refused(scratch: tuple[str, dict]) -> None:
    path, _ = scratch
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)
    next(iter(md.storage_data.values())).checksum = "md4:00"
    with open(meta, "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(ck.CheckpointError, match="unknown kind"):
        _load(path, _state(10), ChecksumReader(path))
    from torch.distributed.checkpoint.filesystem import SerializationFormat

    with pytest.raises(ck.CheckpointError, match="torch_save records only"):
        ChecksumWriter(path, serialization_format=SerializationFormat.SAFETENSORS)
    with pytest.raises(ck.CheckpointError, match="unknown checksum algorithm"):
        ChecksumWriter(path, algorithm="md4")


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_other_algorithms_verify_too(tmp_path: Path, algorithm: str) -> None:
    path = str(tmp_path / "c")
    state = _state(11)
    _save(path, state, ChecksumWriter(path, algorithm=algorithm))
    index, info = _items(path)[3]
    assert info.checksum.startswith(algorithm + ":")
    target = _state(12)
    _load(path, target, ChecksumReader(path))
    assert _diff(_flat(state), _flat(target)) == []
    _flip(path, info.relative_path, info.offset + info.length // 2)
    _expect_named_error(path, _state(12), ChecksumReader(path), index, info)


# ----------------------------------------------------------------------------- fuzz


def _damage(data: bytes, kind: str, pos: int, arg: int) -> bytes:
    out = bytearray(data)
    pos %= len(out)
    if kind == "flip":
        out[pos] ^= 1 << (arg % 8)
    elif kind == "set":
        out[pos] = arg % 256
    elif kind == "zero":
        out[pos : pos + 1 + arg % 4096] = bytes(len(out[pos : pos + 1 + arg % 4096]))
    elif kind == "truncate":
        del out[pos:]
    else:  # insert: everything after moves
        out[pos:pos] = bytes([arg % 256]) * (1 + arg % 7)
    return bytes(out)


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    kind=st.sampled_from(["flip", "set", "zero", "truncate", "insert"]),
    pos=st.integers(min_value=0),
    arg=st.integers(min_value=0, max_value=1 << 16),
    fused=st.booleans(),
)
def test_fuzz_damaged_data_files_give_checkpoint_errors_only(
    scratch: tuple[str, dict], kind: str, pos: int, arg: int, fused: bool
) -> None:
    path, state = scratch
    name = _items(path)[0][1].relative_path
    file = os.path.join(path, name)
    original = Path(file).read_bytes()
    damaged = _damage(original, kind, pos, arg)
    Path(file).write_bytes(damaged)
    try:
        target = _state(13)
        before = _snapshot(target)
        try:
            _load(path, target, ChecksumReader(path, fused=fused))
        except ck.CheckpointError:
            assert damaged != original
            assert _diff(before, _snapshot(target)) == []
        else:
            assert damaged == original  # only an unchanged file loads
            assert _diff(_flat(state), _flat(target)) == []
    finally:
        Path(file).write_bytes(original)


# ----------------------------------------------------------------------------- ranks


@pytest.mark.dist
def test_checksums_on_two_ranks(tmp_path: Path) -> None:
    results = run_ranks(integrity_scenarios.run_all, 2, str(tmp_path), timeout=120)
    failures = [f"rank {r}: {msg}" for r, (fails, _) in enumerate(results) for msg in fails]
    assert not failures, "\n".join(failures[:20])
    for rank, (_, counts) in enumerate(results):
        assert counts == integrity_scenarios.EXPECTED, f"rank {rank} checked {counts}"


@pytest.mark.dist
def test_benchmark_runs_at_tiny_size() -> None:
    """``python -m bench.bench_integrity`` cannot rot: one round on 2 ranks, its report."""
    from bench import bench_integrity as bi

    res = bi.run_io(
        {},
        rounds=1,
        world=2,
        sizes={"tp": 2},
        saves=("plain", "rowsum64"),
        loads=("plain", "rowsum64", "rowsum64-upfront"),
    )
    assert res["checks"] and all(v == [] for v in res["checks"].values())
    assert all(n > 0 for k, v in res["verified"].items() if "plain" not in k for n in v)
    text = "\n".join(bi.io_report(res) + bi.verdicts(res))
    assert "| rowsum64 |" in text and "all equal" in text and "load():warm" in text
    assert res["metadata"]["trust"] > 0
    rows = bi.run_hash(mib=16, repeat=1)
    assert {r["algorithm"] for r in rows} == set(ig.ALGORITHMS)
    floor = bi.run_floor(mib=8, repeat=1)
    assert [r["block"] for r in floor] == list(bi.FLOOR_BLOCKS)
    assert all(r[k] > 0 for r in floor for k in ("plain", "summed", "thread"))
    assert len(bi.floor_report(floor)) == 2 + len(bi.FLOOR_BLOCKS)


def test_save_writes_and_load_verifies_by_default(tmp_path: Path) -> None:
    """``save``/``load`` themselves (not a reader passed in): checksums written, verified,
    skipped with ``verify=False``, and the failure says what became of the model."""
    path = str(tmp_path / "c")
    state = _state(11)
    ck.save(SPEC, state, path, mesh=_mesh())
    items = _items(path)
    assert items and all(str(s.checksum).startswith("rowsum64:") for _, s in items)
    target = _state(12)
    ck.load(SPEC, target, path, mesh=_mesh())
    assert _diff(_flat(state), _flat(target)) == []

    index, info = max(((i, s) for i, s in items if i.offset is not None), key=lambda t: t[1].length)
    _flip(path, info.relative_path, info.offset + info.length // 2, 2)
    target = _state(13)
    before = _snapshot(target)
    with pytest.raises(ig.ChecksumError, match="the model was not changed") as e:
        ck.load(SPEC, target, path, mesh=_mesh())
    assert info.relative_path in str(e.value) and repr(index.fqn) in str(e.value)
    assert _diff(before, _snapshot(target)) == []
    with pytest.raises(ig.ChecksumError, match="the model may be partly loaded"):
        ck.load(SPEC, _state(13), path, mesh=_mesh(), atomic=False)
    with pytest.raises(ig.ChecksumError, match="checksum mismatch"):
        ck.load(SPEC, _state(13), path, mesh=_mesh(), trusted=False)
    target = _state(13)
    ck.load(SPEC, target, path, mesh=_mesh(), verify=False)  # the flipped value, unchecked
    assert len(_diff(_flat(state), _flat(target))) == 1  # the flipped tensor, loaded as is


def test_load_trusted_false_refuses_code_in_the_metadata(tmp_path: Path) -> None:
    path = str(tmp_path / "c")
    ck.save(SPEC, _state(14), path, mesh=_mesh())
    ran = tmp_path / "ran"
    payload = pickle.dumps(Exploit(str(ran)))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        f.write(payload)
    target = _state(15)
    # The recorded checksum of .metadata refuses the crafted file first (a damaged one)...
    with pytest.raises(ck.CheckpointError, match=r"\.metadata does not match the checksum"):
        ck.load(SPEC, target, path, mesh=_mesh(), trusted=False)
    # ... but whoever wrote it can write a matching checksum: the unpickler refuses it.
    marker = json.loads(Path(path, ck.MARKER).read_text())
    marker[ig.METADATA_CHECKSUM] = checksum(payload)
    Path(path, ck.MARKER).write_text(json.dumps(marker))
    before = _snapshot(target)
    with pytest.raises(ck.CheckpointError, match=r"os\.system|posix\.system|not a class"):
        ck.load(SPEC, target, path, mesh=_mesh(), trusted=False)
    assert not ran.exists()
    assert _diff(before, _snapshot(target)) == []


class Exploit:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("numpy", [True, False], ids=["numpy", "torch"])
def test_hashing_stays_on_the_calling_thread(tmp_path: Path, monkeypatch, numpy: bool) -> None:
    """The row sums run on the calling thread: with numpy (whose reductions never use
    threads; torch is not asked to reduce anything), or without it in torch calls smaller
    than ATen's GRAIN_SIZE (32,768 elements). Split over torch's intra-op threads, which
    training shares and which stall on a busy core, 4 MiB reductions hashed at 0.25 GB/s
    instead of 12 (bench/RESULTS.md, "Checkpoint integrity")."""
    if not numpy:
        monkeypatch.setattr(ig, "_np", None)
    sizes: list[int] = []
    real_sum = torch.sum

    def counted(t, *args, **kwargs):
        sizes.append(t.numel())
        return real_sum(t, *args, **kwargs)

    monkeypatch.setattr(ig.torch, "sum", counted)
    big = {"w": torch.randn(3 << 20), "v": torch.randn(1000, 1000)}  # 12 MB and 4 MB items
    path = str(tmp_path / "c")
    dcp.save(big, storage_writer=ChecksumWriter(path), no_dist=True)
    back = {k: torch.zeros_like(v) for k, v in big.items()}
    reader = ChecksumReader(path)
    dcp.load(back, storage_reader=reader, no_dist=True)
    assert reader.verified == 2 and all(torch.equal(big[k], back[k]) for k in big)
    if numpy:
        assert sizes == []
        return
    assert sizes and max(sizes) < 32768, max(sizes)
    assert sum(sizes) >= 0.95 * 2 * (16 << 20) // 8  # the words of both items, written and read


@settings(max_examples=40, deadline=None)
@given(
    data=st.binary(min_size=0, max_size=20000),
    start=st.integers(min_value=0, max_value=9),
    cuts=st.lists(st.integers(min_value=0, max_value=20000), max_size=5),
)
def test_numpy_and_torch_row_sums_agree(data: bytes, start: int, cuts: list) -> None:
    """numpy is optional: without it torch computes the same checksums, one shot (from an
    unaligned start too) and as a stream."""
    buf = bytearray(data)
    start = min(start, len(buf))
    bounds = sorted({max(start, min(c, len(buf))) for c in cuts} | {start, len(buf)})
    digests = []
    for np_module in (ig._np, None):
        saved, ig._np = ig._np, np_module
        try:
            run = ig._Running()
            for a, b in itertools.pairwise(bounds):
                run.update(memoryview(buf)[a:b])
            digests.append((checksum(buf, start=start), run.digest()))
        finally:
            ig._np = saved
    assert ig._np is not None  # the tests' environment has numpy: both paths ran
    assert digests[0] == digests[1]
    assert digests[0][0] == digests[0][1]


@settings(max_examples=40, deadline=None)
@given(
    pieces=st.lists(
        st.one_of(
            st.integers(min_value=0, max_value=300), st.integers(min_value=60000, max_value=90000)
        ),
        min_size=1,
        max_size=30,
    ),
    tells=st.sets(st.integers(min_value=0, max_value=30), max_size=4),
)
def test_writer_stream_gathers_small_writes_and_keeps_every_run(pieces: list, tells: set) -> None:
    """The writer's stream gathers small writes (zip headers) before passing them on and
    hashing them: the file gets every byte in order, and each run between two ``tell``
    calls has the checksum of its bytes."""
    raw = io.BytesIO()
    stream = ig._SummingStream(raw)
    starts, data = [0], bytearray()
    stream.tell()
    for i, n in enumerate(pieces):
        chunk = os.urandom(n)
        assert stream.write(memoryview(chunk)) == n
        data += chunk
        if i in tells:
            assert stream.tell() == len(data)
            starts.append(len(data))
    stream.flush()
    assert raw.getvalue() == data
    stream.close()
    ends = [*starts[1:], len(data)]
    for a, b in zip(starts, ends, strict=True):
        if b > a:
            assert stream.runs[a] == (b - a, checksum(data[a:b]))


# ----------------------------------------------------------------------------- .metadata


def _flip_outcomes(path: str, saved: dict, positions: list[int], named: bool = True) -> list[str]:
    """Flip one bit at each position of ``path``'s .metadata in turn (restored after): each
    load must load identical data, or fail, leaving the model as it was, with a short
    message and no traceback: one line naming .metadata (``named``), or else the
    validation's list of what differs (a key's name damaged)."""
    meta = os.path.join(path, ".metadata")
    original = Path(meta).read_bytes()
    problems = []
    for pos in positions:
        data = bytearray(original)
        data[pos] ^= 1 << (pos % 8)
        Path(meta).write_bytes(bytes(data))
        target = _state(31)
        before = _snapshot(target)
        try:
            ck.load(SPEC, target, path, mesh=_mesh())
        except ck.CheckpointError as e:
            msg = str(e)
            one_line = "\n" not in msg and ".metadata" in msg
            if len(msg) > 600 or "Traceback" in msg or (named and not one_line):
                problems.append(f"byte {pos}: {type(e).__name__} of {len(msg)} chars: {msg[:300]}")
            if _diff(before, _snapshot(target)):
                problems.append(f"byte {pos}: the failed load changed the model")
        else:
            if _diff(_flat(saved), _flat(target)):
                problems.append(f"byte {pos}: loaded without an error, but different data")
    Path(meta).write_bytes(original)
    return problems


def _sample(size: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return sorted({0, 1, size // 2, size - 2, size - 1, *rng.sample(range(size), min(n, size))})


def test_metadata_flips_load_identically_or_fail_in_one_line(tmp_path: Path) -> None:
    """Sampled bit flips across ``.metadata``: the checksum ``save`` recorded for it names
    the damage before anything is unpickled."""
    path = str(tmp_path / "c")
    state = _state(21)
    ck.save(SPEC, state, path, mesh=_mesh())
    size = os.path.getsize(os.path.join(path, ".metadata"))
    assert _flip_outcomes(path, state, _sample(size, 60, 1)) == []


def test_metadata_flips_without_a_recorded_checksum(tmp_path: Path) -> None:
    """A checkpoint whose marker records no checksum of .metadata (an older save): a flip
    still gives identical data or a short error, never DCP's traceback, and never a silent
    load of other data (a damaged chunk offset is caught by the chunks' coverage)."""
    path = str(tmp_path / "c")
    state = _state(22)
    ck.save(SPEC, state, path, mesh=_mesh())
    marker = json.loads(Path(path, ck.MARKER).read_text())
    del marker[ig.METADATA_CHECKSUM]
    Path(path, ck.MARKER).write_text(json.dumps(marker))
    size = os.path.getsize(os.path.join(path, ".metadata"))
    assert _flip_outcomes(path, state, _sample(size, 200, 2), named=False) == []


def test_a_data_file_mismatch_says_which_may_be_damaged(scratch: tuple[str, dict]) -> None:
    """A flipped data file, with .metadata verified by its recorded checksum: the data file
    is damaged. Without a recorded checksum for .metadata, either may be."""
    path, _ = scratch
    _, info = max(
        ((i, s) for i, s in _items(path) if i.offset is not None), key=lambda t: t[1].length
    )
    _flip(path, info.relative_path, info.offset + info.length // 2, 1)
    with pytest.raises(ig.ChecksumError, match=r"the data file, or the checkpoint's \.metadata"):
        _load(path, _state(2), ChecksumReader(path))
    ck.save(SPEC, _state(3), path + "2", mesh=_mesh())
    _, info = max(
        ((i, s) for i, s in _items(path + "2") if i.offset is not None), key=lambda t: t[1].length
    )
    _flip(path + "2", info.relative_path, info.offset + info.length // 2, 1)
    with pytest.raises(
        ig.ChecksumError, match=r"the data file is damaged \(the \.metadata matches"
    ):
        ck.load(SPEC, _state(4), path + "2", mesh=_mesh())


@pytest.mark.parametrize("trusted", [True, False])
@pytest.mark.parametrize("how", ["parent", "folder", "link"])
def test_data_files_outside_the_folder_are_refused_by_default(
    tmp_path: Path, trusted: bool, how: str
) -> None:
    """A .metadata whose data file is ``../outside/__0_0.distcp`` (a copy of the real one,
    so a read would succeed), or one in a subfolder, or a data file that links out: every
    load refuses it, trusted or not, even with a matching recorded checksum."""
    path = str(tmp_path / "c")
    state = _state(23)
    ck.save(SPEC, state, path, mesh=_mesh())
    meta = os.path.join(path, ".metadata")
    with open(meta, "rb") as f:
        md = pickle.load(f)
    names = sorted({s.relative_path for s in md.storage_data.values()})
    moved = {"parent": "../outside/{}", "folder": "sub/{}", "link": "{}"}[how]
    for name in names:
        where = Path(path, moved.format(name))
        where.parent.mkdir(parents=True, exist_ok=True)
        if how == "link":
            shutil.move(os.path.join(path, name), tmp_path / name)
            os.symlink(tmp_path / name, os.path.join(path, name))
        else:
            shutil.copyfile(os.path.join(path, name), where)
    for info in md.storage_data.values():
        info.relative_path = moved.format(info.relative_path)
    Path(meta).write_bytes(pickle.dumps(md))
    marker = json.loads(Path(path, ck.MARKER).read_text())
    marker[ig.METADATA_CHECKSUM] = checksum(Path(meta).read_bytes())
    Path(path, ck.MARKER).write_text(json.dumps(marker))
    target = _state(24)
    before = _snapshot(target)
    with pytest.raises(ck.CheckpointError) as e:
        ck.load(SPEC, target, path, mesh=_mesh(), trusted=trusted)
    assert ".metadata" in str(e.value) and "data file" in str(e.value), e.value
    assert "\n" not in str(e.value)
    assert _diff(before, _snapshot(target)) == []
