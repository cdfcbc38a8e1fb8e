"""Block-scaled FP8 checkpoints (DeepSeek-V3's ``weight_scale_inv`` format) for
``tests/test_hf_fp8.py``: the format's reference, written here from its definition and
not from the runtime's code, checkpoints made with it, and the multi-rank scenarios.

The format: ``w = float32(q) * scale_inv[r // R, c // C]`` for an FP8 ``q`` and a float32
``scale_inv`` per ``R x C`` block (per matrix of a stacked 3-D tensor). The reference
quantizer takes each block's amax, ``scale = amax / FP8_MAX`` (``ue8m0``: the next power
of two) in the scale's dtype, ``q = clamp(w / scale)`` cast to FP8 (a block whose ``q`` is
all zero: scale 1.0), block by block in Python loops.

Failures are collected as strings (see ``dist_scenarios``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from shardspec.core.hfmap import BlockQuant, HFMap
from tests.hf_scenarios import Item, count_collectives, full_of, hf_state, same_bits

FP8 = {"float8_e4m3fn": (torch.float8_e4m3fn, 448.0), "float8_e5m2": (torch.float8_e5m2, 57344.0)}

# DeepSeek-V3's FP8 keys: every linear layer's weight (attention, dense MLP, shared and
# routed experts); embeddings, norms, the router's weight and e_score_correction_bias and
# lm_head stay as they are.
DEEPSEEK_GLOBS = (
    "model.layers.*.self_attn.*_proj.weight",
    "model.layers.*.self_attn.*_proj_with_mqa.weight",
    "model.layers.*.mlp.*_proj.weight",
    "model.layers.*.mlp.shared_experts.*_proj.weight",
    "model.layers.*.mlp.experts.*.*_proj.weight",
)
LLAMA_GLOBS = ("model.layers.*.self_attn.*_proj.weight", "model.layers.*.mlp.*_proj.weight")


def quants(
    globs: tuple[str, ...], block: tuple[int, int], fmt: str = "float32"
) -> tuple[BlockQuant, ...]:
    return tuple(BlockQuant(g, block=block, scale_format=fmt) for g in globs)


# ------------------------------------------------------------------------ the reference


def _ue8m0(x: float) -> float:
    """The smallest power of two >= ``x`` (> 0)."""
    p = 2.0 ** math.ceil(math.log2(x))
    while p / 2 >= x:
        p /= 2
    while p < x:
        p *= 2
    return p


# The dtype a scale is written in, per scale format (ue8m0: powers of two, as float32).
SCALE_STORED = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "ue8m0": torch.float32,
}


def ref_quantize_2d(
    w: torch.Tensor, block: tuple[int, int], fmt: str = "float32", dtype: str = "float8_e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The format's quantizer, block by block: ``(q, scale_inv)``. Per block: ``s = amax /
    FP8_MAX``, at least the scale dtype's smallest normal (``ue8m0``: the next power of
    two), rounded to the scale's dtype; ``q = clamp(b / s, -FP8_MAX, FP8_MAX)`` cast to
    FP8; a block whose ``q`` is all zero (zeros, or values too small for FP8 at that
    scale) has scale 1.0."""
    fp8, fmax = FP8[dtype]
    stored = SCALE_STORED[fmt]
    w = w.to(torch.float32)
    rows, cols = w.shape
    r, c = block
    scale = torch.empty((-(-rows // r), -(-cols // c)), dtype=stored)
    q = torch.empty(w.shape, dtype=fp8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            b = w[i * r : (i + 1) * r, j * c : (j + 1) * c]
            s = max(float(b.abs().max() / fmax), torch.finfo(stored).tiny)
            if fmt == "ue8m0":
                s = _ue8m0(s)
            s = float(torch.tensor(s, dtype=torch.float32).to(stored))
            qb = (b / s).clamp(-fmax, fmax).to(fp8)
            q[i * r : (i + 1) * r, j * c : (j + 1) * c] = qb
            scale[i, j] = s if bool((qb.to(torch.float32) != 0).any()) else 1.0
    return q, scale


def ref_quantize(
    w: torch.Tensor, block: tuple[int, int], fmt: str = "float32", dtype: str = "float8_e4m3fn"
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ref_quantize_2d`, per matrix of a stacked 3-D tensor."""
    if w.ndim == 2:
        return ref_quantize_2d(w, block, fmt, dtype)
    pairs = [ref_quantize_2d(m, block, fmt, dtype) for m in w]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def ref_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The format's definition, as the issue writes it (per matrix of a 3-D tensor)."""
    if q.ndim == 3:
        return torch.stack([ref_dequantize(a, b, block) for a, b in zip(q, scale, strict=True)])
    rows, cols = q.shape
    r, c = block
    full = scale.to(torch.float32).repeat_interleave(r, 0)[:rows]
    full = full.repeat_interleave(c, 1)[:, :cols]
    return q.to(torch.float32) * full


# ------------------------------------------------------------------------ checkpoints


def write_fp8(
    src: str, dst: str, qs: tuple[BlockQuant, ...], *, rest: torch.dtype | None = None
) -> list[str]:
    """``src``'s checkpoint with every key a declaration of ``qs`` matches stored FP8 with
    its scale (the reference quantizer), the rest in ``rest`` (their own dtype if None);
    the same files, the index's weight_map extended. Returns the FP8 keys."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return _rewrite(src, dst, lambda key, t: _quantized(key, t, qs, rest))


def write_dequantized(src: str, dst: str, qs: tuple[BlockQuant, ...]) -> None:
    """``src``'s FP8 checkpoint dequantized by the format's definition (float32), scales
    dropped: what a load must produce, in a folder transformers reads."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors") and name != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    state = hf_state(src)
    config = os.path.join(dst, "config.json")
    if os.path.exists(config):
        with open(config, encoding="utf-8") as f:
            data = json.load(f)
        data.pop("quantization_config", None)
        with open(config, "w", encoding="utf-8") as f:
            json.dump(data, f)

    hfmap = HFMap(quants=qs)

    def deq(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        q = hfmap.quant_of(key)
        if q is not None:
            return {key: ref_dequantize(t, state[q.scale_key(key)], q.block)}
        return {} if hfmap.is_scale(key) else {key: t}

    _rewrite(src, dst, deq)


def _quantized(
    key: str, t: torch.Tensor, qs: tuple[BlockQuant, ...], rest: torch.dtype | None
) -> dict[str, torch.Tensor]:
    for q in qs:
        if q.regex.match(key):
            data, scale = ref_quantize(t, q.block, q.scale_format)
            return {key: data, q.scale_key(key): scale}
    return {key: t.to(rest) if rest is not None and t.is_floating_point() else t}


def _rewrite(src: str, dst: str, convert: Any) -> list[str]:
    from safetensors.torch import load_file, save_file

    index = os.path.join(src, "model.safetensors.index.json")
    weight_map: dict[str, str] = {}
    changed = []
    for name in sorted(os.listdir(src)):
        if not name.endswith(".safetensors"):
            continue
        out: dict[str, torch.Tensor] = {}
        for key, t in load_file(os.path.join(src, name)).items():
            new = convert(key, t)
            if len(new) > 1:
                changed.append(key)
            out |= {k: v.contiguous() for k, v in new.items()}
        save_file(out, os.path.join(dst, name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(out, name)
    if os.path.exists(index):
        total = sum(t.numel() * t.element_size() for t in hf_state(dst).values())
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return sorted(changed)


# ------------------------------------------------------------------------ the scenarios


@dataclass(frozen=True)
class FP8Case:
    """Load FP8 checkpoint ``hf`` (a folder under the root, declared by ``globs`` in
    blocks of ``block``) through ``module`` on a mesh of ``sizes``; compare with the
    reference dequantization ``truth`` (llama: through the hand conversion; deepseek:
    transformers' own state dict of it); export to FP8 and compare with ``hf`` bitwise."""

    module: str
    sizes: tuple[tuple[str, int], ...]
    model: str  # llama, deepseek
    hf: str
    truth: str
    block: tuple[int, int]
    fmt: str = "float32"
    config: tuple[tuple[str, Any], ...] = ()  # the DeepSeek config's overrides
    rest: str | None = None  # the dtype of the checkpoint's other tensors, if not float32

    @property
    def label(self) -> str:
        mesh = "x".join(f"{a}{n}" for a, n in self.sizes)
        return f"{self.hf} -> {self.module} {mesh}"

    @property
    def globs(self) -> tuple[str, ...]:
        return LLAMA_GLOBS if self.model == "llama" else DEEPSEEK_GLOBS


def fp8_case(root: str, case: FP8Case, item: Item) -> None:
    mod = importlib.import_module(case.module)
    hfmap = dataclasses.replace(mod.HF, quants=quants(case.globs, case.block, case.fmt))
    mesh = mod.build_mesh(**dict(case.sizes))
    model = _fresh(case, mod, mesh)
    from shardspec.runtime import hf as hfrt

    hf_dir = os.path.join(root, case.hf)
    with count_collectives() as calls:
        report = hfrt.load_hf(mod.SPEC, hfmap, model, hf_dir, mesh, other_dtypes=True)
    if calls:
        item.fail.append(f"{item.label}: load_hf communicated: {calls}")
    item.extra["read/owned"] = report.bytes_read / report.bytes_owned
    item.extra["owned"] = report.bytes_owned
    want = _truth(root, case)
    got = model.state_dict(keep_vars=True)
    for fqn in sorted(want):
        item.checked += 1
        if not same_bits(full_of(got[fqn]), want[fqn]):
            item.fail.append(f"{item.label}: {fqn} differs from the reference dequantization")
    if set(got) != set(want):
        item.fail.append(f"{item.label}: keys differ: {sorted(set(got) ^ set(want))}")
    out = os.path.join(root, f"export-{item.label.replace(' ', '_')}")
    rest = getattr(torch, case.rest) if case.rest else None
    cfg = hf_dir if os.path.exists(os.path.join(hf_dir, "config.json")) else None
    hfrt.export_hf(mod.SPEC, hfmap, model, out, mesh, config=cfg, dtype=rest)
    dist.barrier()
    if dist.get_rank() == 0:
        _compare_export(item, out, hf_dir, case)


def _fresh(case: FP8Case, mod: Any, mesh: Any) -> torch.nn.Module:
    """The case's model, distributed, every entry 7.0 (what the load must overwrite)."""
    from examples.models import llama
    from tests.hf_buffer_scenarios import fresh_model

    if case.model != "llama":
        return fresh_model(mod, mesh, **dict(case.config))
    model = mod.distribute(llama.tiny(), mesh)
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            t.fill_(7.0)
    return model


def _truth(root: str, case: FP8Case) -> dict[str, torch.Tensor]:
    """The model's whole state by the reference dequantization (``case.truth``)."""
    folder = os.path.join(root, case.truth)
    if case.model == "llama":
        from examples.models import hf as hfm
        from examples.models import llama

        hf = {k: v.float() for k, v in hf_state(folder).items()}
        return {k: v.float() for k, v in hfm.llama_from_hf(hf, llama.LlamaConfig()).items()}
    import transformers

    owner = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach().clone() for k, v in owner.state_dict().items()}


def _compare_export(item: Item, out: str, hf_dir: str, case: FP8Case) -> None:
    """Rank 0: the export has the original FP8 checkpoint's keys, dtypes and bits (UE8M0:
    its dequantized values, see ``test_dequantize_then_quantize_is_bitwise``), and a
    config whose quantization_config transformers reads (when the original has a config)."""
    got, want = hf_state(out), hf_state(hf_dir)
    if got.keys() != want.keys():
        item.fail.append(f"{item.label} export: keys differ: {sorted(got.keys() ^ want.keys())}")
    item.extra["export fp8 keys"] = sum(t.dtype == torch.float8_e4m3fn for t in got.values())
    with open(os.path.join(out, "model.safetensors.index.json"), encoding="utf-8") as f:
        index = json.load(f)
    total = index["metadata"]["total_size"]
    # the index names every tensor the files hold (scales included), in the file holding it
    if set(index["weight_map"]) != set(got):
        item.fail.append(
            f"{item.label} export: the index names {sorted(set(index['weight_map']) ^ set(got))}"
            " differently from the files"
        )
    if total != sum(t.numel() * t.element_size() for t in got.values()):
        item.fail.append(f"{item.label} export: the index's total_size {total} is wrong")
    hfmap = HFMap(quants=quants(case.globs, case.block, case.fmt))
    if case.fmt == "ue8m0":
        got, want = _values(got, hfmap), _values(want, hfmap)
    for key in sorted(got.keys() & want.keys()):
        item.checked += 1
        if not same_bits(got[key], want[key]):
            item.fail.append(
                f"{item.label} export: {key} ({got[key].dtype}) differs from the original's "
                f"({want[key].dtype})"
            )
    if os.path.exists(os.path.join(hf_dir, "config.json")):
        import transformers

        qc = transformers.AutoConfig.from_pretrained(out).quantization_config
        item.extra["quantization_config"] = dict(qc)


def _values(state: dict[str, torch.Tensor], hfmap: HFMap) -> dict[str, torch.Tensor]:
    """``state`` with each FP8 key dequantized (the reference) and its scale dropped."""
    out = {}
    for key, t in state.items():
        q = hfmap.quant_of(key)
        if q is not None and key in state and q.scale_key(key) in state:
            out[key] = ref_dequantize(t, state[q.scale_key(key)], q.block)
        elif not hfmap.is_scale(key):
            out[key] = t
    return out


@dataclass(frozen=True)
class DamagedCase:
    """Load the FP8 checkpoint ``hf`` whose scale ``key`` holds a NaN in block (0, 0):
    only the ranks whose boxes that block covers read it."""

    case: FP8Case
    hf: str
    key: str

    @property
    def label(self) -> str:
        return f"{self.hf} (damaged {self.key})"


def damaged_case(root: str, d: DamagedCase, item: Item) -> None:
    """Records whether this rank raised, what, and whether its model kept its 7.0s."""
    from shardspec.runtime import hf as hfrt

    mod = importlib.import_module(d.case.module)
    hfmap = dataclasses.replace(mod.HF, quants=quants(d.case.globs, d.case.block, d.case.fmt))
    mesh = mod.build_mesh(**dict(d.case.sizes))
    model = _fresh(d.case, mod, mesh)
    try:
        hfrt.load_hf(mod.SPEC, hfmap, model, os.path.join(root, d.hf), mesh, other_dtypes=True)
        item.extra["raised"] = None
    except hfrt.HFError as e:
        item.extra["raised"] = str(e)
    item.extra["unchanged"] = all(  # this rank's own shards (no gather: others loaded)
        bool((_local(t) == 7.0).all()) for t in model.state_dict(keep_vars=True).values()
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t.detach()


def run_all(rank: int, world: int, root: str, cases: list[Any]) -> dict[str, Item]:
    from tests.hf_split_scenarios import run_each

    def one(root: str, case: Any, item: Item) -> None:
        (damaged_case if isinstance(case, DamagedCase) else fp8_case)(root, case, item)

    return run_each(root, cases, one)


# ---------------------------- issue 22's leftovers: stacked 3-D FP8 keys, pipeline stages

# transformers' GptOss stores its experts stacked, [E, rows, cols] per key, with a scale
# per expert and block; 5 x 7 blocks, which the ranks' cuts cut; BF16 scales on down_proj.
GPT_OSS_QUANTS = (
    BlockQuant("model.layers.*.mlp.experts.gate_up_proj", block=(5, 7)),
    BlockQuant("model.layers.*.mlp.experts.down_proj", block=(5, 7), scale_format="bfloat16"),
)
PP_QUANTS = quants(LLAMA_GLOBS, (5, 7))


@dataclass(frozen=True)
class LeftoverCase:
    """``stacked``: gpt_oss's FP8 checkpoint ``gpt_oss_fp8`` on dp_shard 2 x tp 2 (FSDP cuts
    the experts, tp their ffn: a rank holds 2 of 4 experts and half of down_proj's rows);
    ``pp``: the 4-layer Llama's FP8 checkpoint ``pp_fp8`` into this rank's stage of
    ``llama_pp_hf`` on pp 2 x tp 2. Each loads bitwise against the reference
    dequantization, with no collective, and exports the FP8 checkpoint back bitwise."""

    label: str


def leftover_case(root: str, case: LeftoverCase, item: Item) -> None:
    from shardspec.runtime import hf as hfrt

    if case.label == "stacked":
        mod = importlib.import_module("generated.gpt_oss")
        mesh = mod.build_mesh(tp=2)
        from tests.hf_dtype_scenarios import _model

        model = _model(mod, mesh)
        qs, hf, deq = GPT_OSS_QUANTS, "gpt_oss_fp8", "gpt_oss_deq"
        want = hf_state(os.path.join(root, deq))
        names = {k: k for k in want}
    else:
        from examples.models import hf as hfm
        from examples.models import llama
        from tests.hf_pipeline_scenarios import N_LAYERS, stage_model

        mod = importlib.import_module("llama_pp_hf")
        mesh = mod.build_mesh(pp=2, tp=2)
        model = stage_model(mod, mesh)
        qs, hf, deq = PP_QUANTS, "pp_fp8", "pp_deq"
        cfg = llama.LlamaConfig(n_layers=N_LAYERS)
        want = hfm.llama_from_hf(hf_state(os.path.join(root, deq)), cfg)
        names = mod.SPEC.global_names(list(model.state_dict()), mesh)
    hfmap = dataclasses.replace(mod.HF, quants=qs)
    hf_dir = os.path.join(root, hf)
    with count_collectives() as calls:
        report = hfrt.load_hf(mod.SPEC, hfmap, model, hf_dir, mesh)
    if calls:
        item.fail.append(f"{item.label}: load_hf communicated: {calls}")
    item.extra["read/owned"] = report.bytes_read / report.bytes_owned
    got = model.state_dict(keep_vars=True)
    item.extra["local shapes"] = {
        k: list(_local(t).shape) for k, t in got.items() if "experts" in k and "bias" not in k
    }
    for fqn, t in sorted(got.items()):
        item.checked += 1
        if not same_bits(full_of(t), want[names[fqn]]):
            item.fail.append(f"{item.label}: {fqn} differs from the reference dequantization")
    out = os.path.join(root, f"export-{case.label}")
    hfrt.export_hf(mod.SPEC, hfmap, model, out, mesh)
    dist.barrier()
    if dist.get_rank() == 0:
        exported, fp8 = hf_state(out), hf_state(hf_dir)
        if exported.keys() != fp8.keys():
            item.fail.append(f"{item.label} export: keys differ: {exported.keys() ^ fp8.keys()}")
        for key in sorted(exported.keys() & fp8.keys()):
            item.checked += 1
            if not same_bits(exported[key], fp8[key]):
                item.fail.append(f"{item.label} export: {key} differs from the FP8 checkpoint")
        item.extra["fp8 keys"] = sorted(k for k, t in exported.items() if t.element_size() == 1)


def run_leftovers(rank: int, world: int, root: str, cases: list[Any]) -> dict[str, Item]:
    from tests.hf_split_scenarios import run_each

    return run_each(root, cases, leftover_case)


def run_both(
    rank: int, world: int, root: str, cases: list[Any], left_root: str, left_cases: list[Any]
) -> dict[str, dict[str, Item]]:
    """:func:`run_all` on ``root`` then :func:`run_leftovers` on ``left_root``, in one spawn
    (tests/test_hf_fp8.py): each part's Items by label."""
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, or they thrash
    return {
        "main": run_all(rank, world, root, cases),
        "leftovers": run_leftovers(rank, world, left_root, left_cases),
    }
