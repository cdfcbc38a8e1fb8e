"""Distribute the example models on 4 CPU ranks with the generated layouts and print each
rank's shards. Run after `shardspec compile`:

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


def main() -> int:
    from shardspec.testing import run_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=4, help="number of CPU ranks (default 4)")
    args = ap.parse_args()
    for rank, lines in enumerate(run_ranks(run, args.world)):
        print("\n".join(lines))
        if rank == 0:
            print()
    print(f"distributed {len(DEMOS)} example models on {args.world} gloo ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
