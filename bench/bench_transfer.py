"""Weight transfer (issue 24 point 7): the planned point-to-point transfer against the two
ways RL frameworks move trainer weights to an inference engine by default.

    python -m bench.bench_transfer                  # ~0.6 GB fp32 model, 4 -> 4 ranks, 3 rounds
    python -m bench.bench_transfer --rounds 5 --packing-baseline --json /tmp/transfer.json
    python -m bench.bench_transfer --plan-only      # planner time at MODEL and PLAN_MODEL

One gloo group of ``T + N`` CPU processes (``shardspec.testing.run_ranks``): trainer ranks
``[0, T)`` hold the Llama of ``examples/models/llama.py`` (``MODEL``) distributed on the
llama spec's layout at dp_shard 2 x tp 2 (FSDP2 + TP DTensors, ``bench_checkpoint.
bench_spec``); engine ranks ``[T, T + N)`` hold the same model on the same spec at tp 4
(dp_shard 1). The spec files the planner reads (the llama spec with the q/k/v groups and
RoPE head size of ``MODEL``, its manifest and HF manifest) are written into a temporary
folder by :func:`write_specs`. Three methods, each moving every engine parameter:

* ``p2p``: the plan (``shardspec transfer``, computed once in the parent, outside the
  timed region; its time is reported apart) executed by ``runtime.transfer``'s
  ``send_weights`` / ``receive_weights`` (``batch_isend_irecv`` in rounds of
  ``bucket_bytes``);
* ``gather_bcast`` (a): what verl and slime do by default: per parameter, every trainer
  rank calls ``full_tensor()`` (all-gathers over the trainer mesh), trainer rank 0
  broadcasts the full tensor to the engine ranks (one group of rank 0 and the engine
  ranks), and each engine rank cuts its own part with torch (``distribute_tensor`` of the
  full tensor to its parameter's mesh and placements, ``src_data_rank=None``: a local cut,
  no communication) into its local shard;
* ``dcp`` (b): ``dcp.save`` of the trainer's state dict (its DTensors, trainer group) into
  a folder, then ``dcp.load`` by the engine into its own DTensors (engine group), with the
  generated planners (``ShardspecSavePlanner`` / ``ShardspecLoadPlanner``: DCP's default
  planner refuses the fused gate/up layout, whose tp shards it sees as overlapping chunks);
* ``p2p_index`` (``--packing-baseline``): ``p2p`` with every move packed through one index
  gather (``runtime.transfer.MAX_BLOCKS`` patched to 0), the packing before block copies.

Round 0 is untimed: the engine's local tensors are filled with NaN before each method and
must equal, bit for bit, what ``gather_bcast`` (torch's ``full_tensor()`` cut by the
engine's own DTensor placements: the owner's answer) wrote; it also counts collectives
(``tests/hf_scenarios.py``'s wrappers and dispatcher counter). Then ``rounds`` timed rounds,
the methods' order rotating each round. A call's time is the slowest rank's wall time
between two barriers of the whole group.

Bytes on the wire: ``p2p``, the runtime's own counts (``TransferStats.sent_bytes``, payload;
the messages' alignment padding apart); ``gather_bcast``, each all-gather moves to every
trainer rank the bytes it does not hold (``full - local`` per rank) and each broadcast
moves the full tensor to each of the N engine ranks (gloo's broadcast sends it from the
root to every other member); ``dcp``, the bytes of the files written, then the bytes each
engine rank reads (its shards: what it owns). Peak extra memory: per rank, the process's
resident high-water mark during the call over its resident size before it (Linux
``/proc/self/clear_refs`` 5 resets the mark; ``gc.collect()`` and ``malloc_trim(0)`` first),
which sees torch's CPU allocations, gloo's buffers and Python's alike; each rank pins
glibc's mmap threshold at 1 MiB first (:func:`pin_mmap_threshold`), so that a buffer freed
in one round is not counted again as retained heap in the next.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import hashlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# ~0.62 GB fp32 (156M parameters): Llama-2's vocabulary, 8 layers of dim 1024, 16 heads
# in 4 GQA groups of head_dim 64 (1 group per engine rank at tp 4), ffn 2816.
MODEL: dict[str, int] = dict(
    vocab_size=32000, dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, head_dim=64, ffn_dim=2816
)
# The planner's cost at a Llama-3-8B-like size (not run on ranks: planning only).
PLAN_MODEL: dict[str, int] = dict(
    vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=14336
)
TRAIN = (4, {"tp": 2})  # world, sizes: dp_shard 2 x tp 2
ENGINE = (4, {"tp": 4})  # dp_shard 1 x tp 4
BUCKET = 32 << 20
METHODS = ("p2p", "gather_bcast", "dcp")
# --packing-baseline adds p2p with every move packed through one index gather (the runtime's
# fallback past MAX_BLOCKS; an extra copy of each move, as the packing before block copies).
INDEX = "p2p_index"


# ------------------------------------------------------------------------------ specs


def write_specs(folder: str | Path, cfg: dict[str, int]) -> str:
    """specs/llama.shard for the Llama of ``cfg`` (its q/k/v groups, head sizes and RoPE
    head size), with its manifest and HF manifest, in ``folder``; returns the spec's path.
    For the tiny default model the spec text is specs/llama.shard's own."""
    import torch

    from bench.bench_hf import hf_shapes
    from examples.models.llama import Llama, LlamaConfig

    c = LlamaConfig(**cfg)
    text = (REPO / "specs" / "llama.shard").read_text()
    q = c.n_heads // c.n_kv_heads * c.head_dim
    fused = f"fuse qkv as {c.n_kv_heads} groups of q {q}, k {c.head_dim}, v {c.head_dim}"
    for old, new in (
        ("fuse qkv as 2 groups of q 32, k 16, v 16", fused),
        ("rope 16", f"rope {c.head_dim}"),
        ("heads qkv 16", f"heads qkv {c.head_dim}"),
        ("heads heads 16", f"heads heads {c.head_dim}"),
    ):
        assert old in text, old
        text = text.replace(old, new)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "llama.shard").write_text(text)
    with torch.device("meta"):
        model = Llama(c)
    modules = dict(model.named_modules())
    kinds = {"Linear": "linear", "Embedding": "embedding"}
    entries = []
    for fqn, p in sorted(model.named_parameters()):
        m = modules[fqn.rpartition(".")[0]]
        entries.append(
            {
                "fqn": fqn,
                "kind": "param",
                "shape": list(p.shape),
                "dtype": str(p.dtype).removeprefix("torch."),
                "module": kinds.get(type(m).__name__, type(m).__name__),
                "class": f"{type(m).__module__}.{type(m).__qualname__}",
            }
        )
    manifest = {"format": "shardspec-manifest/2", "entries": entries}
    (folder / "llama.manifest.json").write_text(json.dumps(manifest))
    hf = json.loads((REPO / "specs" / "llama.hf.json").read_text())
    hf["config"].update(
        hidden_size=c.dim,
        num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads,
        head_dim=c.head_dim,
        intermediate_size=c.ffn_dim,
        vocab_size=c.vocab_size,
        num_hidden_layers=c.n_layers,
    )
    hf["tensors"] = {
        k: {"shape": list(s), "dtype": "F32", "file": "model.safetensors"}
        for k, s in hf_shapes(cfg).items()
    }
    (folder / "llama.hf.json").write_text(json.dumps(hf))
    return str(folder / "llama.shard")


def make_plan(
    spec: str,
    train: tuple[int, dict[str, int]],
    engine: tuple[int, dict[str, int]],
    baseline: str | None = None,
) -> tuple[dict[str, Any], dict[str, float]]:
    """The plan JSON from ``spec`` at both sides' sizes, and the planner's wall time and
    the process's resident high-water mark over its start (:class:`Peak`).
    ``baseline``: ``"elements"``, with the element-by-element intersection the planner had
    before it intersected runs (``tests/test_transfer_runs.py``'s reference); ``"axes"``,
    with every holding's axes listed element by element before they are compressed to
    runs, as the planner built them before it built runs
    (``tests/transfer_elementwise.py``)."""
    from unittest import mock

    from shardspec.core import transfer as core
    from shardspec.transfer import plan_json, plan_transfer

    patch: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
    if baseline == "elements":
        from tests.test_transfer_runs import _by_elements

        patch = mock.patch.object(core, "_meet", _by_elements)
    elif baseline == "axes":
        from tests.transfer_elementwise import elementwise

        patch = elementwise()
    with patch, Peak() as peak:
        t0 = time.perf_counter()
        plan = plan_transfer(spec, spec, train[1], engine[1], train[0], engine[0])
        seconds = time.perf_counter() - t0
    assert plan.status == 0, [str(d) for d in plan.diagnostics]
    t1 = time.perf_counter()
    doc = plan_json(plan)
    return doc, {"plan_s": seconds, "json_s": time.perf_counter() - t1, "plan_peak": peak.extra}


# ------------------------------------------------------------------------------ memory


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def pin_mmap_threshold(size: int = 1 << 20) -> None:
    """Make glibc serve every allocation of ``size`` bytes or more with its own mapping,
    returned to the system when freed. (By default glibc raises that threshold to the
    largest block freed so far, up to 32 MiB, and keeps up to twice as much freed memory
    in its heap, so the resident high-water mark would count buffers already freed.)"""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, size)  # M_MMAP_THRESHOLD (a fixed value ends the adjustment)
        libc.mallopt(-1, size)  # M_TRIM_THRESHOLD


class Peak:
    """Resident high-water mark of this process over its resident size at the start."""

    def __enter__(self) -> Peak:
        gc.collect()
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status("VmRSS")
        self.extra = 0
        return self

    def __exit__(self, *exc: object) -> None:
        self.extra = max(0, _status("VmHWM") - self.base)


# ------------------------------------------------------------------------------ ranks


def _rank(rank: int, world: int, opts: dict[str, Any]) -> dict[str, Any]:
    """One rank of the benchmark (run by ``shardspec.testing.run_ranks``)."""
    import logging
    from unittest import mock

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from bench.bench_checkpoint import bench_spec
    from bench.bench_hf import distributed_llama
    from shardspec.runtime import checkpoint as ckpt_rt
    from shardspec.runtime import transfer
    from tests.hf_scenarios import count_collectives, count_dispatched_collectives

    torch.set_num_threads(1)  # the ranks share the cores
    pin_mmap_threshold()
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    cfg = opts["model"]
    (T, t_sizes), (N, e_sizes) = opts["train"], opts["engine"]
    names = ("dp_shard", "tp")
    t_shape = (T // t_sizes["tp"], t_sizes["tp"])
    e_shape = (N // e_sizes["tp"], e_sizes["tp"])
    meshes = [
        DeviceMesh("cpu", torch.arange(T).reshape(t_shape), mesh_dim_names=names),
        DeviceMesh("cpu", torch.arange(T, T + N).reshape(e_shape), mesh_dim_names=names),
    ]
    bcast = dist.new_group([0, *range(T, T + N)])
    trainer_group = dist.new_group(list(range(T)))
    engine_group = dist.new_group(list(range(T, T + N)))
    side = 0 if rank < T else 1
    spec = bench_spec(cfg)
    model, locals_ = distributed_llama(spec, cfg, meshes[side])
    params = dict(model.named_parameters())

    def own_part(full: torch.Tensor, p: DTensor) -> torch.Tensor:
        """This rank's local shard of ``full`` in ``p``'s layout, cut locally by torch."""
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()

    if side == 0:  # the trainer's weights: the same random full tensors cut by torch
        gen = torch.Generator().manual_seed(1000)
        with torch.no_grad():
            for name, p in params.items():
                assert isinstance(p, DTensor)
                locals_[name].copy_(own_part(torch.randn(p.shape, generator=gen), p))
    shim = types.SimpleNamespace(SPEC_SHA256=opts["spec_sha256"], SPEC_PATH=opts["spec"])
    plan = transfer.load_plan(opts["plan"])
    owned = sum(t.numel() * t.element_size() for t in locals_.values())
    ckpt = os.path.join(opts["folder"], "dcp")
    stats: dict[str, Any] = {}

    def p2p(key: str = "p2p") -> None:
        call = transfer.send_weights if side == 0 else transfer.receive_weights
        s = call(model, plan, spec=shim, bucket_bytes=opts["bucket"])
        stats[key] = {
            "sent": s.sent_bytes,
            "received": s.received_bytes,
            "rounds": s.rounds,
            "messages": s.messages,
            "largest_round": s.largest_round_bytes,
        }

    def gather_bcast() -> None:
        wire = 0
        with torch.no_grad():
            for name, p in params.items():
                assert isinstance(p, DTensor)
                if side == 0:
                    full = p.full_tensor()
                    wire += full.numel() * full.element_size() - locals_[name].nbytes
                    if rank == 0:
                        dist.broadcast(full, group=bcast, group_src=0)
                        wire += full.nbytes * N
                    del full
                else:
                    full = torch.empty(p.shape, dtype=p.dtype)
                    dist.broadcast(full, group=bcast, group_src=0)
                    locals_[name].copy_(own_part(full, p))
                    del full
        stats["gather_bcast"] = {"wire": wire}

    def save_load() -> None:
        state = {"model": dict(params)}
        if side == 0:
            planner = ckpt_rt.ShardspecSavePlanner(spec, meshes[0])
            dcp.save(state, checkpoint_id=ckpt, planner=planner, process_group=trainer_group)
        dist.barrier()
        if side == 1:
            loader = ckpt_rt.ShardspecLoadPlanner(spec, meshes[1])
            dcp.load(state, checkpoint_id=ckpt, planner=loader, process_group=engine_group)
        dist.barrier()
        if side == 0 and rank == 0:
            written = sum(f.stat().st_size for f in Path(ckpt).iterdir())
            stats["dcp"] = {"written": written}
            shutil.rmtree(ckpt)

    def p2p_index() -> None:
        with mock.patch.object(transfer, "MAX_BLOCKS", 0):
            p2p(INDEX)

    ops = {"p2p": p2p, "gather_bcast": gather_bcast, "dcp": save_load, INDEX: p2p_index}

    def timed(method: str) -> tuple[float, int]:
        dist.barrier()
        with Peak() as peak:
            t0 = time.perf_counter()
            ops[method]()
            seconds = time.perf_counter() - t0
        dist.barrier()
        return seconds, peak.extra

    out: dict[str, Any] = {"rank": rank, "side": side, "owned": owned, "round0": {}}
    out["largest_local"] = max(t.nbytes for t in locals_.values())
    # Round 0: counted, checked bit for bit against gather_bcast (the owner's tensors).
    reference: dict[str, torch.Tensor] = {}
    for method in ("gather_bcast", *(m for m in opts["methods"] if m != "gather_bcast")):
        if side == 1:
            with torch.no_grad():
                for t in locals_.values():
                    t.fill_(float("nan"))
        with count_collectives() as calls, count_dispatched_collectives() as seen:
            timed(method)
        r0: dict[str, Any] = {"collectives": dict(calls), "dispatched": dict(seen)}
        if side == 1:
            if method == "gather_bcast":
                reference = {k: v.clone() for k, v in locals_.items()}
            r0["mismatch"] = [
                k
                for k, v in locals_.items()
                if not torch.equal(v.view(torch.uint8), reference[k].view(torch.uint8))
            ]
        out["round0"][method] = r0
    del reference
    methods = opts["methods"]
    out["times"] = {m: [] for m in methods}
    out["peak"] = {m: [] for m in methods}
    order = list(methods)
    for _ in range(opts["rounds"]):
        for method in order:
            seconds, extra = timed(method)
            out["times"][method].append(seconds)
            out["peak"][method].append(extra)
        order = order[1:] + order[:1]
    out["stats"] = stats
    out["moves_largest"] = max(
        (m.nbytes for m in plan.moves if (m.src if side == 0 else m.dst + T) == rank),
        default=0,
    )
    return out


# ------------------------------------------------------------------------------ run


def run(
    model: dict[str, int] | None = None,
    *,
    rounds: int = 3,
    train: tuple[int, dict[str, int]] = TRAIN,
    engine: tuple[int, dict[str, int]] = ENGINE,
    bucket: int = BUCKET,
    methods: tuple[str, ...] = METHODS,
) -> dict[str, Any]:
    """Plan once, then run every method on ``train[0] + engine[0]`` gloo ranks."""
    from shardspec.testing import run_ranks

    cfg = MODEL if model is None else model
    with tempfile.TemporaryDirectory(prefix="bench-transfer-") as folder:
        spec = write_specs(os.path.join(folder, "specs"), cfg)
        doc, timing = make_plan(spec, train, engine)
        path = os.path.join(folder, "plan.json")
        Path(path).write_text(json.dumps(doc))
        opts = {
            "model": cfg,
            "train": train,
            "engine": engine,
            "bucket": bucket,
            "rounds": rounds,
            "folder": folder,
            "plan": path,
            "spec": spec,
            "spec_sha256": hashlib.sha256(Path(spec).read_text().encode()).hexdigest(),
            "methods": methods,
        }
        load0 = os.getloadavg()[0]
        per_rank = run_ranks(_rank, train[0] + engine[0], opts, timeout=3600.0)
        load1 = os.getloadavg()[0]
    return {
        "model": cfg,
        "train": train,
        "engine": engine,
        "bucket": bucket,
        "rounds": rounds,
        "methods": methods,
        "plan": timing | {"moves": sum(len(t["moves"]) for t in doc["tensors"])},
        "totals": doc["totals"],
        "ranks": per_rank,
        "load": (load0, load1),
        "date": datetime.date.today().isoformat(),
    }


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """Per method: the slowest rank's time per round (best, median, paired ratio to
    gather_bcast), bytes on the wire, bytes per engine rank, peak extra memory."""
    ranks, methods = res["ranks"], res["methods"]
    T = res["train"][0]
    engine = [r for r in ranks if r["side"] == 1]
    engine_bytes = sum(r["owned"] for r in engine)
    out: dict[str, Any] = {"engine_bytes": engine_bytes, "methods": {}}
    per_round = {
        m: [max(r["times"][m][k] for r in ranks) for k in range(res["rounds"])] for m in methods
    }
    p2p = [m for m in methods if m.startswith("p2p")]
    wire = {m: sum(r["stats"][m]["sent"] for r in ranks if r["side"] == 0) for m in p2p} | {
        "gather_bcast": sum(r["stats"]["gather_bcast"]["wire"] for r in ranks if r["side"] == 0),
        "dcp": ranks[0]["stats"]["dcp"]["written"] + engine_bytes,
    }
    received = {m: [r["stats"][m]["received"] for r in engine] for m in p2p} | {
        "gather_bcast": [_full_bytes(res["model"]) for _ in engine],  # the broadcasts
        "dcp": [r["owned"] for r in engine],
    }
    for m in methods:
        times = per_round[m]
        base = per_round["gather_bcast"]
        out["methods"][m] = {
            "best": min(times),
            "median": statistics.median(times),
            "ratio": statistics.median(t / b for t, b in zip(times, base, strict=True)),
            "wire": wire[m],
            "wire_ratio": wire[m] / engine_bytes,
            "per_engine_ratio": [g / r["owned"] for g, r in zip(received[m], engine, strict=True)],
            "peak_trainer": max(max(r["peak"][m]) for r in ranks if r["side"] == 0),
            "peak_engine": max(max(r["peak"][m]) for r in ranks if r["side"] == 1),
            "collectives": {
                w: _calls(ranks[i]["round0"][m]) for w, i in (("trainer", 0), ("engine", T))
            },
            "mismatch": sorted({k for r in engine for k in r["round0"][m].get("mismatch", [])}),
        }
    out["largest_move"] = max(r["moves_largest"] for r in ranks)
    out["largest_local"] = max(r["largest_local"] for r in ranks)
    return out


def _calls(r0: dict[str, Any]) -> dict[str, int]:
    """Collective calls through torch.distributed, and the collectives that reached the
    dispatcher without one (DTensor's ``full_tensor()`` all-gathers, functional ops)."""
    out = {k: v for k, v in r0["collectives"].items() if k != "barrier"}
    gathers = sum(n for op, n in r0["dispatched"].items() if "gather" in op)
    if gathers and not any("gather" in k for k in out):
        out["all_gather (dispatched)"] = gathers
    return out


def _full_bytes(cfg: dict[str, int]) -> int:
    """The model's parameter bytes at full size (fp32): what a broadcast gives each rank."""
    from bench.bench_hf import hf_shapes

    n = 0
    for shape in hf_shapes(cfg).values():
        k = 1
        for s in shape:
            k *= s
        n += k
    return 4 * n


def _mb(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def report(res: dict[str, Any], s: dict[str, Any]) -> list[str]:
    """The RESULTS.md table of a run."""
    cfg = res["model"]
    lines = [
        f"Model: examples/models/llama.py Llama {cfg}, fp32, "
        f"{_mb(s['engine_bytes'])} of parameters. Trainer {res['train'][0]} ranks "
        f"{res['train'][1]} (dp_shard takes the rest), engine {res['engine'][0]} ranks "
        f"{res['engine'][1]}; one gloo group of {res['train'][0] + res['engine'][0]} "
        f"processes; bucket {_mb(res['bucket'])}; {res['rounds']} timed rounds, order "
        f"rotating; 1-minute load average {res['load'][0]:.1f} before, "
        f"{res['load'][1]:.1f} after; {res['date']}.",
        "",
        f"Plan (computed once, before the ranks start): {res['plan']['plan_s']:.2f} s "
        f"(plan_transfer, checks included), {res['plan']['json_s']:.2f} s to JSON, resident "
        f"high-water +{_mb(res['plan']['plan_peak'])}, {res['plan']['moves']} moves.",
        "",
        "| method | best | median | time vs (a), paired median | wire bytes | wire / engine "
        "bytes | received / owned per engine rank | peak extra, trainer | peak extra, "
        "engine | collectives (trainer rank 0; engine rank 0) | bitwise |",
        "|---|---:|---:|---:|---:|---:|---|---:|---:|---|---|",
    ]
    for m in s["methods"]:
        r = s["methods"][m]
        coll = "; ".join(
            ", ".join(f"{k} {v}" for k, v in sorted(r["collectives"][w].items())) or "none"
            for w in ("trainer", "engine")
        )
        lines.append(
            f"| {m} | {r['best']:.2f} s | {r['median']:.2f} s | {r['ratio']:.2f}x | "
            f"{_mb(r['wire'])} | {r['wire_ratio']:.3f}x | "
            f"{', '.join(f'{x:.2f}x' for x in r['per_engine_ratio'])} | "
            f"{_mb(r['peak_trainer'])} | {_mb(r['peak_engine'])} | {coll} | "
            f"{'equal' if not r['mismatch'] else 'DIFFERS: ' + ', '.join(r['mismatch'][:3])} |"
        )
    lines += [
        "",
        f"Bound for p2p's peak extra memory: bucket {_mb(res['bucket'])} + largest move "
        f"{_mb(s['largest_move'])} = {_mb(res['bucket'] + s['largest_move'])} (largest local "
        f"shard {_mb(s['largest_local'])}).",
    ]
    return lines


def plan_only(models: dict[str, dict[str, int]]) -> list[str]:
    """The planner's time and memory at each model, to a tp 4 and a one-rank engine, with
    axes built in runs and (same run, alternating) the baseline that lists every axis
    element by element first; the two plans must be equal. ``plan JSON`` is the size of
    the plan file (``json.dumps``, compact)."""
    lines = [
        "| model | engine | axes | plan_transfer | peak RSS extra | plan JSON | moves | "
        "engine bytes | time vs element-wise |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, cfg in models.items():
        with tempfile.TemporaryDirectory(prefix="bench-transfer-plan-") as folder:
            spec = write_specs(folder, cfg)
            for engine in (ENGINE, (1, {"tp": 1})):
                runs_doc, runs_t = make_plan(spec, TRAIN, engine)
                elem_doc, elem_t = make_plan(spec, TRAIN, engine, baseline="axes")
                assert runs_doc == elem_doc, "the two constructions planned differently"
                moves = sum(len(x["moves"]) for x in runs_doc["tensors"])
                size = len(json.dumps(runs_doc, separators=(",", ":")))
                for label, t in (("runs", runs_t), ("element-wise", elem_t)):
                    lines.append(
                        f"| {name} | {engine[0]} ranks {engine[1]} | {label} | "
                        f"{t['plan_s']:.2f} s | {_mb(t['plan_peak'])} | {_mb(size)} | {moves} | "
                        f"{_mb(runs_doc['totals']['engine_bytes'])} | "
                        f"{t['plan_s'] / elem_t['plan_s']:.2f}x |"
                    )
                    print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bucket-mb", type=int, default=BUCKET >> 20)
    ap.add_argument("--json", help="write the raw results here")
    ap.add_argument("--plan-only", action="store_true", help="only time the planner")
    ap.add_argument(
        "--packing-baseline", action="store_true", help=f"add {INDEX}: every move by index"
    )
    args = ap.parse_args(argv)
    if args.plan_only:
        lines = plan_only({"MODEL": MODEL, "PLAN_MODEL": PLAN_MODEL})
        print(f"load average {os.getloadavg()[0]:.1f} after")
        print("\n".join(lines))
        return 0
    methods = (*METHODS, INDEX) if args.packing_baseline else METHODS
    res = run(rounds=args.rounds, bucket=args.bucket_mb << 20, methods=methods)
    s = summary(res)
    if args.json:
        Path(args.json).write_text(json.dumps({"res": res, "summary": s}, indent=1))
    shown = " ".join(sys.argv[1:] if argv is None else argv)
    print(f"Command: `python -m bench.bench_transfer {shown}`".replace(" `", "`"))
    print("\n".join(report(res, s)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
