"""A small real trainer on a shardspec layout, launched with torchrun.

One node, 4 processes (CPU + gloo here; CUDA + NCCL, one GPU per process, where present)::

    torchrun --nproc-per-node 4 examples/train.py --spec specs/llama.shard \\
        --mesh dp_shard=2,tp=2 --steps 20 --save-every 5 --ckpt /tmp/run

It builds the spec's mesh, the model the spec was compiled from (its ``FACTORY``, initialized
from ``--seed``; ``--hf PATH`` loads a Hugging Face checkpoint instead), parallelizes it
(tensor parallelism and FSDP2, as the spec says), and runs AdamW steps on a synthetic batch
stream seeded by the step number, so a resumed run sees the same data. Every ``--save-every``
steps it saves model, optimizer, step and RNG state asynchronously to ``--ckpt/step_N``;
on start it resumes from the latest complete checkpoint there, on whatever mesh it runs now
(a checkpoint saved at ``dp_shard=2,tp=2`` loads at ``dp_shard=4,tp=1``). Rank 0 prints one
loss line per step.

The spec's module is the one ``shardspec compile`` wrote under ``generated/`` (compiling is a
build step, as for protobuf: the trainer imports no compiler), and it must be up to date with
the spec: a stale module is refused.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `generated` and `examples` are packages of the repository
    sys.path.insert(0, str(ROOT))

from shardspec.runtime.checkpoint.folders import MARKER  # noqa: E402 (after the path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", required=True, help="the .shard file (compiled under generated/)")
    ap.add_argument("--mesh", default="", help="axis sizes, e.g. dp_shard=2,tp=2 (spec defaults)")
    ap.add_argument("--steps", type=int, default=20, help="train until this step (default 20)")
    ap.add_argument("--save-every", type=int, default=0, help="save every N steps (0: never)")
    ap.add_argument("--ckpt", default="", help="checkpoint folder: resume from, save to")
    ap.add_argument("--hf", default="", help="a Hugging Face checkpoint to start from")
    ap.add_argument("--seed", type=int, default=0, help="initialization seed (default 0)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--seq", type=int, default=32, help="tokens per sequence")
    return ap.parse_args(argv)


def load_layout(spec: str) -> ModuleType:
    """The generated module of ``spec``, refused when the spec changed since it was compiled."""
    path = Path(spec)
    layout = importlib.import_module(f"generated.{path.stem}")
    if hashlib.sha256(path.read_bytes()).hexdigest() != layout.SPEC_SHA256:
        sys.exit(
            f"{spec} changed since generated/{path.stem}.py was compiled: run `shardspec compile`"
        )
    return layout


def mesh_sizes(text: str) -> dict[str, int]:
    """``dp_shard=2,tp=2`` -> ``{"dp_shard": 2, "tp": 2}``."""
    sizes = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        sizes[name.strip()] = int(value)
    return sizes


def build_model(layout: ModuleType, seed: int, device: torch.device) -> nn.Module:
    """The model the spec's manifest was built from, with the same values on every rank."""
    module_name, factory = layout.FACTORY.split(":")
    torch.manual_seed(seed)  # the modules' own initialization draws from the global RNG
    model = getattr(importlib.import_module(module_name), factory)(**layout.FACTORY_ARGS)
    return model.to(device)


def batch(step: int, vocab: int, args: argparse.Namespace, dp: Any) -> torch.Tensor:
    """This data-parallel rank's rows of the global batch of ``step`` (same on every run)."""
    gen = torch.Generator().manual_seed(1_000_003 * step + args.seed)
    tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=gen)
    return tokens.chunk(dp.size())[dp.get_local_rank()]


def latest_checkpoint(folder: str) -> tuple[int, str] | None:
    """The newest ``step_N`` under ``folder`` that a save completed (rank 0 looks; every rank
    gets its answer). A save interrupted between its renames left ``step_N.partial`` complete:
    ``load`` of ``step_N`` moves it into place."""
    found: list[tuple[int, str] | None] = [None]
    if dist.get_rank() == 0 and os.path.isdir(folder):
        steps = set()
        for name in os.listdir(folder):
            m = re.fullmatch(r"step_(\d+)(\.partial)?", name)
            if m and os.path.exists(os.path.join(folder, name, MARKER)):
                steps.add(int(m.group(1)))
        if steps:
            found[0] = (max(steps), os.path.join(folder, f"step_{max(steps)}"))
    dist.broadcast_object_list(found, src=0)
    return found[0]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    layout = load_layout(args.spec)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    mesh = layout.build_mesh(**mesh_sizes(args.mesh))  # NCCL on GPUs, else gloo
    rank = dist.get_rank()
    dp = mesh[layout.FSDP_AXIS]  # ranks that split the batch; the other axes see the same rows

    model = build_model(layout, args.seed, device)
    vocab = next(m for m in model.modules() if isinstance(m, nn.Embedding)).num_embeddings
    layout.parallelize(model, mesh)  # torch's TP styles, then FSDP2, as the spec lays them out
    if args.hf:
        layout.load_hf(model, args.hf, mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start = 0
    resume = latest_checkpoint(args.ckpt) if args.ckpt else None
    if resume is not None:
        model_sd, optim_sd = get_state_dict(model, optim)
        state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(0)}
        state["rng"] = torch.get_rng_state()  # tensors load in place
        layout.load(state, resume[1], mesh=mesh)  # reshards onto this mesh
        set_state_dict(model, optim, model_state_dict=model_sd, optim_state_dict=optim_sd)
        torch.set_rng_state(state["rng"])
        start = int(state["step"])
        if rank == 0:
            sizes = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
            print(f"resumed from {resume[1]} (step {start}) on {sizes}", flush=True)

    pending: tuple[int, Any] | None = None  # the save in flight: (step, future)
    for step in range(start + 1, args.steps + 1):
        tokens = batch(step, vocab, args, dp).to(device)
        logits = model(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)  # transformers' models return an output
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=dp.get_group())  # the loss over the global batch
        if rank == 0:
            print(f"step {step} loss {mean.item() / dp.size()!r}", flush=True)
        if pending is not None and pending[1].done():
            pending = finish(pending, rank)
        if args.save_every and args.ckpt and step % args.save_every == 0:
            if pending is not None:
                pending = finish(pending, rank)
            model_sd, optim_sd = get_state_dict(model, optim)
            state = {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step)}
            state["rng"] = torch.get_rng_state()
            path = os.path.join(args.ckpt, f"step_{step}")
            # Copies this rank's part to CPU memory and returns; writing runs in the background.
            pending = (step, layout.save(state, path, mesh=mesh, asynchronous=True))
    if pending is not None:
        finish(pending, rank)
    dist.destroy_process_group()


def finish(pending: tuple[int, Any], rank: int) -> None:
    """Wait for the save in flight (raises its CheckpointError) and say it is complete."""
    step, future = pending
    future.result()
    if rank == 0:
        print(f"checkpoint step_{step} complete", flush=True)


if __name__ == "__main__":
    main()
