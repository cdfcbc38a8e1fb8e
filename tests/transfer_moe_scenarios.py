"""Multi-rank scenarios of tests/test_transfer_moe.py: weight transfers from expert-parallel
and pipeline trainers, in one group of eight gloo ranks (trainer ranks 0-3, engine ranks
4..; a two-rank engine's group is ranks 0-5, ranks 6 and 7 then only build the meshes).

* ``moe``: the example MoE (examples/models/moe.py) under specs/deepseek_moe.shard at
  dp_shard 2 x ep 2 (FSDP2 over dp_shard of the stacked experts already cut over ep;
  ``style none``: the experts' forward sums the ep ranks' partial outputs) or under
  specs/deepseek_moe_folded.shard at dense (fsdp 2, tp 2) x expert (ep 2, efsdp 2)
  (two DeviceMeshes over the same four ranks; the experts dispatch tokens all-to-all),
  trained 2 AdamW steps; the engine is specs/deepseek_moe_engine_ep.shard at ep 4 or
  specs/deepseek_moe_engine_tp.shard at tp 2. A trainer is trained once and sends to its
  engines one after another (:func:`transfer_rounds`).
* ``pp``: the 4-layer example Llama under specs/llama_pp.shard plus specs/llama.shard's hf
  block (tests/test_hf_pipeline.py's ``compile_specs``: ``llama_pp_hf`` keeps the whole
  model's names, ``llama_pp_hf_local`` numbers each stage's layers from 0) at pp 2 x
  dp_shard 1 x tp 2: each rank holds its stage model (``split_stage``, ``parallelize``),
  whose parameters 2 AdamW steps changed (each stage on its own inputs: see
  :func:`_train_pp`); the engine is the same model under specs/llama.shard (``llama4``)
  at tp 2.

The owner's answer: the trainer's full tensors (torch's ``full_tensor()``, gathered on the
trainer ranks before the transfer, outside the counted block; a pipeline's from each
stage, under the whole model's names), loaded into a fresh model that the engine spec's
own ``parallelize`` cuts into the engine's layout (DTensor's ``distribute_tensor``): every
engine parameter must equal it bitwise. The hyper-connection head has no Hugging Face name
(``keep hc_head.*``) and is not transferred: the engine keeps its own, and the comparison
checks it did not change.
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import time
import traceback
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from examples.models import llama, moe
from shardspec.runtime import transfer
from shardspec.runtime.spec import MeshViews
from tests.hf_scenarios import count_collectives, count_dispatched_collectives

T = 4  # trainer ranks
LR, STEPS, VOCAB, BATCH, SEQ = 1e-2, 2, 256, 4, 9
NOT_SENT = re.compile(r"^hc_head\.")  # `keep hc_head.*`: no Hugging Face counterpart


def _mesh(ranks: range, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """A DeviceMesh over ``ranks`` (every rank of the world builds every mesh: torch makes
    its groups with every rank)."""
    return DeviceMesh(
        "cpu", torch.arange(ranks.start, ranks.stop).reshape(shape), mesh_dim_names=names
    )


def _trainer_mesh(kind: str) -> Any:
    if kind == "moe":
        return _mesh(range(T), (2, 2), ("dp_shard", "ep"))
    if kind == "folded":
        dense = _mesh(range(T), (2, 2), ("fsdp", "tp"))
        expert = _mesh(range(T), (2, 2), ("ep", "efsdp"))
        return MeshViews({"dense": dense, "expert": expert})
    return _mesh(range(T), (2, 1, 2), ("pp", "dp_shard", "tp"))


def _engine_mesh(engine: str) -> DeviceMesh:
    if engine == "ep4":
        return _mesh(range(T, T + 4), (4,), ("ep",))
    if engine == "moe-tp2":
        return _mesh(range(T, T + 2), (2,), ("tp",))
    return _mesh(range(T, T + 2), (1, 2), ("dp_shard", "tp"))  # llama4 at tp 2


def _data_rank(mesh: Any, kind: str) -> tuple[int, int]:
    """This trainer rank's data-parallel coordinate and size: ranks that must see the same
    tokens (ep ranks under ``style none``, tp ranks) share it."""
    if kind == "moe":
        return mesh["dp_shard"].get_local_rank(), 2
    return mesh["dense"]["fsdp"].get_local_rank(), 2


def _tokens(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _train_moe(model: nn.Module, mesh: Any, kind: str) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    g, n = _data_rank(mesh, kind)
    for step in range(STEPS):
        tokens = _tokens(step).chunk(n)[g]
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()


def _train_pp(model: nn.Module, mesh: DeviceMesh, mod: Any) -> None:
    """AdamW steps on this stage's own parameters: the stage's forward (tokens into the
    first stage, hidden states into the others; the same on every rank of the stage) and
    the mean square of its output as the loss. (Not through a pipeline schedule: in this
    harness's forked ranks torch.distributed.pipelining's GPipe hung now and then; what
    the transfer needs is stage models whose values the steps changed.)"""
    stage = mod.stage_of(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(2000 + 10 * step + stage)
        if stage == 0:
            x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        else:
            x = torch.randn(BATCH, SEQ, model.config.dim, generator=gen)
        out = model(x)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        out.float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: _local(p.detach()).clone() for n, p in model.named_parameters()}


def _global_names(mod: Any, mesh: DeviceMesh, model: nn.Module, local: bool) -> dict[str, str]:
    """Stage model's parameter name -> the whole model's name (``local``: the stage numbers
    its layers from 0, `split ... local`)."""
    layers = mod.stage_layers(mesh)
    out = {}
    for name, _ in model.named_parameters():
        m = re.fullmatch(r"layers\.(\d+)\.(.*)", name)
        out[name] = f"layers.{layers[int(m.group(1))]}.{m.group(2)}" if local and m else name
    return out


def _trainer(kind: str, case: dict[str, Any], mesh: Any) -> tuple[nn.Module, Any, dict]:
    """This trainer rank's model, trained; its generated module; its full tensors by the
    whole model's name (the owner's answer: torch's ``full_tensor()``)."""
    if kind == "pp":
        mod = importlib.import_module(case["trainer_module"])
        model = llama.tiny(n_layers=4)
        llama.init_weights(model, seed=3)
        mod.split_stage(model, mesh)
        mod.parallelize(model, mesh)
        _train_pp(model, mesh, mod)
        names = _global_names(mod, mesh, model, case.get("local_names", False))
    else:
        mod = importlib.import_module(f"generated.{case['trainer_module']}")
        torch.manual_seed(0)
        model = moe.tiny()
        mod.parallelize(model, mesh)
        _train_moe(model, mesh, kind)
        names = {n: n for n, _ in model.named_parameters()}
    full = {
        names[n]: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for n, p in model.named_parameters()
    }
    return model, mod, full


def _engine(case: dict[str, Any], mesh: DeviceMesh) -> tuple[nn.Module, Any, nn.Module]:
    """A fresh engine model parallelized by its spec (values unlike the trainer's), its
    generated module, and a factory's model for the owner's answer."""
    if case["kind"] == "pp":
        mod = importlib.import_module(case["engine_module"])
        torch.manual_seed(123)
        model: nn.Module = llama.tiny(n_layers=4)
        ref: nn.Module = llama.tiny(n_layers=4)
    else:
        mod = importlib.import_module(f"generated.{case['engine_module']}")
        torch.manual_seed(123)
        model, ref = moe.tiny(), moe.tiny()
    mod.parallelize(model, mesh)
    return model, mod, ref


def transfer_rounds(
    rank: int, world: int, folder: str, cases: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Every transfer case of ``cases`` (name -> case, all of one trainer: the same
    ``kind``, ``trainer_module`` and ``gen``) on this rank, one after another from one
    trained trainer (training it once per engine gave the same trainer twice); returns what
    the test checks, by name. A case: ``kind`` ("moe", "folded", "pp"), ``engine`` ("ep4",
    "moe-tp2", "tp2"), ``trainer_module``, ``engine_module``, ``plan``, ``bucket``; ``gen``
    (a folder of compiled modules)."""
    torch.set_num_threads(1)
    first = next(iter(cases.values()))
    if first.get("gen"):
        sys.path.insert(0, first["gen"])
    trainer_mesh = _trainer_mesh(first["kind"])
    export = os.path.join(folder, "export")
    trained = None
    if rank < T:
        trained = _trainer(first["kind"], first, trainer_mesh)
        torch.save(trained[2], f"{export}.{rank}.tmp")
        os.replace(f"{export}.{rank}.tmp", f"{export}.{rank}")
    return {name: _transfer(rank, export, case, trained) for name, case in cases.items()}


def _transfer(
    rank: int, export: str, case: dict[str, Any], trained: tuple[nn.Module, Any, dict] | None
) -> dict[str, Any]:
    """One transfer case on this rank: the trainer ranks send ``trained``'s model, the
    engine ranks receive into a fresh engine and compare with the trainers' full tensors
    (``export``.<rank>)."""
    engine = case["engine"]
    engine_mesh = _engine_mesh(engine)
    n = 4 if engine == "ep4" else 2
    group = None if n == 4 else torch.distributed.new_group(list(range(T + n)))
    out: dict[str, Any] = {"rank": rank}
    if rank >= T + n:
        return out  # not in the transfer group
    if trained is not None:
        model, spec, _ = trained
        call = transfer.send_weights
    else:
        model, spec, ref = _engine(case, engine_mesh)
        call = transfer.receive_weights
    before = _state(model)
    started = time.monotonic()
    try:
        with count_collectives() as calls, count_dispatched_collectives() as ops:
            stats = call(model, case["plan"], spec=spec, group=group, bucket_bytes=case["bucket"])
        out.update(stats=stats, calls=dict(calls), ops=dict(ops), error=None)
    except transfer.TransferError as e:
        out["error"] = str(e)
    except Exception:
        out["error"] = "UNEXPECTED " + traceback.format_exc()
    out["seconds"] = time.monotonic() - started
    out["stale"] = transfer.weights_stale(model)
    if rank >= T and out["error"] is None:  # (the exports were written before any transfer)
        full = {}
        for r in range(T):
            full.update(torch.load(f"{export}.{r}", weights_only=True))
        out["mismatch"] = _compare(model, ref, spec, engine_mesh, full, before)
    return out


def _compare(
    model: nn.Module,
    ref: nn.Module,
    spec: Any,
    mesh: DeviceMesh,
    full: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
) -> list[str]:
    """Parameters that differ, bitwise, from the trainer's full tensors cut into this
    engine's layout by the engine spec's ``parallelize``; a parameter the transfer does not
    carry must be unchanged."""
    sent = {k: v for k, v in full.items() if not NOT_SENT.match(k)}
    missing, unexpected = ref.load_state_dict(sent, strict=False)
    params = dict(ref.named_parameters())
    bad = [f"(no full tensor for {k})" for k in missing if k in params and not NOT_SENT.match(k)]
    bad += [f"(unexpected {k})" for k in unexpected]
    spec.parallelize(ref, mesh)
    want, got = _state(ref), _state(model)
    for name, value in got.items():
        expect = before[name] if NOT_SENT.match(name) else want[name]
        if value.dtype != expect.dtype or not torch.equal(value, expect):
            bad.append(name)
    if not sent or not got:
        bad.append("(no parameters compared)")
    return bad
