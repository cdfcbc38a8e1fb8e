"""Multi-rank scenario for ``tests/test_diff.py``: save a checkpoint under spec OLD, load it
under spec NEW, on gloo CPU ranks (run by :func:`shardspec.testing.run_ranks`; module level,
so spawned ranks can import it).

Each pair's generated modules are files compiled by the test. Every rank builds the same
tiny Llama from one seed (the reference), distributes it on OLD's mesh and saves it; then
builds the model from another seed, distributes it on NEW's mesh and loads. A load that
succeeds must give every parameter the reference's values bitwise (``full_tensor()``);
one that fails must fail with shardspec's ``CheckpointError`` before changing anything.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType
from typing import Any

import torch

from examples.models import llama
from shardspec.runtime.checkpoint import CheckpointError

SEED, OTHER_SEED = 1234, 77


def _module(path: str) -> ModuleType:
    name = "diff_" + os.path.basename(path).removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(mod: ModuleType, seed: int) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = llama.tiny()
    mesh = mod.build_mesh()
    mod.distribute(model, mesh)
    return model, mesh


def save_then_load(
    rank: int, world: int, pairs: list[tuple[str, str, str]], ckpt_dir: str
) -> dict[str, tuple[str, list[str], str]]:
    """Per pair ``(name, OLD module file, NEW module file)``: ``("loaded", parameters
    that differ from the reference, "")`` or ``("refused", [], the error)``."""
    torch.manual_seed(SEED)
    reference = {k: v.detach().clone() for k, v in llama.tiny().state_dict().items()}
    out = {}
    for name, old_file, new_file in pairs:
        old, new = _module(old_file), _module(new_file)
        path = os.path.join(ckpt_dir, name)
        model, mesh = _model(old, SEED)
        old.save({"model": model.state_dict()}, path, mesh=mesh)
        model, mesh = _model(new, OTHER_SEED)
        before = {k: p.full_tensor().clone() for k, p in model.named_parameters()}
        try:
            new.load({"model": model.state_dict()}, path, mesh=mesh)
        except CheckpointError as e:
            unchanged = all(
                torch.equal(p.full_tensor(), before[k]) for k, p in model.named_parameters()
            )
            out[name] = ("refused", [] if unchanged else ["changed by a refused load"], str(e))
            continue
        wrong = [
            k for k, p in model.named_parameters() if not torch.equal(p.full_tensor(), reference[k])
        ]
        out[name] = ("loaded", wrong, "")
    return out
