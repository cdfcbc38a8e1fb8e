"""Multi-rank scenarios for ``tests/test_hf_pipeline.py``: Hugging Face checkpoints loaded
into, and exported from, pipeline stage models (one spawn of 4 gloo ranks).

``root`` (written by the test) holds ``reference.pt`` (the single-process 4-layer tiny
Llama's state dict), ``hf`` (that model as a Hugging Face checkpoint, written by hand as
specs/llama.shard's hf block maps it), ``hf-missing`` (the same without a key of the
second stage) and ``gen`` (compiled specs: ``llama4``, specs/llama.shard for the 4-layer
model; ``llama_pp_hf`` and ``llama_pp_hf_local``, specs/llama_pp.shard with that hf block,
stage models under global names and with stage-local layer numbers).

Every scenario appends failure strings instead of raising and counts its checks (per
rank), so the parent sees every difference at once and a scenario that checks nothing
fails. Scenarios:

* ``unsplit export``: the reference model, parallelized by the non-pipeline spec (dp 2 x
  tp 2), exported; equal, bitwise and key for key, to the input checkpoint. It is the
  export every stage export is compared with.
* ``pp2 global``/``pp2 local``/``pp4 local`` (pp x dp, no tp): split (``split_stage``),
  parallelized stage models load the checkpoint: zero collectives, each file opened once,
  every parameter bitwise the reference's, each rank's bytes read equal to its own
  shards' bytes (the parent adds them up per stage against the stage's parameter bytes);
  then the stage models export, equal to the unsplit export bitwise. ``pp1 global``: a
  pipeline of one stage (the whole model on every rank, dp 4).
* ``pp2 tp2 bf16``: the same at pp 2 x tp 2 (norms replicated over tp: their writers
  are chosen by the byte balancing, which every rank must compute for every stage) with
  a bf16 model (the manifest says fp32: the export must use the dtypes the stages hold);
  the load casts, the export equals the unsplit export cast to bf16.
* ``missing key``: a checkpoint missing a key of the last stage makes every rank (also
  the first stage's, which read none of it) raise HFError naming it; the model is unchanged.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.models import llama
from shardspec.runtime.hf import HFError
from shardspec.testing import Checks as _Checks
from tests.hf_scenarios import (
    count_collectives,
    count_dispatched_collectives,
    count_opens,
    full_of,
    hf_state,
    local_of,
    same_bits,
    snapshot,
)

N_LAYERS = 4
MISSING = "model.layers.3.mlp.up_proj.weight"  # on the last stage at pp 2 and pp 4


class Checks(_Checks):
    def __init__(self) -> None:
        super().__init__()
        self.extra: dict[str, dict[str, Any]] = {}


def stage_model(mod: Any, mesh: Any, dtype: torch.dtype = torch.float32) -> nn.Module:
    """This rank's stage of the 4-layer tiny Llama, parallelized, holding values (seed 99)
    that a load must overwrite."""
    model = llama.tiny(n_layers=N_LAYERS)
    llama.init_weights(model, seed=99)
    model.to(dtype)
    mod.split_stage(model, mesh)
    mod.parallelize(model, mesh)
    return model


def compare_export(
    c: Checks, tag: str, got_dir: str, want_dir: str, dtype: torch.dtype = torch.float32
) -> None:
    """Every rank: the tensors under ``got_dir`` against ``want_dir``'s (cast to
    ``dtype``), key for key, bitwise (the index's keys too)."""
    import json

    got, want = hf_state(got_dir), hf_state(want_dir)
    want = {k: v.to(dtype) for k, v in want.items()}
    c.check(
        tag,
        set(got) == set(want),
        f"exported keys differ: extra {sorted(set(got) - set(want))}, "
        f"missing {sorted(set(want) - set(got))}",
    )
    with open(os.path.join(got_dir, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    c.check(tag, set(index["weight_map"]) == set(want), "the index's weight_map keys differ")
    for key in sorted(set(got) & set(want)):
        c.check(tag, same_bits(got[key], want[key]), f"exported {key} differs")


def unsplit_export(c: Checks, root: str, ref: dict[str, torch.Tensor]) -> None:
    tag = "unsplit export"
    mod = importlib.import_module("llama4")
    mesh = mod.build_mesh(tp=2)  # dp_shard 2
    model = llama.tiny(n_layers=N_LAYERS)
    model.load_state_dict(ref)
    mod.parallelize(model, mesh)
    out = os.path.join(root, "export-unsplit")
    report = mod.export_hf(model, out, mesh)
    c.extra[tag] = {"written": report.bytes_written}
    compare_export(c, tag, out, os.path.join(root, "hf"))


def pp_case(
    c: Checks,
    tag: str,
    module: str,
    root: str,
    ref: dict[str, torch.Tensor],
    *,
    pp: int,
    tp: int = 1,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Load into this rank's stage model, check, export, compare. ``dtype``: the model's
    (the files are fp32: the load casts, the export writes the model's dtype)."""
    mod = importlib.import_module(module)
    mesh = mod.build_mesh(pp=pp, tp=tp)  # dp_shard: the rest of the 4 ranks
    model = stage_model(mod, mesh, dtype)
    hf_dir = os.path.join(root, "hf")
    with count_collectives() as calls, count_dispatched_collectives() as ops:
        with count_opens() as opens:
            report = mod.load_hf(model, hf_dir, mesh)
    c.check(tag, not calls and not ops, f"load_hf communicated: calls {calls}, c10d ops {ops}")
    c.check(
        tag,
        bool(opens) and all(n == 1 for n in opens.values()),
        f"files not opened once each: {opens}",
    )

    # Every parameter, under its global name, bitwise the single-process model's.
    params = dict(model.named_parameters())
    gname = mod.SPEC.global_names(list(params), mesh)
    stage_names = set(mod.stage_params(mesh))
    c.check(
        tag,
        set(gname.values()) == stage_names,
        f"the stage model holds {sorted(gname.values())}, stage_params says {sorted(stage_names)}",
    )
    for name, p in sorted(params.items()):
        got, want = full_of(p), ref[gname[name]].to(dtype)
        c.check(
            tag,
            same_bits(got, want),
            f"{name} (= {gname[name]}) differs from the single-process model after load_hf",
        )

    # Bytes: this rank's own shards only (the parent adds them up per stage).
    local_bytes = sum(local_of(p).numel() * local_of(p).element_size() for p in params.values())
    stage_bytes = sum(math.prod(mod.PARAMS[f].shape) * 4 for f in sorted(stage_names))
    # The files are fp32: bytes read count 4 per element whatever the model's dtype.
    file_bytes = local_bytes * 4 // torch.empty((), dtype=dtype).element_size()
    c.check(
        tag,
        report.bytes_read == report.bytes_owned == file_bytes,
        f"read {report.bytes_read} bytes, owned {report.bytes_owned}, its shards hold "
        f"{file_bytes} (in the files' fp32)",
    )
    c.extra[tag] = {
        "stage": mod.stage_of(mesh),
        "bytes_read": report.bytes_read,
        "stage_bytes": stage_bytes,
        "model_bytes": sum(t.numel() * t.element_size() for t in ref.values()),
    }

    # Export from the stage models: the unsplit model's export, bitwise.
    out = os.path.join(root, f"export-{tag.replace(' ', '-')}")
    exported = mod.export_hf(model, out, mesh)
    c.extra[tag]["written"] = exported.bytes_written
    compare_export(c, tag, out, os.path.join(root, "export-unsplit"), dtype)


def missing_key(c: Checks, module: str, root: str) -> None:
    tag = "missing key"
    mod = importlib.import_module(module)
    mesh = mod.build_mesh(pp=2, tp=1)
    model = stage_model(mod, mesh)
    before = snapshot(model)
    error = None
    try:
        with count_collectives() as calls, count_dispatched_collectives() as ops:
            mod.load_hf(model, os.path.join(root, "hf-missing"), mesh)
    except HFError as e:
        error = str(e)
    except Exception as e:
        error = f"{type(e).__name__} instead of HFError: {e}"
    c.check(
        tag,
        error is not None and MISSING in error and "instead of HFError" not in error,
        f"{module} stage {mod.stage_of(mesh)}: "
        + ("loaded without an error" if error is None else f"the error does not name {MISSING}")
        + f":\n{error}",
    )
    c.check(tag, not calls and not ops, f"a failing load_hf communicated: {calls} {ops}")
    after = snapshot(model)
    changed = [k for k in before if not same_bits(before[k], after[k])]
    c.check(tag, not changed, f"{module}: the model changed: {changed[:3]}")


def run_all(rank: int, world: int, root: str) -> tuple[list[str], dict[str, int], dict]:
    gen = os.path.join(root, "gen")
    if gen not in sys.path:
        sys.path.insert(0, gen)
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    c = Checks()
    ref = torch.load(os.path.join(root, "reference.pt"))
    steps = [
        ("unsplit export", lambda: unsplit_export(c, root, ref)),
        ("pp2 global", lambda: pp_case(c, "pp2 global", "llama_pp_hf", root, ref, pp=2)),
        ("pp2 local", lambda: pp_case(c, "pp2 local", "llama_pp_hf_local", root, ref, pp=2)),
        ("pp4 local", lambda: pp_case(c, "pp4 local", "llama_pp_hf_local", root, ref, pp=4)),
        ("pp1 global", lambda: pp_case(c, "pp1 global", "llama_pp_hf", root, ref, pp=1)),
        (
            "pp2 tp2 bf16",
            lambda: pp_case(
                c, "pp2 tp2 bf16", "llama_pp_hf", root, ref, pp=2, tp=2, dtype=torch.bfloat16
            ),
        ),
        ("missing key", lambda: missing_key(c, "llama_pp_hf", root)),
        ("missing key", lambda: missing_key(c, "llama_pp_hf_local", root)),
    ]
    for tag, step in steps:
        try:
            step()
        except Exception:
            c.fail.append(f"[{tag}] raised:\n{traceback.format_exc()}")
        dist.barrier()
    return c.fail, c.count, c.extra
