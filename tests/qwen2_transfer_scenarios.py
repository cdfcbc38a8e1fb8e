"""Multi-rank scenario of tests/test_transfer_qwen2.py (issue 24 point 6, first bullet):
one job of eight gloo ranks. The trainer, ranks 0-3, is transformers' Qwen2ForCausalLM as
it is (specs/qwen2.shard: FSDP2 dp_shard 2 x tp 2), trained 2 AdamW steps, exported with
``export_hf`` over the trainer's own group of the larger job. The engines, vLLM-style
Qwen2 models built with their shard (examples/models/vllm.py, specs/qwen2_vllm_tp*.shard),
one after another on ranks 4.. of the same job: tp 4 (ranks 4-7, the 2 KV heads each held
by two ranks), tp 2 (ranks 4-5) and one rank (rank 4).

The owner's answer: the trainer's export_hf files, cut into each engine rank's tensors by
tests/vllm_slices.py (vLLM's weight_loader arithmetic). The engine also loads the same
files with its own ``load_hf`` (replicated KV heads read by every rank that holds them)
and exports what it received with ``export_hf`` over the engine's group (each element
written once): both must agree bitwise.
"""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import DeviceMesh

import generated.qwen2 as trainer_layout
import generated.qwen2_vllm_tp1 as engine_tp1
import generated.qwen2_vllm_tp2 as engine_tp2
import generated.qwen2_vllm_tp4 as engine_tp4
from examples.models.hf import qwen2_tiny
from examples.models.vllm import qwen2_engine
from shardspec.runtime import transfer
from tests import vllm_slices
from tests.hf_scenarios import count_collectives, count_dispatched_collectives

T = 4  # trainer ranks
ENGINES = {1: engine_tp1, 2: engine_tp2, 4: engine_tp4}
HEADS = {"heads": 4, "kv_heads": 2, "head_dim": 16}


def _hf_tensors(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of an export's files; a key in two files (written twice) is an error."""
    out: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            got = load_file(os.path.join(folder, name))
            twice = sorted(set(got) & set(out))
            if twice:
                raise AssertionError(f"{folder}: written twice: {twice}")
            out.update(got)
    return out


def _trained(mesh: DeviceMesh) -> torch.nn.Module:
    torch.manual_seed(0)
    model = qwen2_tiny()
    trainer_layout.parallelize(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1 + mesh.get_coordinate()[0])  # type: ignore[index]
    for _ in range(2):
        tokens = torch.randint(0, 256, (2, 8), generator=gen)
        out = model(input_ids=tokens, labels=tokens)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
    return model


def _mismatch(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    bad = [n for n in want if n not in got or not torch.equal(got[n], want[n])]
    bad += [n for n in got if n not in want]
    return bad or ([] if want else ["(nothing compared)"])


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def qwen2_rounds(rank: int, world: int, folder: str, plans: dict[int, str]) -> dict[str, Any]:
    """Every engine of ``plans`` (tp -> plan path) in turn; what the test checks."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank, "engines": {}}
    tmesh = DeviceMesh("cpu", torch.arange(T).reshape(2, 2), mesh_dim_names=("dp_shard", "tp"))
    emeshes = {
        tp: DeviceMesh("cpu", torch.arange(T, T + tp), mesh_dim_names=("tp",)) for tp in plans
    }
    trainer_group = dist.new_group(list(range(T)), backend="gloo")
    groups = {tp: dist.new_group(list(range(T + tp))) for tp in plans}
    engine_groups = {tp: dist.new_group(list(range(T, T + tp)), backend="gloo") for tp in plans}
    export = os.path.join(folder, "trainer-export")
    model: torch.nn.Module | None = None
    full: dict[str, torch.Tensor] = {}
    if rank < T:
        model = _trained(tmesh)
        trainer_layout.export_hf(model, export, tmesh, process_group=trainer_group)
        # torch's own gathering of the trained model (HF names are the model's own)
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    dist.barrier()  # the export is on disk (outside every counted block)
    hf = _hf_tensors(export)
    if rank < T:
        out["export_vs_torch"] = _mismatch(hf, full)
    for tp, plan in plans.items():
        result: dict[str, Any] = {}
        out["engines"][tp] = result
        if rank >= T + tp:
            continue  # not in this engine's group
        spec = ENGINES[tp]
        engine = None
        if rank >= T:
            torch.manual_seed(123)
            engine = qwen2_engine(tp=tp)
        try:
            with count_collectives() as calls, count_dispatched_collectives() as ops:
                if rank < T:
                    assert model is not None
                    stats = transfer.send_weights(
                        model, plan, spec=trainer_layout, group=groups[tp], bucket_bytes=8192
                    )
                else:
                    assert engine is not None
                    stats = transfer.receive_weights(
                        engine, plan, spec=spec, group=groups[tp], bucket_bytes=8192
                    )
            result.update(stats=stats, calls=dict(calls), ops=dict(ops), error=None)
        except Exception:
            result["error"] = traceback.format_exc()
            continue
        if engine is None:
            continue
        r = rank - T
        want = vllm_slices.engine_rank(hf, tp=tp, rank=r, **HEADS)
        got = _params(engine)
        result["mismatch"] = _mismatch(got, want)
        result["stale"] = transfer.weights_stale(engine)
        # load_hf of the same files: every rank reads its own (replicated) KV head
        fresh = qwen2_engine(tp=tp)
        spec.load_hf(fresh, export, emeshes[tp])
        result["load_mismatch"] = _mismatch(_params(fresh), want)
        # export_hf of what the engine received, over the engine's own group
        path = os.path.join(folder, f"engine-{tp}-export")
        spec.export_hf(engine, path, emeshes[tp], process_group=engine_groups[tp])
        dist.barrier(engine_groups[tp])
        try:
            result["export_mismatch"] = _mismatch(_hf_tensors(path), hf)
        except AssertionError as e:
            result["export_mismatch"] = [str(e)]
    return out
