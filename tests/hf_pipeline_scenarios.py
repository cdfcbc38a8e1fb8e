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

Tied weights (``gen/llama_pp_tied_hf``: specs/llama_pp_tied.shard with the hf block of a
tied checkpoint; ``reference-tied.pt``, the tied 4-layer Llama; ``hf-tied`` without
``lm_head.weight``, ``hf-tied-head`` with it equal to the embedding, ``hf-tied-missing``
without ``model.embed_tokens.weight``):

* ``tied pp2 split``/``tied pp4 split`` (pp x dp_shard, stage models cut by ``split_stage``
  from a model tied as transformers ties), ``tied pp2 megatron``/``tied pp4 megatron``
  (cut by ``llama.stage_model``, the last stage holding a copy), ``tied pp1 split`` (the
  whole tied model, dp_shard 4): both checkpoints load into fresh stage models with zero
  collectives, each file opened once; the first stage holds the weight as
  ``tok_embeddings.weight``, the last as ``output.weight``, middle stages not at all; every
  parameter is bitwise the reference's, the tied weight bitwise
  ``model.embed_tokens.weight`` (at pp 1 head and embedding stay one tensor); each rank
  reads its own shards' bytes, the copy included. Then the last stage's copy is made to
  differ and the stages export: no key in two files, ``model.embed_tokens.weight`` once and
  no ``lm_head.weight`` (the hf ``tie`` alias is not written: a tied checkpoint), the index
  naming each key's file, every tensor bitwise ``hf-tied``'s (so the tied weight came from
  the source's stage, not the stale copy).
* ``tied missing``: ``hf-tied-missing`` makes every rank at pp 2 (the last stage needs
  the embedding for its copy) raise HFError naming ``model.embed_tokens.weight``, without a
  collective, with the model unchanged.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
import traceback
from collections.abc import Callable
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
TIED_MODULE = "llama_pp_tied_hf"
ALIAS, SOURCE = "output.weight", "tok_embeddings.weight"  # the pipeline tie
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"  # the hf tie


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


def missing_key(
    c: Checks,
    module: str,
    root: str,
    *,
    tag: str = "missing key",
    hf: str = "hf-missing",
    missing: str = MISSING,
    build: Callable[[Any, Any], nn.Module] | None = None,
) -> None:
    mod = importlib.import_module(module)
    mesh = mod.build_mesh(pp=2, tp=1)
    model = stage_model(mod, mesh) if build is None else build(mod, mesh)
    before = snapshot(model)
    error = None
    try:
        with count_collectives() as calls, count_dispatched_collectives() as ops:
            mod.load_hf(model, os.path.join(root, hf), mesh)
    except HFError as e:
        error = str(e)
    except Exception as e:
        error = f"{type(e).__name__} instead of HFError: {e}"
    c.check(
        tag,
        error is not None and missing in error and "instead of HFError" not in error,
        f"{module} stage {mod.stage_of(mesh)}: "
        + ("loaded without an error" if error is None else f"the error does not name {missing}")
        + f":\n{error}",
    )
    c.check(tag, not calls and not ops, f"a failing load_hf communicated: {calls} {ops}")
    after = snapshot(model)
    changed = [k for k in before if not same_bits(before[k], after[k])]
    c.check(tag, not changed, f"{module}: the model changed: {changed[:3]}")


# --------------------------------------------------------------------------- tied weights


def tied_stage_model(mod: Any, mesh: Any, how: str) -> nn.Module:
    """This rank's stage of the tied 4-layer Llama, parallelized, holding values (seed 99)
    that a load must overwrite. ``how``: ``"split"`` cuts, by ``split_stage``, a model tied
    as transformers ties (the head's weight *is* the embedding's; at pp 1 that whole model);
    ``"megatron"`` cuts ``tiny_tied`` by ``llama.stage_model``, which gives the last stage
    an output module holding a copy of the embedding."""
    pp, stage = mod.num_stages(mesh), mod.stage_of(mesh)
    if how == "split":
        model = llama.tiny(n_layers=N_LAYERS)
        llama.init_weights(model, seed=99)
        model.output.weight = model.tok_embeddings.weight
        if pp > 1:
            mod.split_stage(model, mesh)
    elif how == "megatron":
        model = llama.tiny_tied(n_layers=N_LAYERS)
        llama.init_weights(model, seed=99)
        layers = [int(v) for v in mod.stage_layers(mesh)]
        llama.stage_model(model, layers, first=stage == 0, last=stage == pp - 1)
    else:
        raise ValueError(how)
    mod.parallelize(model, mesh)
    return model


def compare_tied_export(c: Checks, tag: str, out: str, want_dir: str) -> dict[str, Any]:
    """The export of the tied model: each key in exactly one file (one rank wrote it), the
    index naming that file, no ``lm_head.weight`` (the tied checkpoint's form: the
    embedding stored once), and every tensor bitwise ``want_dir``'s. Returns the file that
    holds the embedding."""
    import json

    from safetensors import safe_open

    held: dict[str, list[str]] = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(out, name), framework="pt") as f:
                for key in f.keys():
                    held.setdefault(key, []).append(name)
    twice = {k: v for k, v in held.items() if len(v) > 1}
    c.check(tag, not twice, f"keys written by more than one rank: {twice}")
    c.check(
        tag,
        HEAD not in held and held.get(EMBED) is not None and len(held[EMBED]) == 1,
        f"{EMBED} in {held.get(EMBED)}, {HEAD} in {held.get(HEAD)}: the tied weight must be "
        f"exported once, as {EMBED}",
    )
    with open(os.path.join(out, "model.safetensors.index.json"), encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    c.check(
        tag,
        weight_map == {k: v[0] for k, v in held.items()},
        "the index's weight_map does not name the file each key is in",
    )
    compare_export(c, tag, out, want_dir)
    return {"embed_file": (held.get(EMBED) or [None])[0]}


def tied_case(
    c: Checks, tag: str, root: str, ref: dict[str, torch.Tensor], *, pp: int, how: str
) -> None:
    """The tied spec at pp x dp_shard (4 ranks): load both tied checkpoints (without
    lm_head.weight, and with it equal to the embedding) into fresh stage models, check,
    then export from the last one, whose alias copy is first made to differ from the
    source: the export must take the tied weight from its source's (lowest) stage."""
    mod = importlib.import_module(TIED_MODULE)
    mesh = mod.build_mesh(pp=pp, tp=1)  # dp_shard: the rest of the 4 ranks
    stage, n_stages = mod.stage_of(mesh), mod.num_stages(mesh)
    stage_names = set(mod.stage_params(mesh))
    embed = hf_state(os.path.join(root, "hf-tied"))[EMBED]
    holds_want = SOURCE if stage == 0 else ALIAS if stage == n_stages - 1 else None
    model: nn.Module | None = None
    params: dict[str, nn.Parameter] = {}
    for ckpt in ("hf-tied", "hf-tied-head"):
        model = tied_stage_model(mod, mesh, how)
        params = dict(model.named_parameters())
        holds = [k for k in (SOURCE, ALIAS) if k in params]
        c.check(
            tag,
            holds == ([holds_want] if holds_want else []),
            f"stage {stage} of {n_stages} holds the tied weight as {holds}, not {holds_want}",
        )
        with count_collectives() as calls, count_dispatched_collectives() as ops:
            with count_opens() as opens:
                report = mod.load_hf(model, os.path.join(root, ckpt), mesh)
        c.check(tag, not calls and not ops, f"{ckpt}: load_hf communicated: {calls}, {ops}")
        c.check(
            tag,
            bool(opens) and all(k == 1 for k in opens.values()),
            f"{ckpt}: files not opened once each: {opens}",
        )
        gname = mod.SPEC.global_names(list(params), mesh)
        c.check(
            tag,
            set(gname.values()) == stage_names,
            f"the stage model holds {sorted(gname.values())}, stage_params says "
            f"{sorted(stage_names)}",
        )
        for name, p in sorted(params.items()):
            c.check(
                tag,
                same_bits(full_of(p), ref[gname[name]]),
                f"{ckpt}: {name} (= {gname[name]}) differs from the single-process model",
            )
        if holds_want is not None:
            # The tied weight, under whichever name this stage holds it: the HF embedding.
            c.check(
                tag,
                same_bits(full_of(params[holds_want]), embed),
                f"{ckpt}: stage {stage}'s {holds_want} is not {EMBED} after load_hf",
            )
        if n_stages == 1:
            c.check(
                tag,
                model.output.weight is model.tok_embeddings.weight,
                f"{ckpt}: the whole model's head and embedding are no longer one tensor",
            )
        local_bytes = sum(local_of(p).numel() * local_of(p).element_size() for p in params.values())
        c.check(
            tag,
            report.bytes_read == report.bytes_owned == local_bytes,
            f"{ckpt}: read {report.bytes_read} bytes, owned {report.bytes_owned}, its shards "
            f"hold {local_bytes}",
        )
        c.extra[tag] = {
            "stage": stage,
            "bytes_read": report.bytes_read,
            "stage_bytes": sum(math.prod(mod.PARAMS[f].shape) * 4 for f in stage_names),
            "model_bytes": sum(t.numel() * t.element_size() for t in ref.values()),
            "tied_bytes": embed.numel() * embed.element_size(),
        }
    assert model is not None

    if ALIAS in params:
        # A stale copy on the alias's stage: the export must not take it.
        with torch.no_grad():
            local_of(params[ALIAS]).add_(1.0)
        c.check(
            tag,
            not same_bits(full_of(params[ALIAS]), embed),
            "perturbing the alias's local shard did not change it",
        )
    out = os.path.join(root, f"export-{tag.replace(' ', '-')}")
    exported = mod.export_hf(model, out, mesh)
    c.extra[tag] |= {"written": exported.bytes_written, "file": exported.file}
    c.extra[tag] |= compare_tied_export(c, tag, out, os.path.join(root, "hf-tied"))


def run_all(rank: int, world: int, root: str) -> tuple[list[str], dict[str, int], dict]:
    gen = os.path.join(root, "gen")
    if gen not in sys.path:
        sys.path.insert(0, gen)
    import logging

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    c = Checks()
    ref = torch.load(os.path.join(root, "reference.pt"))
    tref = torch.load(os.path.join(root, "reference-tied.pt"))
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
        ("tied pp2 split", lambda: tied_case(c, "tied pp2 split", root, tref, pp=2, how="split")),
        (
            "tied pp2 megatron",
            lambda: tied_case(c, "tied pp2 megatron", root, tref, pp=2, how="megatron"),
        ),
        ("tied pp4 split", lambda: tied_case(c, "tied pp4 split", root, tref, pp=4, how="split")),
        (
            "tied pp4 megatron",
            lambda: tied_case(c, "tied pp4 megatron", root, tref, pp=4, how="megatron"),
        ),
        ("tied pp1 split", lambda: tied_case(c, "tied pp1 split", root, tref, pp=1, how="split")),
        (
            "tied missing",
            lambda: missing_key(
                c,
                TIED_MODULE,
                root,
                tag="tied missing",
                hf="hf-tied-missing",
                missing=EMBED,
                build=lambda mod, mesh: tied_stage_model(mod, mesh, "megatron"),
            ),
        ),
    ]
    for tag, step in steps:
        try:
            step()
        except Exception:
            c.fail.append(f"[{tag}] raised:\n{traceback.format_exc()}")
        dist.barrier()
    return c.fail, c.count, c.extra
