"""The GPU run (issue 25): shardspec's multi-rank proofs and its checkpoint / Hugging Face
benchmarks on one CUDA device, written to one JSON file.

    python -m bench.gpu_check --out DIR                 # on the GPU machine (about 7 minutes)
    python -m bench.gpu_check --out DIR --device cpu --limit-scale 8   # a CPU dry run

**On the lent GPU machine** (one H100 or H200, Python 3.12, torch 2.11, transformers 5.17,
no lark, no pydantic: /work/.library/device/KINDS.md), everything in one call of the device
tool. Here first, once: ``bash bench/gpu_wheels.sh`` (about 15 MB of wheels into ``.whl/``,
ignored by git: lark, pydantic and its parts for the compiler that ``ep_sp`` and
``transfer`` run, transformers 5.24 as the CPU suite has it). Then the tool's ``run`` with
``carry: [".whl"]``, ``timeout_s: 540`` and the command::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit; \
    PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --out $OUT

(``$OUT/gpu_check.json`` and ``$OUT/phase_logs.txt`` come back.) ``--budget`` (420 s) bounds
all phases together: a phase starts only with 20 s left, under the smaller of its own limit
(``PHASES``) and what is left, so the phases run first are those never run on a GPU.
``--phases a,b`` selects and orders; ``GPU_CHECK_STEPS=x,y`` picks steps inside the
step-wise phases; ``GPU_CHECK_ROUNDS`` (3) the timed rounds.

Each phase runs in a process of its own, under a time limit, and adds its results to
``DIR/gpu_check.json`` as it ends (a phase that hangs or crashes costs only itself). A
multi-rank phase spawns its ranks once per step; 4 (or 6) processes share the one GPU with
gloo collectives on CUDA tensors (NCCL refuses two ranks on one device), DTensor's
all-gathers through c10d's (``_c10d_all_gather``: torch 2.11's functional one crashes on
CUDA over gloo), and point-to-point messages of CUDA tensors through host memory
(``_host_p2p``: gloo would read a device pointer as a host one). The CPU suite's own
scenarios run, their batches and models moved to the device by patching module attributes
(``_device_patches`` and the phase's own patches), never copies of them. In the order they
run:

* ``env``: torch, CUDA, NCCL, the GPU, the host, the packages.
* ``async``: ``multi``'s asynchronous-save scenario alone (tests/ckpt_async_scenarios.py's
  ``scenario_train``: training goes on while pinned copies are written, then a bitwise
  reload), after fix 3 of the first run: each rank's ``wire_device`` counts show the
  reload's file exchange sending CUDA tensors through host memory (``gloo cuda -> cpu``),
  and ``staging_pinned`` the pinned staging buffers.
* ``pp``: tests/pipeline_scenarios.py's ``train`` (specs/llama_pp.shard at pp 2 x dp_shard
  2, FSDP2 within each stage, GPipe and 1F1B through torch.distributed.pipelining, against
  one process) and tests/pipeline_harness.py's training cases (the tiny Llama cut into 4
  stages: GPipe and 1F1B, renumbered and tied), CUDA stages.
* ``views_pp``: tests/views_pp_train_scenarios.py: the example MoE's pipeline folds with
  views (pp 2 x ep 2 with all-to-all dispatch, pp 2 x tp 2) trained against one process,
  and checkpoints moving between pp 2 and pp 1 bitwise.
* ``ep_sp``: tests/ep_sp_scenarios.py (the specs compiled first by tests/ep_sp_specs.py's
  ``compile_all``): expert parallelism borrowing the sequence-parallel tp ranks, the
  example MoE and transformers' Qwen3-MoE trained against one process at efsdp 2 x ep 2
  and ep 4, each rank routing its own tokens, a checkpoint into another fold bitwise.
* ``fp8``: bench/bench_hf_fp8.py's block-scaled FP8 checkpoint at ``FP8_MODEL`` (about 80
  MB), ``load_hf`` on 4 ranks (dp_shard 2 x tp 2) into CUDA parameters and into CPU ones:
  bytes read per rank against owned, GB/s (the page-cache read of the files measured in
  the same phase), the CUDA load equal to the CPU load bitwise.
* ``transfer``: tests/transfer_scenarios.py's ``transfer_round`` on 6 ranks with CUDA
  models: the llama trainer (ranks 0-3, dp_shard 2 x tp 2, trained 2 AdamW steps)
  ``layout.send_weights`` to an engine at tp 2 (ranks 4-5, ``receive_weights``) and, with
  the runtime's own functions, to a one-rank engine; host buffers over gloo. Each engine
  equals the trainer's full tensors cut by torch into its layout, bitwise. (The scenario's
  trainer has 4 ranks, not 2.)
* ``single``: one rank, the real NCCL backend that ``build_mesh`` starts: ``parallelize``
  + ``verify`` + AdamW steps of the example Llama against the same model unparallelized
  (tests/parallel_scenarios.py's ``compare_training``); save / load of model and AdamW
  state bitwise, continued training equal; a 1 GB model state (bench/bench_hf.py's
  ``MODEL``) in CUDA memory: synchronous save against ``asynchronous=True`` (the call,
  which copies to pinned host memory, and until complete), and checksums on against off
  (``ChecksumWriter`` against DCP's ``FileSystemWriter``; ``load(verify=True/False)``):
  ``save_with_over_without`` / ``load_with_over_without`` are the throughput with
  checksums over without (the 0.95x target).
* ``hf``: one rank (``cpu:gloo,cuda:nccl``): the 1 GB Llama checkpoint
  (bench/bench_hf.py's ``write_checkpoint``) read from the page cache with plain
  ``readinto`` (the floor), and ``load_hf`` into CUDA parameters (GB/s, bytes read); the
  CUDA load equals the CPU load bitwise (the CPU path is the one the test suite compares
  with transformers); ``export_hf`` from CUDA parameters writes the original tensors.
* ``multi``: 4 processes: the CPU suite's own scenarios with their tensors on CUDA:
  ``compare_training`` of the example Llama (fused w13 as ``_StridedShard`` under FSDP2 x
  TP), transformers' Qwen3 and the example MoE at dp_shard 2 x tp 2; ``scenario_reshard``
  (save at tp 2, load at tp 1, continued run bitwise equal to torch's own full-state
  reshard: needs torch >= 2.13); the asynchronous-save scenario (again, as ``async``);
  ``load_hf`` of a transformers Llama checkpoint into CUDA parameters on tp 2 x dp_shard 2
  (equal to the CPU load bitwise, bytes read per rank) and ``export_hf`` back
  (transformers' tensors bitwise).
* ``ep``: 4 processes: tests/ep_train_scenarios.py's training of the example MoE on folded
  views with all-to-all token dispatch (ep 2 x efsdp 2 with dense tp 2, and ep 4), against
  one process, on CUDA.
* ``gloo_probe``: which gloo collectives (c10d's and the functional ones) take CUDA
  tensors, one spawn of 2 ranks per collective.
* ``nccl_probe``: can two processes share the one GPU over NCCL? (They cannot: the first
  run's answer, kept as a check.)

A CPU dry run (``--device cpu``) runs the same code on CPU tensors; set
``GPU_CHECK_HOST_P2P=1`` and ``GPU_CHECK_C10D_GATHER=1`` to run the host point-to-point
and c10d all-gather patches there too, and ``GPU_CHECK_TIMEOUT`` (120 s) longer on loaded
cores. The six new phases passed so in about 26 minutes on 2 cores at load 16 to 25
(bench/RESULTS.md, "Not done on the GPU"). tests/test_gpu_check.py checks the driver, the
phase order and the host point-to-point patch on CPU.

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
    # never run on a GPU: first
    "async": 90,
    "pp": 100,
    "views_pp": 120,
    "ep_sp": 150,
    "fp8": 90,
    "transfer": 90,
    # run once (bench/RESULTS.md, issue 25): after, as the budget allows
    "single": 120,
    "hf": 100,
    "multi": 200,
    "ep": 100,
    "gloo_probe": 60,
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
            backend,
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=float(os.environ.get("GPU_CHECK_TIMEOUT", "120"))),
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
    for mod in ("transformers", "safetensors", "numpy", "lark", "pydantic", "jinja2"):
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


def _meta_llama(spec: Any, cfg: dict[str, int], mesh: Any, device: str) -> Any:
    """The Llama of ``cfg`` built on the meta device, distributed on ``spec``'s layout over
    ``mesh``, its memory (uninitialized) on ``device``."""
    import torch

    from examples.models.llama import Llama, LlamaConfig
    from shardspec.runtime import dtensor as rt

    with torch.device("meta"):
        model = Llama(LlamaConfig(**cfg))
    rt.distribute(spec, model, mesh)
    model.to_empty(device=device)
    return model


def _big_state(spec: Any, mesh: Any, adam: bool = False) -> dict:
    """bench/bench_hf.py's 1 GB Llama, distributed on ``mesh`` in device memory."""
    import zlib

    import torch
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from bench.bench_hf import MODEL

    model = _meta_llama(spec, MODEL, mesh, _dev())
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
    staged = _pinned()
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
        **staged,
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
            return _meta_llama(spec, MODEL, mesh, device), mesh

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


def _scenario(rank: int, step: str, fn: Callable[[Any, str, dict], dict | None]) -> dict:
    """One step of a multi-rank phase on this rank: the CPU suite's scenarios patched onto
    the device, a scratch folder shared by the ranks, ``fn(checks, root, out)`` (its dict
    joins the step's result; ``out`` is this rank's result), the peak device memory, and
    what the checkpoint code chose (wire devices, pinned staging) if it ran."""
    import logging
    import warnings

    import torch
    import torch.distributed as dist

    from shardspec.testing import Checks

    warnings.filterwarnings("ignore")
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    _device_patches()
    _record_wire()
    out: dict[str, Any] = {}
    root = [tempfile.mkdtemp(prefix="gpu-check-multi-") if rank == 0 else ""]
    dist.broadcast_object_list(root, src=0)

    def run() -> dict:
        c = Checks()
        figures = fn(c, root[0], out)
        return _checks_result(c) | (figures or {})

    _run_step(out, step, run)
    print(f"[rank {rank}] {json.dumps(out, default=str)[:3000]}", file=sys.stderr, flush=True)
    try:
        dist.barrier()
    except Exception as e:  # a peer failed or hangs: keep this rank's own result
        out["error"] = f"the barrier after the step: {type(e).__name__}: {str(e)[:300]}"
        return out
    if rank == 0:
        shutil.rmtree(root[0], ignore_errors=True)
    out["max_memory_allocated_gib"] = (
        torch.cuda.max_memory_allocated() / 2**30 if _dev() == "cuda" else 0.0
    )
    if _WIRE:
        out["wire_device"] = dict(_WIRE)
    staged = _pinned()
    if staged["staging_buffers"]:
        out |= staged
    return out


def _multi_rank(rank: int, world: int, step: str) -> dict:
    """One scenario of the ``multi`` phase (one spawn each: a crash costs only itself)."""

    def body(c: Any, root: str, out: dict) -> None:
        import generated.deepseek_moe as moe_layout
        import generated.llama as layout
        import generated.qwen3 as qwen3
        from examples.models import hf as hf_models
        from examples.models import llama, moe
        from tests import ckpt_async_scenarios as cas
        from tests import parallel_scenarios as ps

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
                c,
                "train qwen3",
                ps.seeded(hf_models.qwen3_tiny),
                qwen3,
                qwen3.build_mesh(tp=2),
                256,
            ),
            "train_moe_style_none": lambda c: ps.compare_training(
                c,
                "train moe",
                ps.seeded(moe.tiny, init=moe.init_weights),
                moe_layout,
                moe_layout.build_mesh(ep=2),
                256,
            ),
            "reshard": lambda c: ps.scenario_reshard(c, root),
            "async_save_training": lambda c: cas.scenario_train(c, root),
            "hf_llama": lambda c: _hf_multi(c, rank, root),
        }
        steps[step](c)

    return _scenario(rank, step, body)


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


def _steps_phase(rank_fn: Callable, world: int, steps: list[tuple]) -> dict:
    """A phase of steps, one spawn of ``world`` gloo ranks each (a crash costs only its
    own step): ``rank_fn(rank, world, *step)``, each rank's result under the step's name
    (its first element). ``GPU_CHECK_STEPS=a,b`` runs only those."""
    out: dict[str, Any] = {"backend": "gloo"}
    only = os.environ.get("GPU_CHECK_STEPS")
    for step in steps:
        if only and step[0] not in only.split(","):
            continue
        res = _spawn(rank_fn, world, "gloo", *step)
        out[step[0]] = [r[1] if r[0] == "ok" else {"error": r[1]} for r in res]
        _partial(out)
    return out


def phase_multi() -> dict:
    return _steps_phase(_multi_rank, 4, [(s,) for s in MULTI_STEPS])


def phase_async() -> dict:
    """``multi``'s asynchronous-save scenario alone, after fix 3 (its reload's file
    exchange sends CUDA tensors through host memory over gloo): ``wire_device`` in each
    rank's result records that path."""
    return _steps_phase(_multi_rank, 4, [("async_save_training",)])


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


# ----------------------------------------------------------------------------- never run


def _moved(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` whose result (a model, a tensor, or a tuple of tensors) goes to the device."""

    def on_device(*a: Any, **k: Any) -> Any:
        got = build(*a, **k)
        if isinstance(got, tuple):
            return tuple(t.to(_dev()) for t in got)
        return got.to(_dev())

    return on_device


_WIRE: dict[str, int] = {}  # locality.wire_device's decisions: "backend device -> wire"


def _record_wire() -> None:
    """Count what ``checkpoint.locality.wire_device`` decides (fix 3 of the first GPU run:
    a reload over gloo sends CUDA tensors through host memory): the proof that a scenario
    took the fixed path."""
    from shardspec.runtime.checkpoint import locality

    decide = locality.wire_device
    if getattr(decide, "_recorded", False):
        return

    def wire_device(backend: str, device: Any) -> Any:
        got = decide(backend, device)
        key = f"{backend} {device.type} -> {got.type}"
        _WIRE[key] = _WIRE.get(key, 0) + 1
        return got

    wire_device._recorded = True  # type: ignore[attr-defined]
    locality.wire_device = wire_device


class _HostWork:
    """A point-to-point request whose tensor travelled through host memory: ``wait``
    copies a received message into the device tensor's memory, past autograd as the
    backend's own write is (pipelining receives into leaves that require grad)."""

    def __init__(self, work: Any, host: Any, dst: Any) -> None:
        self._work, self._host, self._dst = work, host, dst

    def wait(self, *a: Any, **k: Any) -> Any:
        done = self._work.wait(*a, **k)
        if self._dst is not None:
            self._dst.data.copy_(self._host)
            self._dst = None
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _host_p2p() -> None:
    """``isend`` / ``irecv`` of CUDA tensors through host memory where the group's backend
    is gloo (``locality.wire_device``'s rule: gloo reads a CUDA pointer as a host one and
    the process aborts). torch's pipelining sends its activations and gradients with them
    (``P2POp`` + ``batch_isend_irecv``, or the ops one by one); several ranks on one GPU
    can only use gloo. ``GPU_CHECK_HOST_P2P=1`` stages every message (a CPU dry run
    exercises the copies). A bench-only patch, like :func:`_c10d_all_gather`."""
    import functools

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from shardspec.runtime.checkpoint.locality import wire_device

    if getattr(c10d.isend, "_host", False):
        return
    send, recv = c10d.isend, c10d.irecv
    force = bool(os.environ.get("GPU_CHECK_HOST_P2P"))

    def staged(tensor: Any, args: tuple, kwargs: dict) -> bool:
        group = kwargs.get("group", args[1] if len(args) > 1 else None)
        return force or wire_device(dist.get_backend(group), tensor.device) != tensor.device

    @functools.wraps(send)
    def isend(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not staged(tensor, args, kwargs):
            return send(tensor, *args, **kwargs)
        host = tensor.detach().to("cpu", copy=True)
        return _HostWork(send(host, *args, **kwargs), host, None)

    @functools.wraps(recv)
    def irecv(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not staged(tensor, args, kwargs):
            return recv(tensor, *args, **kwargs)
        host = torch.empty_like(tensor, device="cpu")
        return _HostWork(recv(host, *args, **kwargs), host, tensor)

    isend._host = irecv._host = True  # type: ignore[attr-defined]
    dist.isend = c10d.isend = isend
    dist.irecv = c10d.irecv = irecv


def _pipeline_patches() -> None:
    """tests/pipeline_scenarios.py's batches and models on the device (the views + pp
    scenarios use tests/ep_train_scenarios.py's, patched by :func:`_device_patches`)."""
    from tests import pipeline_scenarios as pps

    _host_p2p()
    if getattr(pps, "_on_device", None) == _dev():
        return
    pps.whole = _moved(pps.whole)
    pps.batch = _moved(pps.batch)
    pps.full = _full
    pps._on_device = _dev()


def _ep_sp_patches() -> None:
    """tests/ep_sp_scenarios.py's transformers Qwen3-MoE on the device, and its positions
    and causal mask (made from the tokens on the host) moved there."""
    from tests import ep_sp_scenarios as eps
    from tests import ep_train_scenarios as ets

    if getattr(eps, "_on_device", None) == _dev():
        return
    ets.qwen3 = _moved(ets.qwen3)
    positions = eps._positions

    def on_device(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs = positions(module, args, kwargs)
        return args, {k: v.to(_dev()) if hasattr(v, "to") else v for k, v in kwargs.items()}

    eps._positions = on_device
    eps._on_device = _dev()


def _transfer_patches() -> None:
    """tests/transfer_scenarios.py's models (trainer and engine) on the device, their
    meshes device meshes, the trainer's host tokens moved to the model's device."""
    from torch.distributed.device_mesh import DeviceMesh

    from tests import transfer_scenarios as ts

    if getattr(ts, "_on_device", None) == _dev():
        return
    tiny, meshes = ts.tiny, ts._meshes

    def tokens_to_device(module: Any, args: tuple) -> tuple:
        return tuple(a.to(_dev()) for a in args)

    def on_device() -> Any:
        model = tiny().to(_dev())
        model.register_forward_pre_hook(tokens_to_device)
        return model

    def device_meshes() -> tuple[Any, Any]:
        return tuple(DeviceMesh(_dev(), m.mesh, mesh_dim_names=m.mesh_dim_names) for m in meshes())

    ts.tiny, ts._meshes = on_device, device_meshes
    ts._on_device = _dev()


def _pinned() -> dict:
    """The checkpoint staging pool's buffers, and how many are pinned host memory."""
    from shardspec.runtime.checkpoint import staging

    pinned = [b.is_pinned() for bufs in getattr(staging, "_POOL", {}).values() for b in bufs]
    return {"staging_buffers": len(pinned), "staging_pinned": sum(pinned)}


def _pp_train(c: Any, root: str, arg: Any) -> dict:
    """tests/pipeline_scenarios.py's ``train``: specs/llama_pp.shard at pp 2 x dp_shard 2,
    GPipe and 1F1B, against one process."""
    from tests import pipeline_scenarios as pps

    _pipeline_patches()
    pps.scenario_train(c)
    return {}


def _pp_harness(c: Any, root: str, arg: Any) -> dict:
    """tests/pipeline_harness.py's training cases (the tiny Llama cut into 4 stages, GPipe
    and 1F1B, tied and renumbered), against one process."""
    import torch.distributed as dist

    from tests import pipeline_harness as ph

    _host_p2p()
    tiny4, tied, batch = ph.llama.tiny4, ph.llama.tiny_tied, ph.batch
    ph.batch = _moved(batch)
    try:
        ph.llama.tiny4 = _moved(tiny4)
        ph.llama.tiny_tied = _moved(tied)
        for case in ph.CASES:
            kwargs: dict[str, Any] = dict(case)
            ph.train_case(c, dist.get_rank(), dist.get_world_size(), **kwargs)
    finally:
        ph.llama.tiny4, ph.llama.tiny_tied, ph.batch = tiny4, tied, batch
    return {}


def _views_pp(c: Any, root: str, arg: Any) -> dict:
    """tests/views_pp_train_scenarios.py: the example MoE's pipeline folds (pp 2 x ep 2,
    pp 2 x tp 2) trained against one process, and checkpoints between pp 2 and pp 1."""
    from tests import views_pp_train_scenarios as vpt

    _host_p2p()
    {"train": vpt.check_training, "ckpt": lambda c: vpt.check_checkpoints(c, root)}[arg](c)
    return {}


def _ep_sp(c: Any, root: str, arg: Any) -> dict:
    """tests/ep_sp_scenarios.py: expert parallelism borrowing the sequence-parallel tp
    ranks, ``arg`` = (step, folder of the compiled specs)."""
    from tests import ep_sp_scenarios as eps

    _ep_sp_patches()
    step, gen = arg
    layout = eps._generated(gen, "moe_sp")
    {
        "local_tokens": lambda: eps.check_local_tokens(c, layout),
        "train": lambda: eps.check_training(c, layout),
        "train_qwen3": lambda: eps.check_training_qwen3(c, gen),
        "ckpt": lambda: eps.check_checkpoint(c, gen, layout),
    }[step]()
    return {}


FP8_MODEL: dict[str, int] = dict(  # about 60M parameters: 80 MB of FP8 + bf16 checkpoint
    vocab_size=8192, dim=1024, n_layers=4, n_heads=8, n_kv_heads=4, head_dim=128, ffn_dim=2816
)


def _fp8_load(c: Any, root: str, folder: str) -> dict:
    """The FP8 checkpoint (bench/bench_hf_fp8.py's, at :data:`FP8_MODEL`) by ``load_hf``
    into parameters on the device (dp_shard 2 x tp 2) and into CPU parameters on the same
    layout: bytes read against owned, time, the device load equal to the CPU load
    bitwise (the CPU path is the one tests/test_hf_fp8.py checks against the format)."""
    import dataclasses

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from bench.bench_checkpoint import bench_spec
    from bench.bench_hf import bench_hfmap
    from bench.bench_hf_fp8 import BLOCK, _quants
    from shardspec.runtime import dtensor as rt
    from shardspec.runtime import hf

    spec = bench_spec(FP8_MODEL)
    hfmap = dataclasses.replace(bench_hfmap(FP8_MODEL), quants=_quants(BLOCK))
    mesh: Any = rt.build_mesh(spec, tp=2)
    cpu_mesh = init_device_mesh("cpu", tuple(mesh.shape), mesh_dim_names=mesh.mesh_dim_names)
    out: dict[str, Any] = {}
    local: dict[str, dict[str, Any]] = {}
    for key, device, m in (("device", _dev(), mesh), ("cpu", "cpu", cpu_mesh)):
        model = _meta_llama(spec, FP8_MODEL, m, device)
        params = {n: _local(p) for n, p in model.named_parameters()}
        times, rep = [], None
        for _ in range(ROUNDS + 1):  # the first fills the page cache
            with torch.no_grad():
                for t in params.values():
                    t.fill_(float("nan"))
            dist.barrier()
            _sync()
            t0 = time.perf_counter()
            rep = hf.load_hf(spec, hfmap, model, folder, m, other_dtypes=True)
            _sync()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        assert rep is not None
        med = _median(times[1:])
        out[key] = {
            "times_s": times[1:],
            "bytes_read": rep.bytes_read,
            "bytes_owned": rep.bytes_owned,
            "read_over_owned": rep.bytes_read / rep.bytes_owned,
            "GBps_read": rep.bytes_read / med / GB,
        }
        c.check("fp8", rep.bytes_read <= rep.bytes_owned * 1.01, f"{device}: read {rep}")
        local[key] = params
    want, got = local["cpu"], local["device"]
    for n, t in got.items():
        same = torch.equal(t.cpu().view(torch.uint8), want[n].view(torch.uint8))
        c.check("fp8", same, f"{n}: the device load differs from the CPU load")
    c.check("fp8", len(got) == len(want) > 0, f"{len(got)} parameters compared")
    return out


def _transfer(c: Any, root: str, arg: Any) -> dict:
    """tests/transfer_scenarios.py's ``transfer_round`` with CUDA models: the llama
    trainer (ranks 0-3, dp_shard 2 x tp 2, 2 AdamW steps) sends to an engine (ranks 4-5,
    tp 2) through the plan; the messages are host buffers over gloo. The engine equals the
    trainer's full tensors cut by torch into its layout, bitwise."""
    import dataclasses

    import torch.distributed as dist

    from tests import transfer_scenarios as ts

    _transfer_patches()
    folder, case = arg
    got = ts.transfer_round(dist.get_rank(), dist.get_world_size(), folder, case)
    if "role" not in got:  # rank 5 with the one-rank engine: not in the transfer's group
        return {"role": None}
    c.check("transfer", got["error"] is None, f"error {got['error']}")
    if got["role"] == "engine":
        c.check("transfer", got.get("mismatch") == [], f"mismatch {got.get('mismatch')}")
        c.check("transfer", len(got["changed"]) > 0, "the engine's parameters did not change")
        c.check("transfer", not got["stale"], "the engine is marked stale")
    stats = got.get("stats")
    return {
        "role": got["role"],
        "seconds": got["seconds"],
        "stats": dataclasses.asdict(stats) if stats is not None else None,
        "calls": got.get("calls"),
    }


SCENARIOS: dict[str, Callable[[Any, str, Any], dict]] = {
    "pp_train": _pp_train,
    "pp_harness": _pp_harness,
    "views_pp_train": _views_pp,
    "views_pp_ckpt": _views_pp,
    "ep_sp_train": _ep_sp,
    "ep_sp_local_tokens": _ep_sp,
    "ep_sp_train_qwen3": _ep_sp,
    "ep_sp_ckpt": _ep_sp,
    "fp8_load_hf": _fp8_load,
    "transfer_tp2": _transfer,
    "transfer_one": _transfer,
}


def _scenario_rank(rank: int, world: int, step: str, arg: Any) -> dict:
    """One step of the phases never run on a GPU before (one spawn each)."""
    return _scenario(rank, step, lambda c, root, out: SCENARIOS[step](c, root, arg))


def phase_pp() -> dict:
    return _steps_phase(_scenario_rank, 4, [("pp_train", None), ("pp_harness", None)])


def phase_views_pp() -> dict:
    return _steps_phase(_scenario_rank, 4, [("views_pp_train", "train"), ("views_pp_ckpt", "ckpt")])


def phase_ep_sp() -> dict:
    from tests.ep_sp_specs import compile_all

    gen = tempfile.mkdtemp(prefix="gpu-check-ep-sp-")
    try:
        t0 = time.perf_counter()
        compile_all(Path(gen))  # the compiler: lark and pydantic (bench/gpu_wheels.sh)
        out = {"compile_s": round(time.perf_counter() - t0, 2)}
        steps = ("ep_sp_train", "ep_sp_local_tokens", "ep_sp_train_qwen3", "ep_sp_ckpt")
        step_args = [(s, (s.removeprefix("ep_sp_"), gen)) for s in steps]
        return out | _steps_phase(_scenario_rank, 4, step_args)
    finally:
        shutil.rmtree(gen, ignore_errors=True)


def phase_fp8() -> dict:
    from bench.bench_hf import write_checkpoint
    from bench.bench_hf_fp8 import BLOCK, write_fp8

    root = tempfile.mkdtemp(prefix="gpu-check-fp8-")
    try:
        t0 = time.perf_counter()
        write_checkpoint(os.path.join(root, "fp32"), FP8_MODEL)
        sizes = write_fp8(os.path.join(root, "fp32"), os.path.join(root, "fp8"), BLOCK)
        shutil.rmtree(os.path.join(root, "fp32"))
        out: dict[str, Any] = {"checkpoint": sizes, "write_s": round(time.perf_counter() - t0, 2)}
        _run_step(out, "page_cache_read", lambda: _read_floor(os.path.join(root, "fp8")))
        return out | _steps_phase(_scenario_rank, 4, [("fp8_load_hf", os.path.join(root, "fp8"))])
    finally:
        shutil.rmtree(root, ignore_errors=True)


def phase_transfer() -> dict:
    from shardspec.transfer import plan_json, plan_transfer

    llama = str(REPO / "specs" / "llama.shard")
    root = tempfile.mkdtemp(prefix="gpu-check-transfer-")
    try:
        steps = []
        for name, engine, tp, world, extra in (
            ("tp2", "tp2", 2, 2, {}),
            ("one", "one", 1, 1, {"runtime": True}),  # runtime.transfer's own functions
        ):
            plan = plan_transfer(llama, llama, {"tp": 2}, {"tp": tp}, 4, world)
            if plan.status:
                raise RuntimeError(f"the {name} plan: {plan.diagnostics}")
            path = os.path.join(root, f"{name}.json")
            with open(path, "w", encoding="utf-8") as f:
                json.dump(plan_json(plan), f)
            folder = os.path.join(root, name)
            os.makedirs(folder)
            case = {"plan": path, "engine": engine, "bucket": 1 << 16, "export": True} | extra
            steps.append((f"transfer_{name}", (folder, case)))
        return _steps_phase(_scenario_rank, 6, steps)
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- driver

RUNNERS: dict[str, Callable[[], dict]] = {
    "env": phase_env,
    "async": phase_async,
    "pp": phase_pp,
    "views_pp": phase_views_pp,
    "ep_sp": phase_ep_sp,
    "fp8": phase_fp8,
    "transfer": phase_transfer,
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
    ap.add_argument("--budget", type=float, default=420.0, help="seconds for all phases")
    ap.add_argument(
        "--limit-scale",
        type=float,
        default=1.0,
        help="multiply each phase's time limit (a CPU dry run on a few loaded cores: 5 or more)",
    )
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--phase-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    unknown = sorted(set(args.phases.split(",")) - set(PHASES))
    if unknown:
        ap.error(f"unknown phase(s) {', '.join(unknown)}; the phases: {', '.join(PHASES)}")
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
        limit = min(PHASES[name] * args.limit_scale, left)
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
    shutil.rmtree(scratch, ignore_errors=True)  # the phases' own files (made above)
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
    fp8 = r.get("fp8", {})
    for rank, res in enumerate(fp8.get("fp8_load_hf", [])):
        x = res.get("fp8_load_hf", {}) if isinstance(res, dict) else {}
        if "device" in x:
            d, cpu = x["device"], x["cpu"]
            lines.append(
                f"fp8 load_hf rank {rank}: read {d['bytes_read']:,} for {d['bytes_owned']:,} "
                f"owned; {d['GBps_read']:.2f} GB/s into {r.get('device')} parameters, "
                f"{cpu['GBps_read']:.2f} GB/s into CPU ones; "
                f"{x.get('n_failures', '?')} failure(s) (bitwise vs the CPU load)"
            )
    ranks = r.get("async", {}).get("async_save_training", [])
    wire = [x.get("wire_device") for x in ranks if isinstance(x, dict)]
    if wire:
        lines.append(f"async save, the reload's wire devices per rank: {wire}")
    for name in PHASES:
        if name in r and name != "env":
            lines.append(f"{name}: {_failures(r[name])} failure(s)/error(s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
