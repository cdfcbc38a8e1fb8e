"""Distribute the example models on 4 CPU ranks with the generated layouts and print each
rank's shards; parallelize the example Llama (FSDP2 x TP), train, save, load on another
mesh and continue (examples/story.py); then load a Hugging Face Llama checkpoint (written
here by transformers) into a parallelized model through the llama spec's hf block, and
export it back. Run after `shardspec compile`:

    python examples/demo.py [--world 4]
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEMOS = [
    # (generated module, model factory kwargs per EP rank?, mesh sizes for 4 ranks)
    ("generated.llama", {"tp": 2}),
    ("generated.llama_local", {"tp": 2}),
    ("generated.deepseek_moe", {"ep": 2}),
    ("generated.deepseek_moe_local", {"ep": 2}),
]


def _factory(mod):
    module_name, func = mod.FACTORY.split(":")
    return getattr(importlib.import_module(module_name), func)


def run(rank: int, world: int) -> list[str]:
    import torch
    from torch.distributed.tensor import DTensor

    lines = []
    for name, sizes in DEMOS:
        mod = importlib.import_module(name)
        mesh = mod.build_mesh(**sizes)
        model = _factory(mod)(**mod.FACTORY_ARGS)
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        mod.distribute(model, mesh)
        coord = dict(zip(mesh.mesh_dim_names, mesh.get_coordinate(), strict=True))
        lines.append(f"[{name}] rank {rank} {coord}")
        for fqn, p in model.named_parameters():
            if isinstance(p, DTensor):
                placements = ", ".join(str(x) for x in p.placements)
                lines.append(
                    f"  {fqn:<44} global {list(p.shape)!s:<13} local "
                    f"{list(p.to_local().shape)!s:<12} ({placements}) on "
                    f"{tuple(p.device_mesh.mesh_dim_names)}"
                )
    return lines


def hf_round_trip(rank: int, world: int, folder: str) -> list[str]:
    """Load ``folder/hf`` into the sharded example Llama (each rank reads its own slices),
    export it to ``folder/export``; rank 0 checks transformers' logits of the export."""
    import torch

    import generated.llama as spec
    from examples.models import llama

    mesh = spec.build_mesh(tp=2) if world % 2 == 0 else spec.build_mesh(tp=1)
    with torch.device("meta"):
        model = llama.tiny()
    spec.parallelize(model, mesh)  # torchtitan style: parallelize on meta, then materialize
    model.to_empty(device="cpu")
    report = spec.load_hf(model, f"{folder}/hf", mesh)
    lines = [
        f"[load_hf] rank {rank}: read {report.bytes_read:,} bytes for {report.bytes_owned:,} "
        f"owned, {report.reads} slices, files opened {sorted(report.files_opened.items())}"
    ]
    spec.export_hf(model, f"{folder}/export", mesh, config=f"{folder}/hf")
    if rank == 0:
        import transformers

        tokens = torch.arange(12).reshape(2, 6)
        with torch.no_grad():
            a = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/hf")(tokens).logits
            b = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/export")(tokens).logits
        diff = (a - b).abs().max().item()
        lines.append(f"[export_hf] transformers' logits, original vs exported: max diff {diff:.1e}")
    return lines


def write_hf_llama(folder: str) -> None:
    import torch
    import transformers

    from examples.models import hf

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf.llama_config(tied=False))
    model.save_pretrained(f"{folder}/hf", max_shard_size="200KB")


def main() -> int:
    import logging
    import tempfile

    from shardspec.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="number of CPU ranks (default 4)")
    args = ap.parse_args()
    for rank, lines in enumerate(run_ranks(run, args.world)):
        print("\n".join(lines))
        if rank == 0:
            print()
    print(f"distributed {len(DEMOS)} example models on {args.world} gloo ranks")
    print()
    from examples.story import train_story

    with tempfile.TemporaryDirectory() as folder:
        for lines in run_ranks(train_story, args.world, folder):
            print("\n".join(lines))
    try:
        import transformers  # noqa: F401  (the HF part needs it: pip install -e .[dev])
    except ImportError:
        print("transformers is not installed: skipping the Hugging Face load/export demo")
        return 0
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as folder:
        write_hf_llama(folder)
        for lines in run_ranks(hf_round_trip, args.world, folder):
            print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
