"""Checksums for DCP checkpoints: one per stored chunk, written with it, verified on load.

:class:`ChecksumWriter` is DCP's ``FileSystemWriter`` that also records, for every item it
writes (each ``WriteItem``: a tensor chunk or a pickled object), a checksum of the item's
stored bytes: the whole record ``torch.save`` wrote for it (zip headers, pickle, data).
:class:`ChecksumReader` is DCP's ``FileSystemReader`` that checks every item it reads
against that checksum and raises :class:`CheckpointError` naming the file, the key and the
chunk (its offsets) on a mismatch or a short file::

    dcp.save(state, storage_writer=ChecksumWriter(path), planner=...)
    load(spec, state, path, storage_reader=ChecksumReader(path))   # verify=False skips

**Where the checksums live.** In the checkpoint's ``.metadata``, as one more attribute,
``checksum``, of the ``_StorageInfo`` DCP records for each item (file, offset, length).
DCP pickles that object's ``__dict__``, so the attribute travels with it, and DCP's
readers ignore it: plain ``dcp.load`` reads such a checkpoint as any other. A checkpoint
without checksums (written by DCP's own writer) loads through :class:`ChecksumReader`
unverified, unless ``require=True``. No extra file to keep in step: the checksums are
written atomically with the metadata.

**The checksum** (``rowsum64``; ``bench/RESULTS.md``, "Checkpoint integrity", has the
measurements that chose it): the stored bytes as little-endian 64-bit words in rows of 512
words (4 KiB); the row sums modulo 2**64 (a vectorized reduction on the calling thread,
numpy's where it is installed, tens of GB/s);
CRC-32 over the row sums, then over the bytes after the last whole row; and the sum of all
words modulo 2**64. A change confined to one 8-byte word (every single-byte flip) changes
that sum, so it is always detected; a change in the last partial row is a change to CRC-32's
input; other changes pass only if they keep both the sum and the CRC. Truncation is caught
by length. zlib's CRC-32 over every byte (about 3.7 GB/s here: 0.27 s of CPU per GB) costs
a third of a warm ``load()``'s own CPU time. Failures are :class:`ChecksumError`.

**No extra pass over the bytes.** Loading already copies every byte once, from the page
cache into the tensor ``torch.load`` builds. The reader hashes each block of that copy
right after it lands (4 MiB at a time, while it is in cache), and reads back only the few
rows ``torch.load`` never reads (parts of zip headers). Writing is the same: each block
is hashed as the writer's stream writes it (the ~40 small writes of an item's zip headers
are gathered and passed on together). The verdict on an item's bytes is reached when
``FileSystemReader.read_data`` closes the item's file, still inside ``read_data``: a
mismatch raises there, so ``dcp.load`` fails, and shardspec's ``load`` (which stages what
was read and commits only after every rank's reads succeeded) leaves the model unchanged.
``torch.load`` may thus parse a damaged record before the verdict; it does so with
``weights_only=True``, and any error it raises is replaced by the checksum's, which names
the item. Pickled (non-tensor) items are verified before anything parses them, since
DCP's planners unpickle them with the full unpickler. Where DCP reads a file by another
path than the reader's file system (other torch versions), every item is verified before
it is parsed, from a copy. The reader keeps DCP's ``read_data`` (it overrides
``_slice_file`` and the file system), so shardspec's ``load`` still keeps the chunks as
read as its staging (``reader_fills_sinks``).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import pickle
import struct
import sys
import threading
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import torch

try:
    import numpy as _np
except ImportError:  # optional: see _Sums
    _np = None  # type: ignore[assignment]
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.futures import Future

from shardspec.runtime.checkpoint.folders import MARKER, _read_marker
from shardspec.runtime.checkpoint.metadata import _short, coverage_problem, storage_problem
from shardspec.runtime.units import CheckpointError

ALGORITHM = "rowsum64"
# The key of a checkpoint's completion marker (.shardspec.json) that holds the checksum of
# its .metadata, written by ``save`` once DCP has written the .metadata.
METADATA_CHECKSUM = "metadata_checksum"


class ChecksumError(CheckpointError):
    """A stored item that does not match its checksum, or a data file shorter than the
    metadata says (raised by :class:`ChecksumReader`, naming the file, key and chunk)."""


_HASHLIB = ("md5", "sha1", "sha256", "blake2b")
# rowsum64 and, for comparison (bench/bench_integrity.py), zlib's and hashlib's.
ALGORITHMS = (ALGORITHM, "crc32", "adler32", *_HASHLIB)
_ROW = 512  # words per row
_ROW_BYTES = 8 * _ROW  # 4 KiB
_BLOCK = 4 << 20  # bytes hashed right after they are copied: in cache still
_SMALL = 64 << 10  # writes smaller than this are gathered, then written and hashed at once
_MASK = (1 << 64) - 1
_LITTLE = sys.byteorder == "little"  # rowsum64's words are little-endian


def _check_algorithm(algorithm: str) -> None:
    if algorithm not in ALGORITHMS:
        raise CheckpointError(
            f"unknown checksum algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})"
        )


def _words(buf: Any, offset: int, rows: int) -> torch.Tensor:
    """``rows`` rows of int64 words of ``buf`` from byte ``offset``, without a copy. A
    read-only buffer (what a file object's ``write`` receives) gets torch's one-time
    "not writable" warning swallowed: the words are only read."""
    mv = memoryview(buf)
    if mv.readonly:
        with _WARN_LOCK, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mv, dtype=torch.int64, count=rows * _ROW, offset=offset)
    return torch.frombuffer(mv, dtype=torch.int64, count=rows * _ROW, offset=offset)


_WARN_LOCK = threading.Lock()


class _Sums:
    """Row sums (mod 2**64) of an item's rows, in a buffer of little-endian 64-bit words:
    what CRC-32 reads. Computed with numpy where it is installed: its reductions run on
    the calling thread, one call per block. Without numpy, torch sums the rows in calls
    smaller than ATen's grain size, which also keeps them on the calling thread (see
    ``_SERIAL_ROWS``) but costs a call per 32 rows."""

    __slots__ = ("rows", "store", "view")

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self.store = bytearray(8 * rows)
        if _np is not None:
            self.view: Any = _np.frombuffer(self.store, dtype="<u8")
        else:
            self.view = (
                torch.frombuffer(self.store, dtype=torch.int64)
                if rows
                else torch.empty(0, dtype=torch.int64)
            )

    def fill(self, buf: Any, offset: int, r0: int, r1: int) -> None:
        """Rows ``r0..r1`` are the rows of ``buf`` from byte ``offset``."""
        if not _LITTLE:  # the words are little-endian by definition
            raise CheckpointError("rowsum64 checksums need a little-endian host")
        if r1 <= r0:
            return
        if _np is not None:
            words = _np.frombuffer(buf, dtype="<u8", count=(r1 - r0) * _ROW, offset=offset)
            _np.add.reduce(words.reshape(r1 - r0, _ROW), axis=1, out=self.view[r0:r1])
            return
        done, rows = 0, r1 - r0
        while done < rows:
            n = min(rows - done, _BLOCK // _ROW_BYTES)
            words = _words(buf, offset + done * _ROW_BYTES, n).view(n, _ROW)
            out = self.view[r0 + done : r0 + done + n]
            for r in range(0, n, _SERIAL_ROWS):
                torch.sum(words[r : r + _SERIAL_ROWS], dim=1, out=out[r : r + _SERIAL_ROWS])
            del words
            done += n

    def total(self, r0: int = 0, r1: int | None = None) -> int:
        """The sum of rows ``r0..r1`` (all by default), mod 2**64."""
        r1 = self.rows if r1 is None else r1
        if _np is not None:
            return int(self.view[r0:r1].sum(dtype="<u8"))
        step = _SERIAL_ROWS * _ROW
        return sum(int(self.view[i : min(i + step, r1)].sum()) for i in range(r0, r1, step)) & _MASK

    def crc(self, crc: int = 0, r0: int = 0, r1: int | None = None) -> int:
        """CRC-32 of rows ``r0..r1``' sums, continuing ``crc``."""
        r1 = self.rows if r1 is None else r1
        return zlib.crc32(memoryview(self.store)[8 * r0 : 8 * r1], crc)


# Rows summed per torch.sum call without numpy: 16,384 words, under ATen's GRAIN_SIZE
# (32,768 elements), so each call runs on the calling thread. A larger call is split over
# torch's intra-op threads, which a checkpoint thread shares with training (an asynchronous
# save) and which stall whenever a core is busy elsewhere: on 2 busy cores, 4 MiB calls on 2
# threads hashed at 0.25 GB/s against 12 GB/s on one (bench/RESULTS.md, "Checkpoint
# integrity"). numpy does it in one call per block, 3x faster on 1.3 MB items.
_SERIAL_ROWS = 32


def _row_sum(row: bytearray) -> int:
    """The sum of one row's words, mod 2**64."""
    if _np is not None:
        return int(_np.frombuffer(row, dtype="<u8").sum(dtype="<u8"))
    return sum(struct.unpack(f"<{_ROW}q", row)) & _MASK


def _digest(crc: int, total: int) -> str:
    return f"{ALGORITHM}:{crc & 0xFFFFFFFF:08x}:{total & _MASK:016x}"


def checksum(
    buf: Any, length: int | None = None, start: int = 0, algorithm: str = ALGORITHM
) -> str:
    """The checksum of ``buf[start:start + length]``, as stored: ``<algorithm>:<hex>``.
    ``rowsum64`` is the default (module docstring); ``crc32``, ``adler32`` (zlib) and
    hashlib's ``md5``, ``sha1``, ``sha256`` and ``blake2b`` verify the same way, from a
    copy of the item, and are there for comparison."""
    _check_algorithm(algorithm)
    view = memoryview(buf).cast("B")
    if length is None:
        length = len(view) - start
    if algorithm != ALGORITHM:
        part = view[start : start + length]
        if algorithm in ("crc32", "adler32"):
            return f"{algorithm}:{getattr(zlib, algorithm)(part):08x}"
        return f"{algorithm}:{hashlib.new(algorithm, part).hexdigest()}"
    rows = length // _ROW_BYTES
    sums = _Sums(rows)
    sums.fill(view, start, 0, rows)
    crc = zlib.crc32(view[start + rows * _ROW_BYTES : start + length], sums.crc())
    return _digest(crc, sums.total())


def file_checksum(path: str | os.PathLike) -> str:
    """The ``rowsum64`` checksum of a whole file (a checkpoint's ``.metadata``)."""
    with open(path, "rb") as f:
        return checksum(f.read())


class _Running:
    """``rowsum64`` of bytes that arrive in order, in pieces of any size (a write stream's
    ``write`` calls): whole rows are summed as they complete."""

    __slots__ = ("carry", "crc", "length", "total")

    def __init__(self) -> None:
        self.carry = bytearray()  # the incomplete last row
        self.crc = 0
        self.total = 0
        self.length = 0

    def update(self, data: Any) -> None:
        mv = memoryview(data)
        n = mv.nbytes
        self.length += n
        if len(self.carry) + n < _ROW_BYTES:  # a header's few bytes: no row completes
            self.carry += mv
            return
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        i = 0
        if self.carry:
            i = min(_ROW_BYTES - len(self.carry), n)
            self.carry += mv[:i]
            if len(self.carry) < _ROW_BYTES:
                return
            s = _row_sum(self.carry)
            self.total += s
            self.crc = zlib.crc32(s.to_bytes(8, "little"), self.crc)
            self.carry.clear()
        rows = (n - i) // _ROW_BYTES
        if rows:
            sums = _Sums(min(rows, _BLOCK // _ROW_BYTES))
            done = 0
            while done < rows:
                k = min(rows - done, sums.rows)
                sums.fill(mv, i + done * _ROW_BYTES, 0, k)
                self.total += sums.total(0, k)
                self.crc = sums.crc(self.crc, 0, k)
                done += k
        self.carry += mv[i + rows * _ROW_BYTES :]

    def digest(self) -> str:
        return _digest(zlib.crc32(self.carry, self.crc), self.total)


def _where(index: Any) -> str:
    """``key`` and chunk offsets of a DCP ``MetadataIndex``, for messages."""
    if index is None:
        return "an item the metadata does not name"
    offset = getattr(index, "offset", None)
    chunk = f", chunk at offsets {list(offset)}" if offset is not None else ""
    return f"key {index.fqn!r}{chunk}"


def _read_at(f: Any, offset: int, length: int) -> bytearray:
    """``length`` bytes of file object ``f`` at ``offset`` (fewer at the end of the file)."""
    buf = bytearray(length)
    f.seek(offset)
    got = 0
    mv = memoryview(buf)
    while got < length:
        n = f.readinto(mv[got:])
        if not n:
            break
        got += n
    del mv
    if got < length:
        del buf[got:]
    return buf


# ----------------------------------------------------------------------------- write


class _SummingStream(io.RawIOBase):
    """The write stream ``ChecksumWriter`` gives DCP: writes through to the file and keeps
    a running ``rowsum64`` of each run of bytes between two ``tell`` calls (DCP's
    ``_write_item`` asks the position before and after each item), hashing each block
    right after writing it. Runs are keyed by their start; ``ChecksumWriter`` uses a run
    only where it is exactly an item (else it reads the item back)."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self.raw = raw
        self.pos = raw.tell()
        self.runs: dict[int, tuple[int, str]] = {}  # start -> (length, digest)
        self._start = self.pos
        self._run = _Running()
        self._small = bytearray()  # small writes not yet passed on

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        small = self._small
        k = len(small)
        if k < _SMALL and len(b) < _ROW_BYTES:  # the ~40 headers of an item, gathered
            small += b
            n = len(small) - k
            self.pos += n
            return n
        self._drain()
        mv = memoryview(b)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        n = len(mv)
        for i in range(0, n, _BLOCK):
            self._put(mv[i : i + _BLOCK])
        self.pos += n
        return n

    def _put(self, part: Any) -> None:
        written = self.raw.write(part)
        if written is not None and written != len(part):
            raise CheckpointError(f"short write: {written} of {len(part)} bytes")
        self._run.update(part)

    def _drain(self) -> None:
        if self._small:
            self._put(self._small)
            self._small = bytearray()

    def _cut(self) -> None:
        self._drain()
        self.runs[self._start] = (self._run.length, self._run.digest())
        self._start, self._run = self.pos, _Running()

    def tell(self) -> int:
        self._cut()
        return self.pos

    def flush(self) -> None:
        self._drain()
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            self._cut()
            super().close()  # flushes
            self.raw.close()


class _WriterFileSystem(FileSystem):
    """DCP's local file system, whose write streams keep checksums (per file name)."""

    def __init__(self) -> None:
        super().__init__()
        self.runs: dict[str, dict[int, tuple[int, str]]] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        with super().create_stream(path, mode) as raw:
            stream = _SummingStream(raw)
            with self._lock:
                self.runs[os.path.basename(os.fspath(path))] = stream.runs
            try:
                yield stream
            finally:
                stream.close()


class ChecksumWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that records a checksum of every item it writes in the
    checkpoint's metadata (``_StorageInfo.checksum``). Takes ``FileSystemWriter``'s
    arguments; only its default ``torch_save`` serialization (the records the checksums
    cover are what ``FileSystemReader`` reads). ``algorithm``: ``rowsum64`` (the default,
    computed as the bytes are written) or, for comparison, one of ``ALGORITHMS``, computed
    by reading each item back from its file once the file is written (as ``rowsum64`` is
    with ``fused=False``)."""

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        algorithm: str = ALGORITHM,
        fused: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, *args, **kwargs)
        _check_algorithm(algorithm)
        fmt = getattr(self, "serialization_format", None)
        if fmt is not None and getattr(fmt, "value", "torch_save") != "torch_save":
            raise CheckpointError(
                f"ChecksumWriter writes torch_save records only, not {fmt.value}: the "
                "checksums cover what FileSystemReader reads"
            )
        self.algorithm = algorithm
        self.fused = fused
        self.summing = _WriterFileSystem()
        self.fs = self.summing
        self.read_back = 0  # items whose checksum was computed by reading the file

    def write_data(self, plan: Any, planner: Any) -> Future:
        results = super().write_data(plan, planner).wait()
        by_file: dict[str, list[Any]] = {}
        for result in results:
            info = result.storage_data
            runs = self.summing.runs.get(info.relative_path, {})
            run = runs.get(info.offset)
            if (
                self.fused
                and self.algorithm == ALGORITHM
                and run is not None
                and run[0] == info.length
            ):
                info.checksum = run[1]
            else:
                by_file.setdefault(info.relative_path, []).append(info)
        for relative, infos in by_file.items():  # from the file: what was written there
            path = self.fs.concat_path(self.path, relative)
            with open(path, "rb") as f:
                for info in infos:
                    data = _read_at(f, info.offset, info.length)
                    if len(data) != info.length:
                        raise CheckpointError(
                            f"{path}: an item of {info.length} bytes at byte {info.offset} "
                            f"was written, but the file holds {len(data)} of them"
                        )
                    info.checksum = checksum(data, algorithm=self.algorithm)
                    self.read_back += 1
        self.summing.runs.clear()
        fut: Future = Future()
        fut.set_result(results)
        return fut


# ----------------------------------------------------------------------------- read


class _Pending:
    """An item being read in fused mode: the row sums of what has been read so far."""

    __slots__ = ("covered", "length", "reader", "rows", "sinfo", "sums")

    def __init__(self, reader: ChecksumReader, sinfo: Any) -> None:
        self.reader = reader
        self.sinfo = sinfo
        self.length = int(sinfo.length)
        self.rows = self.length // _ROW_BYTES
        self.sums = _Sums(self.rows)
        self.covered: list[tuple[int, int]] = []

    def saw(self, buf: Any, buf_offset: int, item_pos: int, n: int) -> None:
        """``n`` bytes of the item from ``item_pos`` were read into ``buf`` at
        ``buf_offset``: sum the whole rows among them."""
        r0 = -(-item_pos // _ROW_BYTES)
        r1 = min((item_pos + n) // _ROW_BYTES, self.rows)
        if r1 > r0:  # buf: torch's own destination, writable (see _FusedSlice.readinto)
            at = buf_offset + r0 * _ROW_BYTES - item_pos
            self.sums.fill(buf, at, r0, r1)
            self.covered.append((r0, r1))

    def verdict(self, f: Any) -> str:
        """The item's checksum: rows never read whole are read from ``f`` now."""
        missing, at = [], 0
        for r0, r1 in sorted(self.covered):
            if r0 > at:
                missing.append((at, r0))
            at = max(at, r1)
        if at < self.rows:
            missing.append((at, self.rows))
        base = int(self.sinfo.offset)
        tail_at = self.rows * _ROW_BYTES
        tail = None
        for r0, r1 in missing:
            end = self.length if r1 == self.rows else r1 * _ROW_BYTES  # the tail with it
            data = _read_at(f, base + r0 * _ROW_BYTES, end - r0 * _ROW_BYTES)
            if len(data) < end - r0 * _ROW_BYTES:
                return "(short)"
            self.sums.fill(data, 0, r0, r1)
            if r1 == self.rows:
                tail = data[tail_at - r0 * _ROW_BYTES :]
        if tail is None:
            tail = _read_at(f, base + tail_at, self.length - tail_at)
            if len(tail) < self.length - tail_at:
                return "(short)"
        return _digest(zlib.crc32(tail, self.sums.crc()), self.sums.total())


class _FusedSlice(io.RawIOBase):
    """Bytes ``[offset, offset + length)`` of a data file, as DCP's file view reads them,
    summing each block of rows right after it is read (see :class:`_Pending`)."""

    def __init__(self, raw: Any, pending: _Pending) -> None:
        super().__init__()
        self.raw = raw
        self.pending = pending
        self.offset = int(pending.sinfo.offset)
        self.length = pending.length
        self.pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            pos = offset
        elif whence == io.SEEK_CUR:
            pos = self.pos + offset
        elif whence == io.SEEK_END:
            pos = self.length + offset
        else:
            raise ValueError(f"invalid whence {whence}")
        if pos < 0:
            raise ValueError(f"negative seek position {pos}")
        self.pos = pos
        return pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b: Any) -> int:
        pos = self.pos
        mv = b if type(b) is memoryview and b.format == "B" else memoryview(b).cast("B")
        size = len(mv)
        want = self.length - pos
        if size < want:
            want = size
        if want <= 0:
            return 0
        raw = self.raw
        raw.seek(self.offset + pos)
        if want < _ROW_BYTES:  # a header: no whole row in it (what is left over is read
            got = raw.readinto(mv if want == size else mv[:want]) or 0  # back on close)
            self.pos = pos + got
            return got
        got = 0
        while got < want:
            n = raw.readinto(mv[got : min(want, got + _BLOCK)])
            if not n:
                break
            self.pending.saw(mv, got, pos + got, n)
            got += n
        self.pos = pos + got
        return got


class _VerifyingStream:
    """A data file opened for reading by :class:`ChecksumReader`'s file system: what
    ``_slice_file`` receives. Items read from it in fused mode are judged when it closes."""

    def __init__(self, raw: Any, name: str) -> None:
        self.raw = raw
        self.name = name
        self.pending: list[_Pending] = []
        self.size = os.fstat(raw.fileno()).st_size

    def __getattr__(self, attr: str) -> Any:  # a file object to anyone else
        return getattr(self.raw, attr)

    def judge(self) -> ChecksumError | None:
        """The first item whose bytes do not match its checksum, as an error."""
        pending, self.pending = self.pending, []
        for item in pending:
            got = item.verdict(self.raw)
            expected = item.sinfo.checksum
            if got != expected:
                return item.reader._mismatch(self.name, item.sinfo, got)
            item.reader.verified += 1
        return None


class _ReaderFileSystem(FileSystem):
    """DCP's local file system, whose read streams judge the items read from them when
    ``read_data`` closes them (before it returns)."""

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "r" not in mode or "+" in mode:
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        with super().create_stream(path, mode) as raw:
            stream = _VerifyingStream(raw, os.fspath(path))
            try:
                yield stream
            except Exception as e:
                # torch.load may have choked on a damaged record: the checksum names it.
                try:
                    error = stream.judge()
                except Exception:
                    error = None
                if error is not None:
                    raise error from e
                raise
            error = stream.judge()
            if error is not None:
                raise error


class MetadataChecks:
    """Mixin for a DCP ``FileSystemReader`` (or a subclass; put it first): how ``.metadata``
    is read. Before anything is unpickled, the file's bytes are checked against the
    checksum ``save`` recorded in the completion marker (``.shardspec.json``,
    :data:`METADATA_CHECKSUM`; skipped with ``verify=False``, and where there is none);
    after, every data file it names must be a plain file inside the checkpoint folder
    (:func:`~shardspec.runtime.checkpoint.metadata.storage_problem`). Any failure is one
    :class:`CheckpointError` line naming ``.metadata``, kept in ``metadata_error`` (DCP
    swallows it, retries with rank-local metadata, and raises its own assertion: the
    retry raises the same error, and ``load`` reports it as it is). ``_unpickle`` is how
    the bytes become metadata (``pickle``, as DCP does; the trust boundary's allowlisting
    unpickler in :class:`~shardspec.runtime.checkpoint.trust.SafeMetadata`)."""

    metadata_error: CheckpointError | None = None
    metadata_verified = False  # .metadata matched the checksum its save recorded
    path: Any  # FileSystemReader's, which this class is mixed into
    fs: Any

    def _unpickle(self, data: bytes, where: str) -> Any:
        try:
            return pickle.loads(data)
        except (Exception, RecursionError) as e:  # damaged: whatever the opcodes made of it
            raise CheckpointError(
                f"{where} cannot be read: it is damaged or not DCP metadata "
                f"({type(e).__name__}: {_short(e)}); nothing was read"
            ) from None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        if rank is not None and self.metadata_error is not None:
            raise self.metadata_error  # the global one failed, and that is the answer
        try:
            metadata = self._checked_metadata(rank)
        except CheckpointError as e:
            self.metadata_error = e
            raise
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata

    def _checked_metadata(self, rank: int | None) -> Any:
        locate = getattr(self, "_get_metadata_path", None)
        path = os.fspath(
            locate(rank) if locate is not None else os.path.join(self.path, ".metadata")
        )
        try:
            with self.fs.create_stream(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        if rank is None and getattr(self, "verify", True):
            self._verify_metadata(path, data)
        metadata = self._unpickle(data, path)
        try:
            problem = storage_problem(metadata, os.fspath(self.path))
            if problem is None and not self.metadata_verified:  # no recorded checksum
                problem = coverage_problem(metadata)
        except Exception as e:  # an object a damaged pickle left half-built
            problem = f"{type(e).__name__}: {_short(e)}"
        if problem is not None:
            raise CheckpointError(f"{path} is damaged or refused: {problem}; nothing was read")
        return metadata

    def _verify_metadata(self, path: str, data: bytes) -> None:
        marker = _read_marker(os.fspath(self.path))
        expected = marker.get(METADATA_CHECKSUM) if marker is not None else None
        if not isinstance(expected, str):
            return  # no checksum recorded (dcp.save, an older shardspec): unverified
        algorithm = expected.split(":", 1)[0]
        got = checksum(data, algorithm=algorithm) if algorithm in ALGORITHMS else "(unknown)"
        if got != expected:
            raise ChecksumError(
                f"{path} does not match the checksum its save recorded in {MARKER} "
                f"(reads as {got}, recorded as {_short_text(expected)}): the checkpoint's "
                f".metadata (or its {MARKER}) is damaged; nothing was read"
            )
        self.metadata_verified = True


def _short_text(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class ChecksumReader(MetadataChecks, FileSystemReader):
    """DCP's ``FileSystemReader`` that verifies every item it reads against the checksum
    :class:`ChecksumWriter` stored (module docstring: how, and when). A mismatch, or a data
    file shorter than the metadata says, raises :class:`CheckpointError` naming the file,
    the key and the chunk.

    ``verify=False`` reads as ``FileSystemReader`` does. Items without a checksum (a
    checkpoint written by DCP's own writer) are read unverified unless ``require=True``;
    a checkpoint with checksums for some items and not others is refused. ``fused=False``
    verifies every item from a copy before it is parsed (slower; for comparison).
    ``verified`` counts the items verified by this reader."""

    def __init__(
        self,
        path: str | os.PathLike,
        *args: Any,
        verify: bool = True,
        require: bool = False,
        fused: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(path, *args, **kwargs)
        self.verify = verify
        self.require = require
        self.fused = fused
        self.verified = 0
        self.fs = _ReaderFileSystem()
        self._pickled: set[int] = set()  # ids of the _StorageInfo of pickled items

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args, **kwargs):
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        infos = list((self.storage_data or {}).values())
        with_sum = sum(1 for i in infos if getattr(i, "checksum", None) is not None)
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        md = getattr(metadata, "state_dict_metadata", None) or {}
        self._pickled = {
            id(info)
            for index, info in (self.storage_data or {}).items()
            if isinstance(md.get(getattr(index, "fqn", None)), BytesStorageMetadata)
        }
        if not self.verify:
            return
        if with_sum and with_sum != len(infos):
            raise ChecksumError(
                f"{self.path}: {len(infos) - with_sum} of {len(infos)} stored items have no "
                "checksum in the metadata (a checkpoint with checksums has one for each): "
                "the metadata is damaged"
            )
        if self.require and not with_sum:
            raise CheckpointError(
                f"{self.path}: the checkpoint has no checksums (written without "
                "ChecksumWriter), and this reader requires them"
            )

    def _index_of(self, sinfo: Any) -> Any:
        for index, info in (self.storage_data or {}).items():
            if info is sinfo:
                return index
        return None

    def _mismatch(self, name: str, sinfo: Any, got: str) -> ChecksumError:
        end = sinfo.offset + sinfo.length
        where = _where(self._index_of(sinfo))
        if got == "(short)":
            return ChecksumError(
                f"{name} is truncated: {where} is stored at bytes {sinfo.offset}..{end}, "
                "past the end of the file"
            )
        damaged = (
            "the data file is damaged (the .metadata matches its own checksum)"
            if self.metadata_verified
            else "the data file, or the checkpoint's .metadata that records the checksum, "
            "is damaged"
        )
        return ChecksumError(
            f"checksum mismatch in {name}: {where} (bytes {sinfo.offset}..{end}) reads as "
            f"{got}, recorded in .metadata as {_short_text(str(sinfo.checksum))}: {damaged}"
        )

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        expected = getattr(sinfo, "checksum", None)
        raw = file.raw if isinstance(file, _VerifyingStream) else file
        if not self.verify or expected is None:
            return super()._slice_file(raw, sinfo)
        name = os.path.join(os.fspath(self.path), str(sinfo.relative_path))
        algorithm = str(expected).split(":", 1)[0]
        if algorithm not in ALGORITHMS:
            raise ChecksumError(
                f"{name}: {_where(self._index_of(sinfo))} has a checksum of unknown kind "
                f"{expected!r} (known: {', '.join(ALGORITHMS)})"
            )
        offset, length = int(sinfo.offset), int(sinfo.length)
        size = file.size if isinstance(file, _VerifyingStream) else os.fstat(raw.fileno()).st_size
        if offset < 0 or length < 0 or offset + length > size:
            raise ChecksumError(
                f"{name} is truncated: {size} bytes, but {_where(self._index_of(sinfo))} is "
                f"stored at bytes {offset}..{offset + length}"
            )
        if (
            self.fused
            and _LITTLE
            and algorithm == ALGORITHM
            and isinstance(file, _VerifyingStream)
            and id(sinfo) not in self._pickled
        ):
            pending = _Pending(self, sinfo)
            file.pending.append(pending)
            return _FusedSlice(raw, pending)
        data = _read_at(raw, offset, length)  # verified before anything parses it
        got = checksum(data, algorithm=algorithm) if len(data) == length else "(short)"
        if got != expected:
            raise self._mismatch(name, sinfo, got)
        self.verified += 1
        return io.BytesIO(data)
