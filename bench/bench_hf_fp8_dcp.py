"""Block-scaled FP8 load of a DeepSeek-like checkpoint (>= 1 GB) on 4 ranks: ``load_hf``
against torch's ``QuantizedHuggingFaceStorageReader`` through ``dcp.load`` and against
reading every tensor whole (issue 22, point 7).

    python -m bench.bench_hf_fp8_dcp                       # 1.13 GB, both layouts, 3 rounds
    python -m bench.bench_hf_fp8_dcp --layouts tp --rounds 5 --keep /tmp/ds_fp8
    python -m bench.bench_hf_fp8_dcp --tiny --rounds 1     # seconds: what the test runs

The checkpoint is a ``transformers.DeepseekV3ForCausalLM`` (:data:`BIG`: MLA, one dense
layer, 4 MoE layers of 36 routed experts and a shared expert, dims multiples of 128 as the
real model's) written as DeepSeek ships it: every linear layer's weight (experts one key
each) ``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128 x 128 block, the
embeddings, norms, router and ``e_score_correction_bias`` bf16, in one file per layer.
The model is built on the meta device in bf16 and distributed by ``specs/deepseek_v3_fp8.shard``
compiled for this config with the real CLI: layout ``ep`` is that spec (dp_shard 2 x ep 2,
whole experts over ep, FSDP2 on dp_shard), layout ``tp`` the same with ``TP_EDITS`` of
``tests/test_hf_fp8.py`` (dp_shard 2 x tp 2: linear rows and the experts' ffn over tp).
Three methods, interleaved (the order rotates every round), the files in the page cache
(the writer just wrote them, and every round reads them all):

* ``shardspec``: ``load_hf``: each rank reads the FP8 bytes of its own boxes and the
  scale blocks that cover them, dequantizes them, no collective;
* ``dcp``: ``dcp.load`` of a state dict keyed by the Hugging Face names (the model's own
  DTensors, and per expert a DTensor view of the stacked parameter on the ranks that hold
  it) through ``QuantizedHuggingFaceStorageReader(target_dtype=float32, block_size=128,
  thread_count=T)``;
* ``full``: every rank reads every tensor whole, dequantizes it whole (the format's
  definition), stacks the experts, and calls ``distribute_tensor`` per parameter, each
  full tensor freed after it is distributed.

Round 0 checks that the three give every rank the same bits. A call's time is the slowest
rank's wall time between two barriers. Bytes read per rank are the tensor bytes that the
safetensors handles handed out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = (128, 128)
# DeepSeek-V3's shape at a smaller scale: real head dims, rank of q/kv, 36 experts.
BIG: dict[str, Any] = {
    "vocab_size": 16384,
    "hidden_size": 2048,
    "intermediate_size": 4096,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 5,
    "first_k_dense_replace": 1,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_routed_experts": 36,
    "n_group": 2,
    "topk_group": 1,
    "q_lora_rank": 512,
    "kv_lora_rank": 256,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}
TINY: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 384,
    "moe_intermediate_size": 128,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 32,
    "v_head_dim": 32,
}
LAYOUTS = {"ep": {"dp_shard": 2, "ep": 2}, "tp": {"dp_shard": 2, "tp": 2}}
METHODS = ("shardspec", "dcp", "full")


# ------------------------------------------------------------------------ checkpoint


def _hf_tensors(cfg: Mapping[str, Any]) -> Mapping[str, tuple[int, ...]]:
    """The Hugging Face keys and shapes of the DeepSeek-V3 of ``cfg``: the model's own
    names, the stacked experts one key per expert and projection."""
    import torch

    from examples.models import hf as hfm

    with torch.device("meta"):
        model = hfm.deepseek_v3_tiny(**cfg)
    out: dict[str, tuple[int, ...]] = {}
    for fqn, t in model.state_dict().items():
        head, _, name = fqn.rpartition(".")
        if not head.endswith("mlp.experts"):
            out[fqn] = tuple(t.shape)
            continue
        n, rows, cols = t.shape
        for e in range(n):
            if name == "gate_up_proj":
                out[f"{head}.{e}.gate_proj.weight"] = (rows // 2, cols)
                out[f"{head}.{e}.up_proj.weight"] = (rows // 2, cols)
            else:
                out[f"{head}.{e}.{name}.weight"] = (rows, cols)
    return out


def write_checkpoint(folder: str, cfg: Mapping[str, Any]) -> dict[str, int]:
    """DeepSeek's FP8 release format for the model of ``cfg``, random values, one file per
    layer (and one for the rest); ``config.json`` with its ``quantization_config``."""
    import torch
    from safetensors.torch import save_file

    from examples.models import hf as hfm
    from shardspec.core.hfmap import HFMap
    from shardspec.runtime.hf.fp8 import quantization_config, quantize
    from tests.hf_fp8_scenarios import DEEPSEEK_GLOBS, quants

    hfmap = HFMap(quants=quants(DEEPSEEK_GLOBS, BLOCK))
    gen = torch.Generator().manual_seed(0)
    files: dict[str, dict[str, Any]] = {}
    sizes = {"tensor_bytes": 0, "fp8_and_scale_bytes": 0}
    for key, shape in _hf_tensors(cfg).items():
        parts = key.split(".")
        name = f"model-{parts[2]}.safetensors" if parts[1] == "layers" else "model-rest.safetensors"
        w = torch.randn(shape, generator=gen) * 0.02
        if key.endswith("norm.weight"):
            w += 1.0
        bq = hfmap.quant_of(key)
        if bq is None:
            new = {key: w.to(torch.bfloat16)}
        else:
            q, s = quantize(w, bq)
            new = {key: q, bq.scale_key(key): s}
        n = sum(t.numel() * t.element_size() for t in new.values())
        sizes["tensor_bytes"] += n
        sizes["fp8_and_scale_bytes"] += n if bq is not None else 0
        files.setdefault(name, {}).update(new)
    os.makedirs(folder)
    weight_map: dict[str, str] = {}
    for name, tensors in files.items():
        save_file(tensors, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
    index = {"metadata": {"total_size": sizes["tensor_bytes"]}, "weight_map": weight_map}
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f)
    config = hfm.deepseek_v3_config(**cfg)
    config.quantization_config = quantization_config(hfmap.quants[0])
    config.save_pretrained(folder)
    return sizes


def compile_layouts(gen: str, ckpt: str, cfg: Mapping[str, Any]) -> None:
    """``specs/deepseek_v3_fp8.shard`` for the model of ``cfg`` (its model manifest and the
    checkpoint's HF manifest), as ``gen/ds_fp8_ep.py`` and, with ``TP_EDITS``,
    ``gen/ds_fp8_tp.py``: the real CLI."""
    from tests.test_hf_fp8 import TP_EDITS

    def cli(*args: str) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "shardspec", *args], cwd=REPO, capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"shardspec {args[0]}: {done.stdout}{done.stderr}")

    os.makedirs(gen, exist_ok=True)
    args = [a for k, v in cfg.items() for a in ("--arg", f"{k}={v}")]
    manifest = os.path.join(gen, "ds_fp8.manifest.json")
    cli("manifest", "examples.models.hf:deepseek_v3_tiny", *args, "-o", manifest)
    cli("hf-manifest", ckpt, "-o", os.path.join(gen, "ds_fp8.hf.json"))
    with open(os.path.join(REPO, "specs", "deepseek_v3_fp8.shard"), encoding="utf-8") as f:
        text = f.read()
    text = text.replace("deepseek_v3.manifest.json", "ds_fp8.manifest.json")
    text = text.replace("deepseek_v3_fp8.hf.json", "ds_fp8.hf.json")
    variants = {"ep": text, "tp": text}
    for old, new in TP_EDITS:
        if variants["tp"].count(old) != 1:
            raise RuntimeError(f"specs/deepseek_v3_fp8.shard changed: {old!r}")
        variants["tp"] = variants["tp"].replace(old, new)
    for layout, spec in variants.items():
        path = os.path.join(gen, f"ds_fp8_{layout}.shard")
        with open(path, "w", encoding="utf-8") as f:
            f.write(spec)
        cli("compile", path, "-o", gen)


# ------------------------------------------------------------------------ methods


def hf_views(model: Any) -> dict[str, Any]:
    """The model's state keyed by the Hugging Face names, as views of its own storage:
    its DTensors (and plain buffers) as they are, and per stacked expert held here a
    DTensor viewing the stacked parameter's local part: what ``dcp.load`` into the model
    must be given (built once; ``distribute_tensor`` of the experts' ids, a collective,
    says which experts a rank holds)."""
    out: dict[str, Any] = {}
    for fqn, t in model.state_dict(keep_vars=True).items():
        head, _, name = fqn.rpartition(".")
        out |= _expert_views(head, name, t) if head.endswith("mlp.experts") else {fqn: t}
    return out


def _expert_views(head: str, name: str, t: Any) -> dict[str, Any]:
    """``t`` (stacked ``[experts, rows, cols]``) per expert held here, its HF tensors.

    The mesh dims that shard dim 0 give whole experts (which: ``t``'s placements applied
    to the experts' ids); at most one other shards a matrix dim, evenly: a DTensor on
    that dim's sub-mesh (gate_up's fused rows are gate's part then up's part, as ``fuse
    ffn as gate, up`` lays them out); none: a plain tensor, the whole expert."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    mesh, placements = t.device_mesh, t.placements
    ids = torch.arange(t.shape[0])
    # plain Shard(0) dims chunk first, in mesh order; a _StridedShard(0) (FSDP2 over ep)
    # chunks what the others left
    on0 = [i for i, p in enumerate(placements) if getattr(p, "dim", None) == 0]
    for i in sorted(on0, key=lambda i: type(placements[i]) is not Shard):
        ids = ids.tensor_split(mesh.size(i))[mesh.get_local_rank(i)]
    inner = [(i, p.dim - 1) for i, p in enumerate(placements) if getattr(p, "dim", 0) > 0]
    if len(inner) > 1:
        raise NotImplementedError(f"{head}.{name}: more than one matrix dim sharded")
    local, out = t.to_local(), {}
    rows, cols = t.shape[1:]
    for j, e in enumerate(ids.tolist()):
        if name == "gate_up_proj":
            half = local.shape[1] // 2
            parts = {"gate_proj": local[j, :half], "up_proj": local[j, half:]}
            shape = (rows // 2, cols)
        else:
            parts, shape = {name: local[j]}, (rows, cols)
        for proj, view in parts.items():
            key = f"{head}.{e}.{proj}.weight"
            if not inner:
                out[key] = view
                continue
            sub = mesh[mesh.mesh_dim_names[inner[0][0]]]
            out[key] = DTensor.from_local(
                view,
                sub,
                [Shard(inner[0][1])],
                run_check=False,
                shape=torch.Size(shape),
                stride=(cols, 1),
            )
    return out


def load_dcp(views: dict[str, Any], path: str, threads: int) -> None:
    """``dcp.load`` of :func:`hf_views` through torch's ``QuantizedHuggingFaceStorageReader``."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    reader = QuantizedHuggingFaceStorageReader(
        path, thread_count=threads, target_dtype=torch.float32, block_size=BLOCK[0]
    )
    dcp.load(views, storage_reader=reader)


def load_full(model: Any, path: str, hfmap: Any) -> None:
    """Every tensor read whole and dequantized whole, the experts stacked, then
    ``distribute_tensor`` with the parameter's placements; each full tensor freed after."""
    import safetensors
    import torch
    from torch.distributed.tensor import DTensor, distribute_tensor

    from shardspec.runtime.hf.fp8 import dequantize

    with open(os.path.join(path, "model.safetensors.index.json"), encoding="utf-8") as f:
        where = json.load(f)["weight_map"]
    handles = {n: safetensors.safe_open(os.path.join(path, n), "pt") for n in set(where.values())}

    def read(key: str, dtype: torch.dtype) -> torch.Tensor:
        t = handles[where[key]].get_tensor(key)
        bq = hfmap.quant_of(key)
        if bq is not None:
            skey = bq.scale_key(key)
            t = dequantize(t, handles[where[skey]].get_tensor(skey), bq.block)
        return t.to(dtype)

    with torch.no_grad():
        for fqn, t in model.state_dict(keep_vars=True).items():
            head, _, name = fqn.rpartition(".")
            if head.endswith("mlp.experts"):
                projs = ("gate_proj", "up_proj") if name == "gate_up_proj" else (name,)
                full = torch.stack(
                    [
                        torch.cat([read(f"{head}.{e}.{p}.weight", t.dtype) for p in projs])
                        for e in range(t.shape[0])
                    ]
                )
            else:
                full = read(fqn, t.dtype)
            if isinstance(t, DTensor):
                local = distribute_tensor(full, t.device_mesh, t.placements).to_local()
                t.to_local().copy_(local)
                del local
            else:
                t.copy_(full)
            del full


# ------------------------------------------------------------------------ ranks


def _rank(rank: int, world: int, opts: Mapping[str, Any]) -> dict[str, Any]:
    import importlib

    import torch
    import torch.distributed as dist

    from bench.bench_hf import count_safetensors
    from examples.models import hf as hfm
    from shardspec.runtime import hf

    torch.set_num_threads(1)
    sys.path.insert(0, opts["gen"])
    mod = importlib.import_module(f"ds_fp8_{opts['layout']}")
    path = opts["path"]
    mesh = mod.build_mesh(**LAYOUTS[opts["layout"]])
    with torch.device("meta"):
        model = hfm.deepseek_v3_tiny(**opts["cfg"]).to(torch.bfloat16)
    mod.distribute(model, mesh)
    model.to_empty(device="cpu")
    state = model.state_dict(keep_vars=True)
    locals_ = {
        k: (v.to_local() if hasattr(v, "to_local") else v).detach() for k, v in state.items()
    }
    views = hf_views(model)
    ops: dict[str, Callable[[], Any]] = {
        "shardspec": lambda: hf.load_hf(
            mod.SPEC, mod.HF, model, path, mesh, other_dtypes=True, progress=False
        ),
        "dcp": lambda: load_dcp(views, path, opts["threads"]),
        "full": lambda: load_full(model, path, mod.HF),
    }
    info: dict[str, Any] = {"times": {}, "bytes_read": {}, "same_bits": {}}
    ref: dict[str, torch.Tensor] = {}
    for method, op in ops.items():  # round 0: the same bits, the bytes each reads
        with torch.no_grad():
            for t in locals_.values():
                t.fill_(float("nan"))
        dist.barrier()
        with count_safetensors() as counts:
            out = op()
        info["bytes_read"][method] = counts["bytes"]
        if method == "shardspec":
            info["owned"], info["ss_read"] = out.bytes_owned, out.bytes_read
            ref = {k: v.clone() for k, v in locals_.items()}
        else:
            info["same_bits"][method] = sorted(
                k
                for k, v in locals_.items()
                if not torch.equal(v.view(torch.uint8), ref[k].view(torch.uint8))
            )
    del ref
    order = list(ops)
    for _ in range(opts["rounds"]):
        for method in order:
            dist.barrier()
            t0 = time.perf_counter()
            ops[method]()
            dist.barrier()
            info["times"].setdefault(method, []).append(time.perf_counter() - t0)
        order = order[1:] + order[:1]
    return info


def run(
    cfg: Mapping[str, Any], layouts: list[str], rounds: int, threads: int, keep: str | None
) -> dict[str, Any]:
    from shardspec.testing import run_ranks

    tmp = tempfile.mkdtemp(prefix="bench_hf_fp8_dcp_")
    root = keep or tmp
    ckpt, gen = os.path.join(root, "ckpt"), os.path.join(root, "gen")
    try:
        if not os.path.exists(ckpt):
            write_checkpoint(ckpt, cfg)
        if not os.path.exists(gen):
            compile_layouts(gen, ckpt, cfg)
        size = sum(os.path.getsize(os.path.join(ckpt, f)) for f in os.listdir(ckpt))
        res: dict[str, Any] = {"disk_bytes": size, "layouts": {}}
        for layout in layouts:
            opts = {
                "cfg": dict(cfg),
                "path": ckpt,
                "gen": gen,
                "layout": layout,
                "rounds": rounds,
                "threads": threads,
            }
            res["layouts"][layout] = run_ranks(_rank, 4, opts, timeout=1800)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def report(res: Mapping[str, Any]) -> list[str]:
    lines = [f"checkpoint on disk: {res['disk_bytes'] / 1e9:.3f} GB"]
    for layout, ranks in res["layouts"].items():
        lines.append(f"layout {layout} ({LAYOUTS[layout]}):")
        lines.append(
            "rank  owned  shardspec read  dcp read  full read  (MB)  same bits (dcp, full)"
        )
        for r, info in enumerate(ranks):
            b = info["bytes_read"]
            same = [not info["same_bits"][m] or info["same_bits"][m][:3] for m in ("dcp", "full")]
            lines.append(
                f"{r:4d}  {info['owned'] / 1e6:8.1f}  {b['shardspec'] / 1e6:8.1f}  "
                f"{b['dcp'] / 1e6:8.1f}  {b['full'] / 1e6:9.1f}  {same}"
            )
        slowest = {
            m: [max(x) for x in zip(*(i["times"][m] for i in ranks), strict=True)] for m in METHODS
        }
        med = {m: statistics.median(v) for m, v in slowest.items()}
        lines.append(
            "time (slowest rank, median of "
            f"{len(slowest['shardspec'])}): "
            + ", ".join(f"{m} {med[m]:.3f} s" for m in METHODS)
            + f"; shardspec/dcp {med['shardspec'] / med['dcp']:.3f}"
            + f", shardspec/full {med['shardspec'] / med['full']:.3f}"
        )
        lines.append(
            "rounds: " + json.dumps({m: [round(x, 3) for x in v] for m, v in slowest.items()})
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="ep,tp")
    ap.add_argument("--threads", type=int, default=1, help="the DCP reader's thread_count")
    ap.add_argument("--tiny", action="store_true", help="a DeepSeek-V3 of 128-dims")
    ap.add_argument("--keep", help="keep (and reuse) the checkpoint under this folder")
    args = ap.parse_args(argv)
    cfg = TINY if args.tiny else BIG
    res = run(cfg, args.layouts.split(","), args.rounds, args.threads, args.keep)
    print("\n".join(report(res)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
