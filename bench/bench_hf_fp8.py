"""Block-scaled FP8 load: bytes each rank reads against the bytes it owns, and time,
``load_hf`` against reading every tensor whole.

    python -m bench.bench_hf_fp8                  # bench_hf's Llama, 4 ranks, 3 rounds
    python -m bench.bench_hf_fp8 --rounds 1 --tiny --world 2

The checkpoint is ``bench.bench_hf``'s fp32 Llama (``MODEL``: 249M parameters) rewritten as
DeepSeek ships its weights: every linear layer's weight ``float8_e4m3fn`` with a float32
``weight_scale_inv`` per 128 x 128 block (quantized by ``shardspec.runtime.hf.fp8``), the
embeddings, norms and ``lm_head`` bf16. 4 gloo CPU ranks, dp_shard 2 x tp 2, the model on the
llama spec's layout (``bench_checkpoint.bench_spec``), the map ``bench_hf.bench_hfmap`` with
the FP8 declarations. Two methods, interleaved, the files in the page cache:

* ``shardspec``: ``load_hf``: each rank reads the FP8 bytes of its own boxes and the scale
  blocks that cover them, and dequantizes them;
* ``full``: every rank reads every tensor whole, dequantizes it whole (the format's
  definition), converts with ``examples.models.hf.llama_from_hf`` and calls
  ``distribute_tensor`` per parameter (bench_hf's baseline (a)).

Round 0 checks that both give every rank the same bits. A call's time is the slowest
rank's wall time between two barriers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from typing import Any

from bench.bench_hf import (
    MODEL,
    _LazyHF,
    bench_hfmap,
    distributed_llama,
    load_full,
    write_checkpoint,
)

BLOCK = (128, 128)
GLOBS = ("model.layers.*.self_attn.*_proj.weight", "model.layers.*.mlp.*_proj.weight")
TINY: dict[str, int] = {}  # LlamaConfig's defaults: the model generated/llama.py was built from


def _quants(block: tuple[int, int]) -> tuple[Any, ...]:
    from shardspec.core.hfmap import BlockQuant

    return tuple(BlockQuant(g, block=block) for g in GLOBS)


def write_fp8(src: str, dst: str, block: tuple[int, int]) -> dict[str, int]:
    """``src``'s checkpoint, linear weights FP8 with their scales, the rest bf16."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from shardspec.core.hfmap import HFMap
    from shardspec.runtime.hf.fp8 import quantize

    hfmap = HFMap(quants=_quants(block))
    os.makedirs(dst)
    weight_map, total, fp8_bytes = {}, 0, 0
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors"):
            if name != "model.safetensors.index.json":
                shutil.copy(os.path.join(src, name), dst)
            continue
        out = {}
        with safe_open(os.path.join(src, name), framework="pt") as f:
            for key in f.keys():
                t, bq = f.get_tensor(key), hfmap.quant_of(key)
                if bq is None:
                    out[key] = t.to(torch.bfloat16)
                    continue
                out[key], out[bq.scale_key(key)] = quantize(t, bq)
                fp8_bytes += out[key].numel() + out[bq.scale_key(key)].numel() * 4
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, name)
        total += sum(t.numel() * t.element_size() for t in out.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump(index, f)
    return {"tensor_bytes": total, "fp8_and_scale_bytes": fp8_bytes}


class _LazyDequantized(_LazyHF):
    """The FP8 checkpoint read whole, tensor by tensor, each FP8 weight dequantized whole."""

    def __init__(self, path: str, hfmap: Any) -> None:
        super().__init__(path)
        self._hfmap = hfmap

    def __getitem__(self, key: str) -> Any:
        from shardspec.runtime.hf.fp8 import dequantize

        bq = self._hfmap.quant_of(key)
        t = super().__getitem__(key)
        if bq is None:
            return t
        return dequantize(t, super().__getitem__(bq.scale_key(key)), bq.block)

    def __iter__(self) -> Iterator[str]:
        return (k for k in super().__iter__() if not self._hfmap.is_scale(k))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def _rank(rank: int, world: int, opts: Mapping[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from bench.bench_checkpoint import bench_spec
    from shardspec.runtime import dtensor as rt
    from shardspec.runtime import hf

    torch.set_num_threads(1)
    cfg, path = opts["model"], opts["path"]
    spec = bench_spec(cfg)
    hfmap = dataclasses.replace(bench_hfmap(cfg), quants=_quants(opts["block"]))
    mesh = rt.build_mesh(spec, **opts["sizes"])
    model, locals_ = distributed_llama(spec, cfg, mesh)
    ops = {
        "shardspec": lambda: hf.load_hf(spec, hfmap, model, path, mesh, other_dtypes=True),
        "full": lambda: load_full(model, path, cfg, _LazyDequantized(path, hfmap)),
    }
    info: dict[str, Any] = {"times": {}}
    ref: dict[str, torch.Tensor] = {}
    for method in ops:  # round 0: the same bits
        with torch.no_grad():
            for t in locals_.values():
                t.fill_(float("nan"))
        out = ops[method]()
        if method == "shardspec":
            info["bytes_read"], info["bytes_owned"] = out.bytes_read, out.bytes_owned
            ref = {k: v.clone() for k, v in locals_.items()}
        else:
            info["same_bits"] = all(
                torch.equal(v.view(torch.uint8), ref[k].view(torch.uint8))
                for k, v in locals_.items()
            )
    for rnd in range(opts["rounds"]):
        for method in list(ops) if rnd % 2 else list(reversed(ops)):
            dist.barrier()
            t0 = time.perf_counter()
            ops[method]()
            dist.barrier()
            info["times"].setdefault(method, []).append(time.perf_counter() - t0)
    return info


def run(model: dict[str, int], world: int, rounds: int, block: tuple[int, int]) -> dict:
    from shardspec.testing import run_ranks

    tmp = tempfile.mkdtemp(prefix="bench_hf_fp8_")
    try:
        write_checkpoint(os.path.join(tmp, "fp32"), model)
        sizes = write_fp8(os.path.join(tmp, "fp32"), os.path.join(tmp, "fp8"), block)
        shutil.rmtree(os.path.join(tmp, "fp32"))
        opts = {
            "model": model,
            "path": os.path.join(tmp, "fp8"),
            "sizes": {"tp": 2} if world >= 4 else {"tp": 1},
            "rounds": rounds,
            "block": block,
        }
        ranks = run_ranks(_rank, world, opts, timeout=1800)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"sizes": sizes, "ranks": ranks}


def report(res: dict) -> list[str]:
    ranks = res["ranks"]
    lines = [
        f"checkpoint: {res['sizes']['tensor_bytes'] / 1e6:.1f} MB "
        f"(FP8 weights and scales {res['sizes']['fp8_and_scale_bytes'] / 1e6:.1f} MB)",
        "rank  bytes read  bytes owned  read/owned  same bits as full",
    ]
    for r, info in enumerate(ranks):
        ratio = info["bytes_read"] / info["bytes_owned"]
        lines.append(
            f"{r:4d}  {info['bytes_read']:10d}  {info['bytes_owned']:11d}  {ratio:10.4f}  "
            f"{info['same_bits']}"
        )
    slowest = {
        m: [max(x) for x in zip(*(i["times"][m] for i in ranks), strict=True)]
        for m in ranks[0]["times"]
    }
    ours, full = slowest["shardspec"], slowest["full"]
    lines.append(
        f"time (median of {len(ours)}, slowest rank): shardspec {statistics.median(ours):.3f} s, "
        f"full {statistics.median(full):.3f} s, ratio "
        f"{statistics.median([a / b for a, b in zip(ours, full, strict=True)]):.3f}"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--tiny", action="store_true", help="the tiny Llama, 8 x 8 blocks")
    args = ap.parse_args(argv)
    model, block = (TINY, (8, 8)) if args.tiny else (MODEL, BLOCK)
    print("\n".join(report(run(model, args.world, args.rounds, block))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
