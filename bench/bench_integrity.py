"""Checkpoint integrity: save and load throughput with checksums against without.

    python -m bench.bench_integrity                    # both parts, about 15 minutes
    python -m bench.bench_integrity --part io --rounds 9
    python -m bench.bench_integrity --part hash

Part ``io``: the I/O set-up of ``bench/bench_checkpoint.py`` (4 gloo CPU ranks, mesh
dp_shard 2 x tp 2, the 128M-parameter Llama with Adam state: the ``full`` state dict,
1.535 GB logical), through the generated planners. Every round times, in alternating
order:

* saves, ``dcp.save(state, storage_writer=W, planner=SavePlanner)`` with ``W``:
  ``plain`` (DCP's ``FileSystemWriter``), ``rowsum64`` (``ChecksumWriter``, the default
  checksum), ``crc32`` (``ChecksumWriter(algorithm="crc32")``), and two ways to compute
  CRC-32 that ``ChecksumWriter`` does not use: ``crc32-inline``, in the writer's own pass
  over the bytes (each ``write`` call of the stream hashed as it is written), and
  ``crc32-thread``, by a thread per rank that hashes what was written (read back from the
  page cache) while the writer goes on writing and syncing;
* loads, warm (page cache) and cold (pages dropped with ``posix_fadvise(DONTNEED)``),
  through shardspec's ``load()`` (validated, staged, committed after every rank's reads)
  and through plain ``dcp.load`` with the generated ``LoadPlanner``: ``plain`` is DCP's
  ``FileSystemReader``, ``rowsum64`` ``ChecksumReader`` (hashing in the copy it makes
  anyway), ``rowsum64-upfront`` ``ChecksumReader(fused=False)`` (a copy of each item,
  verified before it is parsed), all three reading the checkpoint of the ``rowsum64``
  save: the same bytes in the same files (a load's speed depends on which files it
  reads, by more than the checksums cost); ``crc32`` reads the ``crc32`` save's. The
  inline and thread saves store CRC-32s that load as ``crc32`` does; not loaded again.

Throughput is the logical size over the slowest rank's wall time between two barriers;
"paired" is the median over rounds of the ratio within one round. Round 0 is untimed:
warm-up, a round-trip check of every load (live tensors zeroed, loaded, compared with what
was saved) and a count of verified items.

Part ``hash``: each candidate checksum's speed, in this process on one thread, over a
256 MiB file read through a private memory map (no copy), and on two threads. Then the
floor of a fused load: the same file read from the page cache with ``readinto`` in blocks
of several sizes, plain and with the default checksum's row sums of each block right after
it is read (what ``ChecksumReader`` does in the copy it makes anyway), on the reading
thread or on a second one, best of 7.

Rank 0 also times unpickling the ``rowsum64`` checkpoint's ``.metadata`` with ``pickle``
and with ``shardspec.runtime.checkpoint.trust.loads_metadata`` (the allowlisting unpickler).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import queue
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import bench_checkpoint as bc

TARGET = 0.95  # with checksums / without, save and load throughput
SAVES = ("plain", "rowsum64", "rowsum64-readback", "crc32", "crc32-inline", "crc32-thread")
LOADS = ("plain", "rowsum64", "rowsum64-upfront", "crc32")
HASH_MIB = 256


# ----------------------------------------------------------------------------- writers


class _CrcStream(io.RawIOBase):
    """A write stream that computes CRC-32 of what is written between two ``tell`` calls
    (DCP's ``_write_item`` calls ``tell`` before and after each item), either in the
    writer's own pass (``inline``) or on a thread reading the written range back."""

    def __init__(self, raw: Any, marks: dict[int, int], worker: _Worker | None) -> None:
        super().__init__()
        self.raw, self.marks, self.worker = raw, marks, worker
        self.crc = 0
        self.pos = raw.tell()

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self.raw.write(b)
        if self.worker is None:
            self.crc = zlib.crc32(b, self.crc)
        else:
            self.worker.put(("data", self.pos, n))
        self.pos += n
        return n

    def tell(self) -> int:
        if self.worker is None:
            self.marks[self.pos] = self.crc
            self.crc = 0
        else:
            self.raw.flush()
            self.worker.put(("mark", self.pos, 0))
        return self.pos

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if self.worker is not None and not self.closed:
            self.raw.flush()
            self.worker.finish()
        super().close()


class _Worker:
    """The ``crc32-thread`` hasher of one file: reads written ranges back with ``pread`` on
    its own descriptor, in order, while the writer goes on."""

    def __init__(self, path: Any, marks: dict[int, int]) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        self.marks = marks
        self.q: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def put(self, item: tuple[str, int, int]) -> None:
        self.q.put(item)

    def _run(self) -> None:
        crc = 0
        try:
            while True:
                kind, pos, n = self.q.get()
                if kind == "stop":
                    return
                if kind == "mark":
                    self.marks[pos] = crc
                    crc = 0
                else:
                    crc = zlib.crc32(os.pread(self.fd, n, pos), crc)
        except BaseException as e:  # reported by finish()
            self.error = e

    def finish(self) -> None:
        self.q.put(("stop", 0, 0))
        self.thread.join()
        os.close(self.fd)
        if self.error is not None:
            raise self.error


def _crc_writer(mode: str) -> type:
    """A ``FileSystemWriter`` storing ``crc32:`` checksums computed ``inline`` or on a
    ``thread`` (module docstring); its checkpoints load through ``ChecksumReader``."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.futures import Future

    class CrcFileSystem(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.marks: dict[str, dict[int, int]] = {}

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode_: str):
            if "w" not in mode_:
                with super().create_stream(path, mode_) as s:
                    yield s
                return
            marks = self.marks.setdefault(os.path.basename(os.fspath(path)), {})
            with super().create_stream(path, mode_) as raw:
                worker = _Worker(path, marks) if mode == "thread" else None
                stream = _CrcStream(raw, marks, worker)
                try:
                    yield stream
                finally:
                    stream.close()

    class CrcWriter(FileSystemWriter):
        def __init__(self, path: Any) -> None:
            super().__init__(path)
            self.fs = CrcFileSystem()

        def write_data(self, plan: Any, planner: Any) -> Future:
            results = super().write_data(plan, planner).wait()
            for r in results:
                info = r.storage_data
                crc = self.fs.marks[info.relative_path][info.offset + info.length]
                info.checksum = f"crc32:{crc:08x}"
            fut: Future = Future()
            fut.set_result(results)
            return fut

    return CrcWriter


# ----------------------------------------------------------------------------- I/O part


def _io_rank(rank: int, world: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from shardspec.runtime import checkpoint as ckpt
    from shardspec.runtime import dtensor as rt
    from shardspec.runtime.checkpoint.integrity import ChecksumReader, ChecksumWriter

    torch.set_num_threads(1)  # 4 ranks share the cores
    t_setup = time.perf_counter()
    spec = bc.bench_spec(opts["model"])
    mesh = rt.build_mesh(spec, **opts["sizes"])
    state = bc.build_state(spec, mesh, opts["model"], opts["adam"])
    size = bc.logical_bytes(state)
    reference = {k: bc._local(v).clone() for k, v in bc._tensors(state).items()}
    workdir = opts["workdir"]
    saves, loads = opts["saves"], opts["loads"]
    writers: dict[str, Callable[[str], Any]] = {
        "plain": dcp.FileSystemWriter,
        "crc32-inline": _crc_writer("inline"),
        "crc32-thread": _crc_writer("thread"),
    }

    def path(kind: str) -> str:
        # What a load reads: the checkpoint its checksum's save wrote; DCP's own reader
        # reads the rowsum64 one, so with and without verification read the same files.
        base = kind.split("-")[0]
        return os.path.join(workdir, "rowsum64" if base == "plain" else base)

    def writer(kind: str) -> Any:
        make = writers.get(kind)
        if make is not None:
            return make(os.path.join(workdir, kind))
        alg, _, how = kind.partition("-")
        return ChecksumWriter(os.path.join(workdir, kind), algorithm=alg, fused=how != "readback")

    def reader(kind: str) -> Any:
        if kind == "plain":
            return dcp.FileSystemReader(path(kind))
        return ChecksumReader(path(kind), fused=not kind.endswith("-upfront"))

    verified: dict[str, int] = {}

    def save(kind: str) -> None:
        dcp.save(state, storage_writer=writer(kind), planner=ckpt.ShardspecSavePlanner(spec, mesh))

    def load(how: str, kind: str) -> None:
        r = reader(kind)
        if how == "load()":
            ckpt.load(spec, state, path(kind), mesh=mesh, storage_reader=r)
        else:
            dcp.load(state, storage_reader=r, planner=ckpt.ShardspecLoadPlanner(spec, mesh))
        verified[f"{how}:{kind}"] = getattr(r, "verified", 0)

    def timed(fn: Callable[[], None]) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        dist.barrier()
        return time.perf_counter() - t0, time.process_time() - c0

    def barrier_after(fn: Callable[[], None]) -> None:
        if rank == 0:
            fn()
        dist.barrier()

    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    info: dict[str, Any] = {"size": size, "checks": {}, "verified": {}}
    info["setup_s"] = time.perf_counter() - t_setup
    for rnd in range(opts["rounds"] + 1):
        flip = rnd % 2 == 1
        for kind in reversed(saves) if flip else saves:
            folder = os.path.join(workdir, kind)
            barrier_after(lambda: shutil.rmtree(folder, ignore_errors=True))  # noqa: B023
            t, c = timed(lambda: save(kind))  # noqa: B023
            if rnd:
                times.setdefault(f"save:{kind}", []).append(t)
                cpu.setdefault(f"save:{kind}", []).append(c)
        ops = [(how, kind) for how in ("load()", "dcp.load") for kind in loads]
        for temp in ("warm", "cold"):
            for how, kind in reversed(ops) if flip else ops:
                if temp == "cold":
                    barrier_after(lambda: bc._evict(path(kind)))  # noqa: B023
                tag = f"{how}:{kind}:{temp}"
                if rnd == 0 and temp == "warm":
                    with torch.no_grad():
                        for v in bc._tensors(state).values():
                            bc._local(v).zero_()
                t, c = timed(lambda: load(how, kind))  # noqa: B023
                if rnd:
                    times.setdefault(tag, []).append(t)
                    cpu.setdefault(tag, []).append(c)
                elif temp == "warm":
                    bad = [
                        k
                        for k, v in bc._tensors(state).items()
                        if not torch.equal(bc._local(v), reference[k])
                    ]
                    info["checks"][f"{how}:{kind}"] = bad
                    info["verified"][f"{how}:{kind}"] = verified[f"{how}:{kind}"]
        if rnd == 0 and rank == 0 and "rowsum64" in saves:
            info["metadata"] = _unpickle_times(os.path.join(workdir, "rowsum64", ".metadata"))
    info["times"], info["cpu"] = times, cpu
    return info


def _unpickle_times(path: str, repeat: int = 5) -> dict[str, float]:
    """Best-of times to unpickle ``path`` with ``pickle`` and with the allowlisting
    unpickler of ``shardspec.runtime.checkpoint.trust``, and its size."""
    import pickle

    from shardspec.runtime.checkpoint.trust import loads_metadata

    data = Path(path).read_bytes()
    return {
        "bytes": len(data),
        "pickle": min(_timed(lambda: pickle.loads(data)) for _ in range(repeat)),
        "trust": min(_timed(lambda: loads_metadata(data)) for _ in range(repeat)),
    }


def run_io(
    model: dict[str, int] | None = None,
    *,
    rounds: int = 7,
    world: int = bc.IO_WORLD,
    sizes: dict[str, int] | None = None,
    saves: tuple[str, ...] = SAVES,
    loads: tuple[str, ...] = LOADS,
    workdir: str | None = None,
) -> dict:
    """The I/O part on ``world`` gloo ranks: per-op times (max over ranks per round), CPU
    (summed over ranks), round-trip checks and verified item counts per rank."""
    from shardspec.testing import run_ranks

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="shardspec-bench-integrity-")
    opts = dict(
        model=model if model is not None else bc.IO_MODEL,
        rounds=rounds,
        adam=True,
        sizes=sizes if sizes is not None else bc.IO_SIZES,
        workdir=workdir,
        saves=tuple(saves),
        loads=tuple(loads),
    )
    try:
        per_rank = run_ranks(_io_rank, world, opts, timeout=900.0)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    first = per_rank[0]
    times = {
        tag: [max(r["times"][tag][i] for r in per_rank) for i in range(rounds)]
        for tag in first["times"]
    }
    cpu = {
        tag: [sum(r["cpu"][tag][i] for r in per_rank) for i in range(rounds)]
        for tag in first["cpu"]
    }
    tp = opts["sizes"]["tp"]
    checks = {
        tag: sorted({k for r in per_rank for k in r["checks"][tag]}) for tag in first["checks"]
    }
    verified = {tag: [r["verified"][tag] for r in per_rank] for tag in first["verified"]}
    metadata = first.get("metadata")
    return dict(
        times=times,
        cpu=cpu,
        size=first["size"],
        checks=checks,
        verified=verified,
        setup_s=max(r["setup_s"] for r in per_rank),
        world=world,
        tp=tp,
        rounds=rounds,
        model=opts["model"],
        saves=list(saves),
        loads=list(loads),
        metadata=metadata,
    )


def _ratio(base: list[float], t: list[float]) -> tuple[float, float, float]:
    """Throughput of ``t`` relative to ``base`` (times): best, median, paired median."""
    paired = statistics.median(b / x for b, x in zip(base, t, strict=True))
    return min(base) / min(t), statistics.median(base) / statistics.median(t), paired


def io_report(res: dict) -> list[str]:
    times, cpu, size = res["times"], res["cpu"], res["size"]
    tp = res.get("tp", 2)
    out = [
        f"Model: Llama {res['model']}, Adam state; full state dict {size / bc.GB:.3f} GB "
        f"(logical). {res['world']} gloo ranks, mesh dp_shard {res['world'] // tp} x tp {tp}, "
        "generated planners; "
        f"{res['rounds']} timed rounds after 1 untimed round, operations in alternating order.",
        "",
    ]
    groups = [("save", "save", ("",), res["saves"])]
    groups += [(how, how, (":warm", ":cold"), res["loads"]) for how in ("load()", "dcp.load")]
    for title, prefix, temps, kinds in groups:
        for temp in temps:
            head = f"{title}{' (' + temp[1:] + ')' if temp else ''}"
            out.append(
                f"| {head} | GB/s best | GB/s median | time median | vs plain: best / median "
                "/ paired | CPU s (all ranks), median | CPU vs plain |"
            )
            out.append("|---|---:|---:|---:|---:|---:|---:|")
            base = times[f"{prefix}:plain{temp}"]
            base_cpu = cpu[f"{prefix}:plain{temp}"]
            for kind in kinds:
                tag = f"{prefix}:{kind}{temp}"
                t, c = times[tag], cpu[tag]
                gbs = [size / bc.GB / x for x in t]
                ratio = cratio = "-"
                if kind != "plain":
                    best, med, paired = _ratio(base, t)
                    ratio = f"{best:.2f}x / {med:.2f}x / **{paired:.2f}x**"
                    cratio = f"{statistics.median(c) / statistics.median(base_cpu):.2f}x"
                out.append(
                    f"| {kind} | {max(gbs):.2f} | {statistics.median(gbs):.2f} | "
                    f"{bc._ms(statistics.median(t))} | {ratio} | {statistics.median(c):.2f} | "
                    f"{cratio} |"
                )
            out.append("")
    bad = {k: v for k, v in res["checks"].items() if v}
    out.append(
        "Round-trip check (round 0, every load, every rank): "
        + ("all equal" if not bad else "MISMATCH: " + json.dumps(bad))
        + ". Items verified per rank and load: "
        + "; ".join(f"{k} {v}" for k, v in res["verified"].items() if not k.endswith(":plain"))
        + "."
    )
    md = res.get("metadata")
    if md:
        out.append(
            f"Unpickling the checkpoint's `.metadata` ({md['bytes'] / 1e3:.0f} kB) on rank 0, best "
            f"of 5: `pickle` {md['pickle'] * 1e3:.1f} ms, the allowlisting unpickler "
            f"(`trust.loads_metadata`, with its structure check) {md['trust'] * 1e3:.1f} ms."
        )
    out.append(f"Set-up per rank: {res['setup_s']:.1f} s.")
    return out


def verdicts(res: dict) -> list[str]:
    """Paired throughput ratios of the default checksum against plain, with the target."""
    out = []
    times = res["times"]
    for prefix, temps in (
        ("save", ("",)),
        ("load()", (":warm", ":cold")),
        ("dcp.load", (":warm", ":cold")),
    ):
        for temp in temps:
            base, t = times.get(f"{prefix}:plain{temp}"), times.get(f"{prefix}:rowsum64{temp}")
            if base and t:
                paired = _ratio(base, t)[2]
                verdict = "met" if paired >= TARGET else "missed"
                out.append(f"{prefix}{temp}: {paired:.2f}x ({verdict})")
    return out


# ----------------------------------------------------------------------------- hash part


def run_hash(mib: int = HASH_MIB, repeat: int = 5, workdir: str | None = None) -> list[dict]:
    """Each candidate's speed (GB/s, best of ``repeat``) over a ``mib`` MiB file of random
    bytes, mapped as ``ChecksumReader`` maps it, on one thread. ``thread x2`` rows hash two
    halves on two threads at once (what a hashing thread can add when a core is free)."""
    import mmap

    import torch

    from shardspec.runtime.checkpoint.integrity import ALGORITHMS, checksum

    torch.set_num_threads(1)
    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="shardspec-bench-hash-")
    path = os.path.join(workdir, "data")
    n = mib << 20
    _random_file(path, mib)
    rows = []
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), n, access=mmap.ACCESS_COPY)
            for alg in ALGORITHMS:
                checksum(mapped, n, 0, alg)  # fault the map in
                best = min(_timed(lambda: checksum(mapped, n, 0, alg)) for _ in range(repeat))  # noqa: B023
                rows.append({"algorithm": alg, "threads": 1, "gbs": n / best / bc.GB})
            half = n // 2
            for alg in ("crc32", ALGORITHM_DEFAULT):

                def two(alg: str = alg) -> None:
                    ts = [
                        threading.Thread(target=checksum, args=(mapped, half, i * half, alg))
                        for i in range(2)
                    ]
                    for t in ts:
                        t.start()
                    for t in ts:
                        t.join()

                best = min(_timed(two) for _ in range(repeat))
                rows.append({"algorithm": alg, "threads": 2, "gbs": n / best / bc.GB})
            with contextlib.suppress(BufferError):
                mapped.close()
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


ALGORITHM_DEFAULT = "rowsum64"
FLOOR_BLOCKS = (4 << 20, 1 << 20, 256 << 10)  # 4 MiB: ChecksumReader's block


def _random_file(path: str, mib: int) -> None:
    rng = random.Random(0)
    with open(path, "wb") as f:
        for _ in range(mib):
            f.write(rng.randbytes(1 << 20))


def run_floor(mib: int = HASH_MIB, repeat: int = 7, workdir: str | None = None) -> list[dict]:
    """A warm read of a ``mib`` MiB file into one buffer, ``readinto`` a block at a time,
    plain and with each block's row sums taken right after it is read (``_Sums.fill``, as
    the fused load does): GB/s, best of ``repeat``, per block size."""
    from shardspec.runtime.checkpoint.integrity import _ROW_BYTES, _Sums

    own = workdir is None
    workdir = workdir or tempfile.mkdtemp(prefix="shardspec-bench-floor-")
    path = os.path.join(workdir, "floor")
    n = mib << 20
    _random_file(path, mib)
    dest = bytearray(n)
    view = memoryview(dest)
    sums = _Sums(n // _ROW_BYTES)

    def read(block: int, how: str) -> None:
        """``how``: "plain", "summed" (on this thread) or "thread" (on a second thread,
        handed each block as it is read: numpy lets go of the GIL while it sums)."""
        todo: queue.SimpleQueue = queue.SimpleQueue()

        def worker() -> None:
            while (job := todo.get()) is not None:
                sums.fill(dest, *job)

        helper = threading.Thread(target=worker) if how == "thread" else None
        if helper is not None:
            helper.start()
        with open(path, "rb", buffering=0) as f:
            got = 0
            while got < n:
                k = f.readinto(view[got : got + block])
                r0 = got // _ROW_BYTES
                if how == "summed":
                    sums.fill(dest, got, r0, r0 + k // _ROW_BYTES)
                elif how == "thread":
                    todo.put((got, r0, r0 + k // _ROW_BYTES))
                got += k
        if helper is not None:
            todo.put(None)
            helper.join()

    rows = []
    try:
        read(FLOOR_BLOCKS[0], "summed")  # the file into the page cache, the buffer faulted in
        for block in FLOOR_BLOCKS:
            row: dict[str, Any] = {"block": block}
            for how in ("plain", "summed", "thread"):
                row[how] = n / min(_timed(lambda: read(block, how)) for _ in range(repeat)) / bc.GB  # noqa: B023
            rows.append(row)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    return rows


def floor_report(rows: list[dict]) -> list[str]:
    out = [
        "| block | plain GB/s | row sums, same thread | ratio | row sums, second thread | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p, s, t = r["plain"], r["summed"], r["thread"]
        kib = r["block"] >> 10
        out.append(f"| {kib} KiB | {p:.2f} | {s:.2f} | {s / p:.3f}x | {t:.2f} | {t / p:.3f}x |")
    return out


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hash_report(rows: list[dict]) -> list[str]:
    out = ["| checksum | threads | GB/s (best) |", "|---|---:|---:|"]
    for r in rows:
        out.append(f"| {r['algorithm']} | {r['threads']} | {r['gbs']:.2f} |")
    return out


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", choices=("io", "hash", "all"), default="all")
    ap.add_argument("--rounds", type=int, default=7, help="timed I/O rounds (default 7)")
    ap.add_argument("--saves", default=",".join(SAVES), help="writers to time")
    ap.add_argument("--loads", default=",".join(LOADS), help="readers to time")
    ap.add_argument("--workdir", help="checkpoint folder (default: a new one under $TMPDIR)")
    ap.add_argument("--json", help="also write the raw results here")
    ap.add_argument(
        "--world",
        type=int,
        default=bc.IO_WORLD,
        help=f"gloo ranks for the I/O part (default {bc.IO_WORLD}; 2 gives each rank a core here)",
    )
    ap.add_argument("--tp", type=int, default=bc.IO_SIZES["tp"], help="tp axis size (default 2)")
    args = ap.parse_args(argv)
    if args.world < 1 or args.tp < 1 or args.world % args.tp:
        ap.error(f"--tp {args.tp} must divide --world {args.world} (both at least 1)")
    args_text = argv if argv is not None else sys.argv[1:]
    started, load0 = time.time(), os.getloadavg()[0]
    workdir = args.workdir or tempfile.mkdtemp(prefix="shardspec-bench-integrity-")
    lines = [
        f"Command: `python -m bench.bench_integrity {' '.join(args_text)}`".rstrip() + "  ",
        f"Machine: {bc.machine(workdir)}  ",
        f"Date: {datetime.date.today().isoformat()}; code: {bc._revision()}  ",
    ]
    raw: dict[str, Any] = {}
    body: list[str] = []
    try:
        if args.part in ("hash", "all"):
            print("hash part ...", file=sys.stderr)
            rows = run_hash(workdir=workdir)
            raw["hash"] = rows
            body += ["", f"#### Checksum speed ({HASH_MIB} MiB, mapped, one process)", ""]
            body += hash_report(rows)
            floor = run_floor(workdir=workdir)
            raw["floor"] = floor
            body += [
                "",
                f"#### A warm read into one buffer, plain and with row sums ({HASH_MIB} MiB)",
                "",
            ]
            body += floor_report(floor)
        if args.part in ("io", "all"):
            print("I/O part ...", file=sys.stderr)
            saves = tuple(x for x in args.saves.split(",") if x)
            loads = tuple(x for x in args.loads.split(",") if x)
            if "plain" not in saves or "plain" not in loads:
                ap.error("'plain' is the baseline: time it among --saves and --loads")
            for kind in loads:
                base = kind.split("-")[0]
                if (base if base != "plain" else "rowsum64") not in saves:
                    ap.error(f"loads of {kind!r} read what the {base!r} save writes: add it")
            res = run_io(
                rounds=args.rounds,
                saves=saves,
                loads=loads,
                workdir=workdir,
                world=args.world,
                sizes={"tp": args.tp},
            )
            raw["io"] = res
            body += ["", "#### Save and load throughput, with checksums and without", ""]
            body += io_report(res)
            body += ["", "Paired ratios of the default checksum (rowsum64) against plain:"]
            body += [f"- {v}" for v in verdicts(res)]
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    lines.append(
        f"Load: 1-minute load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"whole run {time.time() - started:.0f} s  "
    )
    print("\n".join(lines + body))
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1, default=str), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
