"""The GPU run (issue 25): shardspec's multi-rank proofs and its checkpoint / Hugging Face
benchmarks on one CUDA device, written to one JSON file.

    python -m bench.gpu_check --out DIR                 # on the GPU machine (~4 minutes)
    python -m bench.gpu_check --out DIR --device cpu    # the same code on CPU (a dry run)

Each phase runs in a process of its own, under a time limit, and adds its results to
``DIR/gpu_check.json`` as it ends (a phase that hangs or crashes costs only itself):

* ``env``: torch, CUDA, NCCL, the GPU, the host.
* ``nccl_probe``: can two processes share the one GPU over NCCL? (NCCL refuses two ranks
  on one device; the answer decides how the multi-rank phases run.)
* ``single``: one rank, the real NCCL backend that ``build_mesh`` starts: ``parallelize``
  + ``verify`` + AdamW steps of the example Llama against the same model unparallelized
  (tests/parallel_scenarios.py's ``compare_training``); save / load of model and AdamW
  state bitwise, continued training equal; a 1 GB model state (bench/bench_hf.py's
  ``MODEL``) in CUDA memory: synchronous save against ``asynchronous=True`` (the call,
  which copies to pinned host memory, and until complete), and checksums on against off
  (``ChecksumWriter`` against DCP's ``FileSystemWriter``; ``load(verify=True/False)``).
* ``hf``: one rank (``cpu:gloo,cuda:nccl``): the 1 GB Llama checkpoint
  (bench/bench_hf.py's ``write_checkpoint``) read from the page cache with plain
  ``readinto`` (the floor), and ``load_hf`` into CUDA parameters (GB/s, bytes read); the
  CUDA load equals the CPU load bitwise (the CPU path is the one the test suite compares
  with transformers); ``export_hf`` from CUDA parameters writes the original tensors.
* ``multi``: 4 processes on the one GPU, gloo collectives on CUDA tensors (NCCL cannot
  put two ranks on one device): which collectives gloo runs on CUDA; then the CPU test
  suite's own scenarios with their tensors on CUDA (module attributes patched: batches and
  models built on the device): ``compare_training`` of the example Llama (fused w13 as
  ``_StridedShard`` under FSDP2 x TP), transformers' Qwen3 and the example MoE at
  dp_shard 2 x tp 2; ``scenario_reshard`` (save at tp 2, load at tp 1, continued run
  bitwise equal to torch's own full-state reshard); the asynchronous-save scenario
  (training goes on while pinned copies are written); ``load_hf`` of a transformers
  Llama checkpoint into CUDA parameters on tp 2 x dp_shard 2 (equal to the CPU load
  bitwise, bytes read per rank) and ``export_hf`` back (transformers' tensors bitwise).
* ``ep``: 4 processes, as ``multi``: tests/ep_train_scenarios.py's training of the example
  MoE on folded views with all-to-all token dispatch (ep 2 x efsdp 2 with dense tp 2, and
  ep 4), against one process, on CUDA.

Prints a summary table last.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

PHASES: dict[str, float] = {  # phase -> time limit (s), in the order they run
    "env": 40,
    "single": 120,
    "hf": 100,
    "gloo_probe": 60,
    "multi": 200,
    "ep": 100,
    "nccl_probe": 40,
}
ROUNDS = int(os.environ.get("GPU_CHECK_ROUNDS", "3"))
GB = 1e9


# ----------------------------------------------------------------------------- helpers


def _dev() -> str:
    return os.environ.get("GPU_CHECK_DEVICE", "cuda")


def _sync() -> None:
    import torch

    if _dev() == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _single_env(port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )


def _checks_result(c: Any) -> dict:
    return {"failures": c.fail[:40], "n_failures": len(c.fail), "checks": dict(c.count)}


def _run_step(out: dict, name: str, fn: Callable[[], Any]) -> None:
    """Run one step of a phase; its result or its traceback under ``out[name]``."""
    print(f"[pid {os.getpid()}] {name}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        out[name] = fn()
    except Exception:
        out[name] = {"error": traceback.format_exc()[-3000:]}
    if isinstance(out[name], dict):
        out[name]["wall_s"] = round(time.perf_counter() - t0, 2)


def _rank_entry(
    rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, outdir: str
) -> None:
    """A rank of a multi-process phase: every rank on device 0 (``LOCAL_RANK=0``, so that
    ``build_mesh`` picks cuda:0), the default group ``backend``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from shardspec.testing import release_distributed

    try:
        import torch.distributed.nn.functional
    except ImportError:
        pass
    import faulthandler

    faulthandler.enable(all_threads=True)  # a crash in native code names its Python frames
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK="0",
    )
    if _dev() == "cuda":
        torch.cuda.set_device(0)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    torch.set_num_threads(2)
    try:
        dist.init_process_group(
            backend, rank=rank, world_size=world, timeout=timedelta(seconds=120)
        )
        dist.barrier()
        result: Any = ("ok", fn(rank, world, *args))
    except BaseException:
        result = ("error", traceback.format_exc()[-4000:])
    try:
        release_distributed()
    except BaseException:
        pass
    with open(os.path.join(outdir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    os._exit(0)  # leftover gloo threads must not abort the rank at exit


def _spawn(fn: Callable, world: int, backend: str, *args: Any) -> list[Any]:
    import torch.multiprocessing as mp

    from shardspec.testing import free_port

    with tempfile.TemporaryDirectory() as outdir:
        crash = "no result"
        try:
            mp.start_processes(
                _rank_entry,
                args=(world, free_port(), backend, fn, args, outdir),
                nprocs=world,
                join=True,
                start_method="spawn",
            )
        except Exception as e:  # a rank crashed (a signal): the others are terminated
            crash = f"no result: {type(e).__name__}: {e}"
        results = []
        for r in range(world):
            path = os.path.join(outdir, f"{r}.pkl")
            if not os.path.exists(path):
                results.append(("error", crash))
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f))
    return results


# ----------------------------------------------------------------------------- env


def phase_env() -> dict:
    import torch

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
    }
    for mod in ("transformers", "safetensors", "numpy"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as e:
            out[mod] = f"missing: {e}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {
            "gpu": props.name,
            "gpu_mem_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "nccl": ".".join(str(x) for x in torch.cuda.nccl.version()),
            "device_count": torch.cuda.device_count(),
        }
    try:
        out["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except Exception as e:
        out["nvidia_smi"] = str(e)
    return out


# ----------------------------------------------------------------------------- nccl probe


def _probe_rank(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device="cuda") * (rank + 1)
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return {"sum": t.tolist()}


def phase_nccl_probe() -> dict:
    if _dev() != "cuda":
        return {"skipped": "no CUDA (dry run)"}
    res = _spawn(_probe_rank, 2, "nccl")
    return {"ranks": [r[1] if r[0] == "ok" else r[1][-1200:] for r in res]}


# ----------------------------------------------------------------------------- single


def _device_patches() -> None:
    """Make the CPU test suite's scenarios build their batches and models on the device."""
    from tests import ckpt_async_scenarios as cas
    from tests import ep_train_scenarios as ets
    from tests import parallel_scenarios as ps

    dev = _dev()
    if getattr(ps, "_on_device", None) == dev:
        return
    batch, seeded = ps.batch, ps.seeded

    def seeded_on(*a: Any, **k: Any) -> Callable[[], Any]:
        build = seeded(*a, **k)
        return lambda: build().to(dev)

    ps.batch = lambda step, vocab: batch(step, vocab).to(dev)
    ps.seeded = seeded_on
    tokens = cas._tokens
    cas._tokens = lambda step, mesh: tokens(step, mesh).to(dev)
    llama_tiny = cas.llama.tiny

    class _Llama:  # cas.Trainer builds llama.tiny(): built on the device
        def __getattr__(self, name: str) -> Any:
            return getattr(sys.modules["examples.models.llama"], name)

        @staticmethod
        def tiny(**k: Any) -> Any:
            return llama_tiny(**k).to(dev)

    cas.llama = _Llama()
    ps.full = ets.full = _full
    if dev == "cuda" or os.environ.get("GPU_CHECK_C10D_GATHER"):
        _c10d_all_gather()
    ebatch, example = ets.batch, ets.example
    ets.batch = lambda step: ebatch(step).to(dev)
    ets.example = lambda *a, **k: example(*a, **k).to(dev)
    ps._on_device = dev


def _c10d_all_gather() -> None:
    """DTensor's all-gathers through c10d's ``all_gather_into_tensor`` instead of the
    functional collective: on CUDA tensors over gloo (the only way several ranks share one
    GPU; NCCL refuses), torch 2.11's ``_c10d_functional.all_gather_into_tensor`` crashes
    the process (SIGSEGV in ``wait_tensor``), while c10d's own all-gather works. DTensor
    calls it inside its redistribution's autograd functions, so a plain tensor will do."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import DeviceMesh

    if getattr(funcol.all_gather_tensor, "_c10d", False):
        return

    def all_gather_tensor(self: Any, gather_dim: int, group: Any, tag: str = "") -> Any:
        if isinstance(group, tuple):
            pg = group[0].get_group(group[1])
        elif isinstance(group, DeviceMesh):
            pg = group.get_group()
        else:
            pg = group
        n = dist.get_world_size(pg)
        x = self.contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))
        dist.all_gather_into_tensor(out, x, group=pg)
        return torch.cat(out.chunk(n, 0), dim=gather_dim) if gather_dim != 0 else out

    all_gather_tensor._c10d = True  # type: ignore[attr-defined]
    funcol.all_gather_tensor = all_gather_tensor


def _full(t: Any) -> Any:
    """The whole tensor of a DTensor: torch's ``full_tensor()``, or, where this torch cannot
    gather the layout (torch 2.11 cannot read a ``_StridedShard`` on a mesh dimension of its
    own as a shard order), every rank's local tensor put where the layout arithmetic (the
    one tests/test_layout_torch.py checks against torch 2.13) says it belongs."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from shardspec.core.layout import Mesh
    from shardspec.core.layout import torch_placement_indices as indices
    from shardspec.runtime.dtensor import from_torch

    if not isinstance(t, DTensor):
        return t
    try:
        return t.full_tensor()
    except ValueError:
        pass
    mesh = t.device_mesh
    places = tuple(from_torch(p, t.ndim) for p in t.placements)
    mine = (t.to_local().detach().cpu(), tuple(mesh.get_coordinate() or ()), dist.get_rank())
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    ranks = set(mesh.mesh.flatten().tolist())
    lm = Mesh(tuple(mesh.mesh_dim_names or ()), tuple(mesh.shape))
    whole = torch.empty(t.shape, dtype=t.dtype)
    for local, coord, rank in every:
        if rank in ranks:
            _put(whole, local, list(indices(tuple(t.shape), lm, places, coord)))
    return whole.to(t.device)


def _put(dst: Any, src: Any, runs: list, dim: int = 0) -> None:
    """Copy ``src`` into ``dst`` at the per-dimension index runs ``runs`` (global)."""
    if dim == len(runs):
        dst.copy_(src)
        return
    pos = 0
    for a, b in runs[dim]:
        _put(dst.narrow(dim, a, b - a), src.narrow(dim, pos, b - a), runs, dim + 1)
        pos += b - a


def _big_state(spec: Any, mesh: Any, adam: bool = False) -> dict:
    """bench/bench_hf.py's 1 GB Llama, distributed on ``mesh`` in device memory."""
    import zlib

    import torch
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from bench.bench_hf import MODEL
    from examples.models.llama import Llama, LlamaConfig
    from shardspec.runtime import dtensor as rt

    with torch.device("meta"):
        model = Llama(LlamaConfig(**MODEL))
    rt.distribute(spec, model, mesh)
    model.to_empty(device=_dev())
    with torch.no_grad():
        for name, p in model.named_parameters():
            _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{tuple(offsets)}".encode()))
            local = p.to_local()
            local.copy_(torch.empty(local.shape).normal_(0.0, 0.02, generator=gen))
    return {"model": model.state_dict()}


def _local(v: Any) -> Any:
    return v.to_local() if hasattr(v, "to_local") else v


def _async_bench(spec: Any, mesh: Any, state: dict, root: str) -> dict:
    import torch

    from shardspec.runtime import checkpoint as ck
    from shardspec.runtime.checkpoint import staging

    tensors = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
    size = sum(v.numel() * v.element_size() for v in tensors)
    # The check: the checkpoint is the state at the call, though the tensors change after.
    at_call = [_local(t).clone() for t in tensors]
    path = os.path.join(root, "async_check")
    fut = ck.save(spec, state, path, mesh=mesh, asynchronous=True)
    with torch.no_grad():
        for t in tensors:
            _local(t).add_(1.0)
    fut.result()
    pinned = [b.is_pinned() for bufs in getattr(staging, "_POOL", {}).values() for b in bufs]
    loaded = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}}
    ck.load(spec, loaded, path, mesh=mesh)
    bad = [
        k
        for (k, v), want in zip(loaded["model"].items(), at_call, strict=True)
        if not torch.equal(_local(v), want)
    ]
    with torch.no_grad():
        for t in tensors:
            _local(t).sub_(1.0)
    shutil.rmtree(path, ignore_errors=True)
    times: dict[str, list[float]] = {"sync": [], "async_blocking": [], "async_complete": []}
    for rnd in range(ROUNDS):
        for op in ("sync", "async") if rnd % 2 == 0 else ("async", "sync"):
            path = os.path.join(root, f"{op}{rnd}")
            _sync()
            t0 = time.perf_counter()
            if op == "sync":
                ck.save(spec, state, path, mesh=mesh)
                times["sync"].append(time.perf_counter() - t0)
            else:
                fut = ck.save(spec, state, path, mesh=mesh, asynchronous=True)
                times["async_blocking"].append(time.perf_counter() - t0)
                fut.result()
                times["async_complete"].append(time.perf_counter() - t0)
            shutil.rmtree(path, ignore_errors=True)
    med = {k: _median(v) for k, v in times.items()}
    return {
        "bytes": size,
        "times_s": times,
        "median_s": med,
        "blocking_over_sync": med["async_blocking"] / med["sync"],
        "check_bitwise_at_call": not bad,
        "mismatched": bad[:10],
        "staging_buffers": len(pinned),
        "staging_pinned": sum(pinned),
    }


def _checksum_bench(spec: Any, mesh: Any, state: dict, root: str) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    from shardspec.runtime import checkpoint as ck
    from shardspec.runtime.checkpoint.integrity import ChecksumWriter

    size = sum(
        v.numel() * v.element_size() for v in state["model"].values() if isinstance(v, torch.Tensor)
    )
    times: dict[str, list[float]] = {}

    def save(kind: str) -> None:
        path = os.path.join(root, kind)
        shutil.rmtree(path, ignore_errors=True)
        writer = dcp.FileSystemWriter(path) if kind == "plain" else ChecksumWriter(path)
        t = _timed(
            lambda: dcp.save(
                state, storage_writer=writer, planner=ck.ShardspecSavePlanner(spec, mesh)
            )
        )
        times.setdefault(f"save:{kind}", []).append(t)

    def load(verify: bool) -> None:
        t = _timed(
            lambda: ck.load(spec, state, os.path.join(root, "rowsum64"), mesh=mesh, verify=verify)
        )
        times.setdefault(f"load:verify={verify}", []).append(t)

    save("plain")
    save("rowsum64")
    load(True)  # warm-up: pages in the cache, plans cached
    times.clear()
    for rnd in range(ROUNDS):
        for kind in ("plain", "rowsum64") if rnd % 2 == 0 else ("rowsum64", "plain"):
            save(kind)
        for verify in (False, True) if rnd % 2 == 0 else (True, False):
            load(verify)
    med = {k: _median(v) for k, v in times.items()}
    return {
        "bytes": size,
        "times_s": times,
        "GBps": {k: size / v / GB for k, v in med.items()},
        "save_with_over_without": med["save:plain"] / med["save:rowsum64"],
        "load_with_over_without": med["load:verify=False"] / med["load:verify=True"],
    }


def _single_ckpt(layout: Any, mesh: Any, root: str) -> dict:
    """Train, save model + AdamW state, load into a fresh model, continue: bitwise."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from examples.models import llama
    from tests import parallel_scenarios as ps

    def fresh(seed: int) -> tuple[Any, Any]:
        model = ps.seeded(llama.tiny, seed=seed)()
        layout.parallelize(model, mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=ps.LR)

    model, optim = fresh(0)
    ps.train(model, optim, range(2), mesh, 256)
    msd, osd = get_state_dict(model, optim)
    path = os.path.join(root, "ckpt")
    layout.save({"model": msd, "optim": osd}, path, mesh=mesh)
    want = {k: _local(v).clone() for k, v in model.state_dict().items()}
    model_b, optim_b = fresh(7)
    msd_b, osd_b = get_state_dict(model_b, optim_b)
    st = {"model": msd_b, "optim": osd_b}
    layout.load(st, path, mesh=mesh)
    set_state_dict(model_b, optim_b, model_state_dict=st["model"], optim_state_dict=st["optim"])
    got = {k: _local(v) for k, v in model_b.state_dict().items()}
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    la = ps.train(model, optim, range(2, 4), mesh, 256)
    lb = ps.train(model_b, optim_b, range(2, 4), mesh, 256)
    return {
        "loaded_bitwise": not differ,
        "differ": differ[:10],
        "continued_losses_equal": la == lb,
        "losses": [la, lb],
    }


def phase_single() -> dict:
    from shardspec.testing import Checks, free_port

    _single_env(free_port())
    _device_patches()
    import generated.llama as layout
    from bench.bench_checkpoint import bench_spec
    from bench.bench_hf import MODEL
    from examples.models import llama
    from tests import parallel_scenarios as ps

    out: dict[str, Any] = {}
    mesh = layout.build_mesh(tp=1)  # starts NCCL on cuda (gloo on cpu)
    import torch.distributed as dist

    out["backend"] = str(dist.get_backend())

    def train() -> dict:
        c = Checks()
        ps.compare_training(c, "llama world 1", ps.seeded(llama.tiny), layout, mesh, 256)
        return _checks_result(c)

    root = tempfile.mkdtemp(prefix="gpu-check-single-")
    try:
        _run_step(out, "train_vs_one_process", train)
        _run_step(out, "save_load_continue", lambda: _single_ckpt(layout, mesh, root))
        spec = bench_spec(MODEL)
        big_mesh = _rt_mesh(spec)
        state = _big_state(spec, big_mesh)
        _run_step(out, "async_save", lambda: _async_bench(spec, big_mesh, state, root))
        _run_step(out, "checksums", lambda: _checksum_bench(spec, big_mesh, state, root))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _rt_mesh(spec: Any) -> Any:
    from shardspec.runtime import dtensor as rt

    return rt.build_mesh(spec, tp=1)


# ----------------------------------------------------------------------------- hf


def _read_floor(folder: str) -> dict:
    """The page-cache read rate of the checkpoint's files: ``readinto`` a reused buffer."""
    files = sorted(
        os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors")
    )
    size = sum(os.path.getsize(f) for f in files)
    buf = bytearray(max(os.path.getsize(f) for f in files))
    view = memoryview(buf)

    def read_all() -> None:
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                n = 0
                while True:
                    got = fh.readinto(view[n : n + (64 << 20)])
                    if not got:
                        break
                    n += got

    read_all()  # into the page cache
    times = [_timed(read_all) for _ in range(ROUNDS)]
    return {"bytes": size, "times_s": times, "GBps": size / _median(times) / GB}


def phase_hf() -> dict:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    from bench.bench_checkpoint import bench_spec
    from bench.bench_hf import MODEL, bench_hfmap, write_checkpoint
    from examples.models.llama import Llama, LlamaConfig
    from shardspec.runtime import dtensor as rt
    from shardspec.runtime import hf as rhf
    from shardspec.testing import free_port

    _single_env(free_port())
    dev = _dev()
    dist.init_process_group("cpu:gloo,cuda:nccl" if dev == "cuda" else "gloo")
    out: dict[str, Any] = {"backend": str(dist.get_backend())}
    spec, hfmap = bench_spec(MODEL), bench_hfmap(MODEL)
    root = tempfile.mkdtemp(prefix="gpu-check-hf-")
    folder = os.path.join(root, "hf")
    try:
        t = time.perf_counter()
        out["checkpoint"] = write_checkpoint(folder, MODEL)
        out["checkpoint"]["write_s"] = round(time.perf_counter() - t, 2)
        _run_step(out, "page_cache_read", lambda: _read_floor(folder))

        def model_on(device: str) -> tuple[Any, Any]:
            mesh = init_device_mesh(device, (1, 1), mesh_dim_names=spec.axes)
            with torch.device("meta"):
                model = Llama(LlamaConfig(**MODEL))
            rt.distribute(spec, model, mesh)
            model.to_empty(device=device)
            return model, mesh

        models: dict[str, Any] = {}

        def load(device: str) -> dict:
            model, mesh = model_on(device)
            reports, times = [], []
            for _ in range(ROUNDS + 1):
                with torch.no_grad():
                    for p in model.parameters():
                        _local(p).fill_(float("nan"))
                t = _timed(lambda: reports.append(rhf.load_hf(spec, hfmap, model, folder, mesh)))
                times.append(t)
            times = times[1:]  # the first fills the page cache
            rep = reports[-1]
            models[device] = (model, mesh)
            return {
                "times_s": times,
                "bytes_read": rep.bytes_read,
                "bytes_owned": rep.bytes_owned,
                "reads": rep.reads,
                "GBps": rep.bytes_read / _median(times) / GB,
            }

        _run_step(out, f"load_hf_{dev}", lambda: load(dev))
        if dev == "cuda":
            _run_step(out, "load_hf_cpu", lambda: load("cpu"))

            def same() -> dict:
                a = dict(models["cuda"][0].named_parameters())
                b = dict(models["cpu"][0].named_parameters())
                differ = [k for k in a if not torch.equal(_local(a[k]).cpu(), _local(b[k]))]
                nan = [k for k in a if torch.isnan(_local(a[k])).any()]
                return {"cuda_equals_cpu_bitwise": not differ, "differ": differ[:10], "nan": nan}

            _run_step(out, "cuda_vs_cpu", same)

        def export() -> dict:
            model, mesh = models[dev]
            dest = os.path.join(root, "export")
            t = _timed(lambda: rhf.export_hf(spec, hfmap, model, dest, mesh))
            orig: dict[str, Any] = {}
            for f in os.listdir(folder):
                if f.endswith(".safetensors"):
                    orig |= load_file(os.path.join(folder, f))
            got: dict[str, Any] = {}
            for f in os.listdir(dest):
                if f.endswith(".safetensors"):
                    got |= load_file(os.path.join(dest, f))
            differ = [k for k in orig if k not in got or not torch.equal(orig[k], got[k])]
            size = sum(v.numel() * v.element_size() for v in got.values())
            return {
                "export_s": t,
                "GBps": size / t / GB,
                "keys": len(got),
                "bitwise_equal_to_original": not differ and len(got) == len(orig),
                "differ": differ[:10],
            }

        _run_step(out, f"export_hf_{dev}", export)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()
    return out


# ----------------------------------------------------------------------------- multi


def _gloo_ops(rank: int, world: int, only: str | None = None) -> dict:
    """Which gloo collectives take CUDA tensors."""
    import torch
    import torch.distributed as dist

    dev = _dev()
    out = {}
    ops: dict[str, Callable[[], Any]] = {
        "all_reduce": lambda: dist.all_reduce(torch.ones(8, device=dev)),
        "broadcast": lambda: dist.broadcast(torch.ones(8, device=dev), 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(
            torch.empty(8 * world, device=dev), torch.ones(8, device=dev)
        ),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(
            torch.empty(8, device=dev), torch.ones(8 * world, device=dev)
        ),
        "all_to_all_single": lambda: dist.all_to_all_single(
            torch.empty(4 * world, device=dev), torch.ones(4 * world, device=dev)
        ),
        "all_to_all_single_splits": lambda: dist.all_to_all_single(
            torch.empty(sum(range(1, world + 1)), device=dev),
            torch.ones(world * (rank + 1), device=dev),
            output_split_sizes=list(range(1, world + 1)),
            input_split_sizes=[rank + 1] * world,
        ),
    }
    for name, op in ops.items():
        if only is not None and name != only:
            continue
        print(f"[rank {rank}] gloo {name} on {dev}", file=sys.stderr, flush=True)
        try:
            op()
            if dev == "cuda":
                torch.cuda.synchronize()
            out[name] = "ok"
        except Exception as e:
            out[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        dist.barrier()
    return out


MULTI_STEPS = (
    "train_llama",
    "train_qwen3",
    "train_moe_style_none",
    "reshard",
    "async_save_training",
    "hf_llama",
)
GLOO_OPS = (
    "all_reduce",
    "broadcast",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "all_to_all_single_splits",
)


FUNCOL_OPS = (
    "funcol.all_reduce",
    "funcol.all_gather_tensor dim 0",
    "funcol.all_gather_tensor dim 1",
    "funcol.reduce_scatter_tensor",
    "funcol.all_to_all_single",
)


def _funcol_rank(rank: int, world: int, name: str) -> dict:
    """One of torch's functional collectives (what DTensor's redistribute calls) on a
    CUDA tensor over gloo."""
    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    dev = _dev()
    group = dist.group.WORLD
    x = torch.arange(8 * world, dtype=torch.float32, device=dev).reshape(2 * world, 4) + rank
    print(f"[rank {rank}] {name} on {dev}", file=sys.stderr, flush=True)
    if name == "funcol.all_reduce":
        y = funcol.all_reduce(x, "sum", group)
    elif name == "funcol.all_gather_tensor dim 0":
        y = funcol.all_gather_tensor(x, 0, group)
    elif name == "funcol.all_gather_tensor dim 1":
        y = funcol.all_gather_tensor(x, 1, group)
    elif name == "funcol.reduce_scatter_tensor":
        y = funcol.reduce_scatter_tensor(x, "sum", 0, group)
    else:
        y = funcol.all_to_all_single(x, None, None, group)
    y = funcol.wait_tensor(y)
    if dev == "cuda":
        torch.cuda.synchronize()
    return {name: f"ok {tuple(y.shape)}"}


def _gloo_op_rank(rank: int, world: int, name: str) -> dict:
    return {name: _gloo_ops(rank, world, only=name).get(name)}


def _multi_rank(rank: int, world: int, step: str) -> dict:
    """One scenario of the ``multi`` phase (one spawn each: a crash costs only itself)."""
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    _device_patches()
    import generated.deepseek_moe as moe_layout
    import generated.llama as layout
    import generated.qwen3 as qwen3
    from examples.models import hf as hf_models
    from examples.models import llama, moe
    from shardspec.testing import Checks
    from tests import ckpt_async_scenarios as cas
    from tests import parallel_scenarios as ps

    out: dict[str, Any] = {}
    root = [tempfile.mkdtemp(prefix="gpu-check-multi-") if rank == 0 else ""]
    dist.broadcast_object_list(root, src=0)

    def scenario(fn: Callable[[Any], None]) -> Callable[[], dict]:
        def run() -> dict:
            c = Checks()
            try:
                fn(c)
            finally:
                dist.barrier()
            return _checks_result(c)

        return run

    def w13(c: Any) -> None:
        mesh = layout.build_mesh(tp=2)
        model = ps.seeded(llama.tiny)()
        layout.parallelize(model, mesh)
        w = model.layers["0"].feed_forward.w13.weight
        out["w13_placements"] = [str(p) for p in w.placements]
        out["w13_device"] = str(w.device)
        ps.compare_training(c, "train llama", ps.seeded(llama.tiny), layout, mesh, 256)

    steps: dict[str, Callable[[Any], None]] = {
        "train_llama": w13,
        "train_qwen3": lambda c: ps.compare_training(
            c, "train qwen3", ps.seeded(hf_models.qwen3_tiny), qwen3, qwen3.build_mesh(tp=2), 256
        ),
        "train_moe_style_none": lambda c: ps.compare_training(
            c,
            "train moe",
            ps.seeded(moe.tiny, init=moe.init_weights),
            moe_layout,
            moe_layout.build_mesh(ep=2),
            256,
        ),
        "reshard": lambda c: ps.scenario_reshard(c, root[0]),
        "async_save_training": lambda c: cas.scenario_train(c, root[0]),
        "hf_llama": lambda c: _hf_multi(c, rank, root[0]),
    }
    _run_step(out, step, scenario(steps[step]))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    out["max_memory_allocated_gib"] = (
        torch.cuda.max_memory_allocated() / 2**30 if _dev() == "cuda" else 0.0
    )
    return out


def _hf_multi(c: Any, rank: int, root: str) -> None:
    """load_hf of transformers' own Llama checkpoint into CUDA parameters (tp 2 x
    dp_shard 2): equal to the CPU load bitwise; export_hf back: transformers' tensors."""
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh

    import generated.llama as layout
    from examples.models import hf as hf_models
    from examples.models import llama

    folder = os.path.join(root, "hf")
    if rank == 0:
        import transformers

        torch.manual_seed(0)
        hf_model = transformers.LlamaForCausalLM(hf_models.llama_config(tied=False))
        hf_model.save_pretrained(folder, max_shard_size="200KB")
    dist.barrier()
    loaded = {}
    for device in (_dev(), "cpu"):
        mesh = (
            layout.build_mesh(tp=2)
            if device == _dev()
            else init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
        )
        with torch.device("meta"):
            model = llama.tiny()
        layout.parallelize(model, mesh)
        model.to_empty(device=device)
        rep = layout.load_hf(model, folder, mesh)
        loaded[device] = model
        if device == _dev():
            c.check("hf", rep.bytes_read > 0, "nothing read")
            c.count["bytes_read"] = rep.bytes_read
            c.count["bytes_owned"] = rep.bytes_owned
            dest = os.path.join(root, "export")
            layout.export_hf(model, dest, mesh, config=folder)
        if device == "cpu":
            break
    a = dict(loaded[_dev()].named_parameters())
    b = dict(loaded["cpu"].named_parameters())
    for k in a:
        c.check("hf", torch.equal(_local(a[k]).cpu(), _local(b[k])), f"{k}: device load differs")
    dist.barrier()
    if rank == 0:
        orig: dict[str, Any] = {}
        got: dict[str, Any] = {}
        for src, d in ((folder, orig), (os.path.join(root, "export"), got)):
            for f in os.listdir(src):
                if f.endswith(".safetensors"):
                    d |= load_file(os.path.join(src, f))
        c.check("hf", len(got) == len(orig), f"{len(got)} keys exported, {len(orig)} in HF")
        for k, v in orig.items():
            c.check("hf", k in got and torch.equal(v, got[k]), f"{k}: export differs")


_PHASE_OUT: list[str] = []


def _partial(result: dict) -> None:
    """Write what a phase has so far (a phase cut off by its time limit keeps it)."""
    if _PHASE_OUT:
        with open(_PHASE_OUT[0], "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, default=str)


def phase_gloo_probe() -> dict:
    """Which gloo collectives take CUDA tensors: one spawn of 2 ranks per collective (a
    crash costs only its own)."""
    out: dict[str, Any] = {}
    ops = [(n, _gloo_op_rank) for n in GLOO_OPS] + [(n, _funcol_rank) for n in FUNCOL_OPS]
    only = os.environ.get("GPU_CHECK_OPS")
    for name, fn in ops:
        if only and name not in only.split(","):
            continue
        res = _spawn(fn, 2, "gloo", name)
        out[name] = [r[1] if r[0] == "ok" else r[1][-600:] for r in res]
        _partial(out)
    return out


def phase_multi() -> dict:
    out: dict[str, Any] = {"backend": "gloo"}
    only = os.environ.get("GPU_CHECK_STEPS")
    for step in MULTI_STEPS:
        if only and step not in only.split(","):
            continue
        res = _spawn(_multi_rank, 4, "gloo", step)
        out[step] = [r[1] for r in res]
        _partial(out)
    return out


# ----------------------------------------------------------------------------- ep


EP_FOLDS = ("ep2_efsdp2_tp2", "ep4")


def _ep_rank(rank: int, world: int, tag: str) -> dict:
    import warnings

    warnings.filterwarnings("ignore")
    _device_patches()
    import generated.deepseek_moe_folded as folded
    from shardspec.testing import Checks
    from tests import ep_train_scenarios as ets

    fold = {"ep2_efsdp2_tp2": ets.FOLD_A, "ep4": ets.FOLD_EP4}[tag]

    def run() -> dict:
        c = Checks()
        ets.compare_training(c, f"train example {tag}", ets.example, folded, fold)
        return _checks_result(c)

    out: dict[str, Any] = {}
    _run_step(out, tag, run)
    return out


def phase_ep() -> dict:
    out: dict[str, Any] = {"backend": "gloo"}
    for tag in EP_FOLDS:
        res = _spawn(_ep_rank, 4, "gloo", tag)
        out[tag] = [r[1] for r in res]
        _partial(out)
    return out


# ----------------------------------------------------------------------------- driver

RUNNERS: dict[str, Callable[[], dict]] = {
    "env": phase_env,
    "nccl_probe": phase_nccl_probe,
    "single": phase_single,
    "hf": phase_hf,
    "gloo_probe": phase_gloo_probe,
    "multi": phase_multi,
    "ep": phase_ep,
}


def _phase_main(name: str, outfile: str) -> int:
    _PHASE_OUT.append(outfile)
    t0 = time.perf_counter()
    try:
        result = RUNNERS[name]()
    except Exception:
        result = {"error": traceback.format_exc()[-4000:]}
        try:
            with open(outfile, encoding="utf-8") as f:
                result = json.load(f) | result  # what the phase had written so far
        except (OSError, ValueError):
            pass
    result["phase_s"] = round(time.perf_counter() - t0, 2)
    with open(outfile, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    return 0


def _failures(obj: Any) -> int:
    """Failures and errors anywhere in a phase's result."""
    if isinstance(obj, dict):
        n = int(obj.get("n_failures", 0)) + (1 if "error" in obj else 0)
        return n + sum(_failures(v) for k, v in obj.items() if k not in ("failures",))
    if isinstance(obj, list | tuple):
        return sum(_failures(v) for v in obj)
    if isinstance(obj, str) and obj.startswith("Traceback"):
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/gpu_check")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--budget", type=float, default=330.0, help="seconds for all phases")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    os.environ["GPU_CHECK_DEVICE"] = args.device
    if args.phase:
        return _phase_main(args.phase, args.phase_out)
    os.makedirs(args.out, exist_ok=True)
    final = os.path.join(args.out, "gpu_check.json")
    # At most a few files come back from the device machine: the phases' own files go to a
    # scratch folder, their logs into one file beside the results.
    scratch = tempfile.mkdtemp(prefix="gpu-check-")
    all_logs = os.path.join(args.out, "phase_logs.txt")
    results: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device}
    start = time.perf_counter()
    env = dict(os.environ, GPU_CHECK_DEVICE=args.device, PYTHONUNBUFFERED="1")
    for name in args.phases.split(","):
        left = args.budget - (time.perf_counter() - start)
        limit = min(PHASES[name], left)
        if limit < 20:
            results[name] = {"skipped": f"out of time ({left:.0f} s left)"}
            continue
        phase_out = os.path.join(scratch, f"{name}.json")
        log = os.path.join(scratch, f"{name}.log")
        cmd = [sys.executable, "-m", "bench.gpu_check", "--device", args.device]
        cmd += ["--phase", name, "--phase-out", phase_out]
        t0 = time.perf_counter()
        with open(log, "w") as lf:
            # A session of its own: on a timeout the phase's ranks go with it.
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                rc: Any = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                rc = f"timed out after {limit:.0f} s"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        results[name] = {}
        try:
            with open(phase_out, encoding="utf-8") as f:
                results[name] = json.load(f)
        except (OSError, ValueError):
            pass
        if rc != 0 or not results[name]:
            with open(log, encoding="utf-8", errors="replace") as f:
                results[name] |= {"error": f"rc {rc}", "log_tail": f.read()[-3000:]}
        with open(log, encoding="utf-8", errors="replace") as f, open(all_logs, "a") as out:
            out.write(f"===== {name} (rc {rc})\n{f.read()[-200_000:]}\n")
        results[name]["rc"] = rc
        results[name]["wall_s"] = round(time.perf_counter() - t0, 1)
        with open(final, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
        print(
            f"[{name}] rc {rc} in {results[name]['wall_s']} s, "
            f"{_failures(results[name])} failure(s)/error(s)",
            flush=True,
        )
    print(summary(results))
    return 0


def summary(r: dict) -> str:
    """A short table of the figures that matter."""
    lines = []
    env = r.get("env", {})
    lines.append(
        f"env: {env.get('gpu', 'no GPU')}, torch {env.get('torch')}, cuda {env.get('cuda')}, "
        f"nccl {env.get('nccl')}, {env.get('cpu_count')} CPUs, python {env.get('python')}"
    )
    single = r.get("single", {})
    a = single.get("async_save", {})
    if "median_s" in a:
        m = a["median_s"]
        lines.append(
            f"async save {a['bytes'] / GB:.2f} GB: sync {m['sync']:.3f} s, blocking "
            f"{m['async_blocking']:.3f} s ({a['blocking_over_sync']:.3f}x), complete "
            f"{m['async_complete']:.3f} s, bitwise {a['check_bitwise_at_call']}, pinned "
            f"{a['staging_pinned']}/{a['staging_buffers']}"
        )
    ck = single.get("checksums", {})
    if "GBps" in ck:
        lines.append(
            f"checksums: save {ck['save_with_over_without']:.3f}x, load "
            f"{ck['load_with_over_without']:.3f}x of without; "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in ck["GBps"].items())
        )
    hf = r.get("hf", {})
    floor = hf.get("page_cache_read", {}).get("GBps")
    for key in ("load_hf_cuda", "load_hf_cpu"):
        x = hf.get(key, {})
        if "GBps" in x and floor:
            lines.append(
                f"{key}: {x['GBps']:.2f} GB/s = {x['GBps'] / floor:.2f}x the page-cache read "
                f"({floor:.2f} GB/s); read {x['bytes_read']:,} for {x['bytes_owned']:,} owned"
            )
    for name in ("nccl_probe", "single", "hf", "gloo_probe", "multi", "ep"):
        if name in r:
            lines.append(f"{name}: {_failures(r[name])} failure(s)/error(s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
