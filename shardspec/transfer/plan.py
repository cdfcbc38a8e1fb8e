"""``shardspec transfer TRAIN.shard INFER.shard``: join a trainer spec and an inference
(engine) spec through their ``hf`` blocks, check the pair, and plan the point-to-point
moves that give every engine rank its own elements of every weight, each element once.

The plan (:func:`plan_json`) is JSON, format ``shardspec-transfer-plan/1``::

    {
      "format": "shardspec-transfer-plan/1",
      "fingerprint": "<sha256 of both sides' 'layout' objects>",
      "sender": {"spec": "specs/llama.shard", "world": 4, "mesh": {"dp_shard": 2, "tp": 2},
                 "layout": {"spec_sha256": ..., "manifest_sha256": ..., "mesh": {...},
                            "hf_map": ["<map line>", ...]}},
      "receiver": { ...the same for the engine... },
      "balance": "greedy-least-loaded",
      "tensors": [
        {"hf": "model.layers.0.self_attn.q_proj.weight", "shape": [64, 64],
         "src_dtype": "float32", "dtype": "bfloat16", "itemsize": 2,
         "moves": [
           {"src": 0, "dst": 1, "count": 512,
            "src_param": "layers.0.attention.wqkv.weight", "src_fixed": [],
            "dst_param": "layers.0.attention.wqkv.weight", "dst_fixed": [],
            "dims": [{"src_dim": 0, "dst_dim": 0, "runs": [[0, 0, 8, 2, 2], ...]},
                     {"src_dim": 1, "dst_dim": 1, "runs": [[0, 32, 32, 1, 1]]}]}, ...]}, ...],
      "totals": {"sent": [...bytes per sender rank], "received": [...per engine rank],
                 "owned": [...per engine rank], "wire_bytes": N, "engine_bytes": N}
    }

Ranks are each side's own (sender rank ``s`` of ``[0, T)``, engine rank ``r`` of
``[0, N)``; in a group that holds both, the engine's is ``T + r``). A move takes
``count`` elements of HF tensor ``hf`` from the sender's local tensor ``src_param`` (its
local shard as it keeps it in memory) to the engine's local tensor ``dst_param``.
``*_fixed`` lists ``[dim, position]`` pairs that select one index of a local dimension
first (a stacked source's expert). Then, per HF dimension in HF order, ``dims[k]`` says
along which local dimension of each side it lies, and its ``runs``: ``[src_start,
dst_start, count, src_step, dst_step]`` map local positions ``src_start + i*src_step`` of
the sender to ``dst_start + i*dst_step`` of the receiver. The elements of a move are the
product of its dims' runs, enumerated in HF dimension order (last fastest), which is the
order both sides pack and unpack a buffer in: the sender selects its positions per
dimension, permutes its local dims into HF order, casts to ``dtype`` and sends; the
receiver writes the buffer into the same positions of its own tensor (no full tensor
anywhere; runs on the wire can be grouped per (src, dst) pair for ``batch_isend_irecv``).
Local positions: a rank's local tensor holds its global indices of each dimension in
increasing order (:mod:`shardspec.core.transfer`).

Replicas (the same elements on several senders: dp-replicated, or tp-replicated norms)
are shared out greedily: each (tensor, receiver) piece goes to the replica with the
fewest bytes sent so far, in tensor-then-receiver order. FSDP shards are distinct owners,
never replicas. No torch and no collective: the plan is a pure function of the two specs,
their manifests and the mesh sizes, and the fingerprint changes when any of them does.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardspec.api import lint_specs
from shardspec.core.hfmap import HFMap, Source, dtype_kind, fused_of, unit_names
from shardspec.core.layout import Mesh, ParamLayout
from shardspec.core.transfer import Holding, Move, holdings, plan_tensor
from shardspec.findings.codes import diag
from shardspec.findings.diagnostics import Diagnostic, Span
from shardspec.findings.suggest import closest_few
from shardspec.resolve.hf import build_hfmap
from shardspec.resolve.params import Resolved

FORMAT = "shardspec-transfer-plan/1"

# Bytes per element of the dtypes a manifest names (torch's names).
ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


@dataclass
class Tensor:
    """One side's view of one HF tensor: its shape and dtype, the map line that names it,
    and every rank's holding."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    rule: int  # index into the side's hf block's maps
    held: list[Holding] = field(default_factory=list)


@dataclass
class Side:
    """One spec of the pair, resolved at its mesh sizes, with its HF tensors."""

    role: str  # "trainer" or "engine"
    path: str  # as displayed
    res: Resolved
    hfmap: HFMap
    mesh: Mesh
    tensors: dict[str, Tensor] = field(default_factory=dict)
    unsupported: set[int] = field(default_factory=set)  # rules whose layouts are not planned

    def span(self, rule: int) -> Span:
        """The map line ``rule`` of this side's hf block."""
        assert self.res.spec.hf is not None
        return self.res.spec.hf.maps[rule].span

    def layout(self) -> dict[str, Any]:
        """What the plan depends on of this side: the spec's and manifests' bytes, the mesh
        sizes and the hf map."""

        def sha(path: str | None) -> str | None:
            if path is None:
                return None
            try:
                return hashlib.sha256(Path(path).read_bytes()).hexdigest()
            except OSError:
                return None

        res = self.res
        hfm = res.hf_manifest
        return {
            "spec_sha256": hashlib.sha256(res.spec.source.encode()).hexdigest(),
            "manifest_sha256": sha(res.manifest.path if res.manifest else None),
            "hf_manifest_sha256": sha(hfm.path if hfm else None),
            "mesh": dict(zip(self.mesh.names, self.mesh.sizes, strict=True)),
            "hf_map": [str(r) for r in self.hfmap.rules]
            + [f"tie {a} = {b}" for a, b in self.hfmap.ties],
        }


@dataclass
class TensorPlan:
    key: str
    shape: tuple[int, ...]
    src_dtype: str
    dtype: str
    itemsize: int
    moves: list[Move]


@dataclass
class Plan:
    """The pair's findings and, when there is no error, the moves of every tensor."""

    diagnostics: list[Diagnostic]
    sources: dict[str, str]
    status: int  # 0 fine, 1 findings with errors, 2 input that cannot be processed
    trainer: Side | None = None
    engine: Side | None = None
    tensors: list[TensorPlan] = field(default_factory=list)
    sent: list[int] = field(default_factory=list)  # bytes per trainer rank
    received: list[int] = field(default_factory=list)  # bytes per engine rank
    owned: list[int] = field(default_factory=list)  # bytes per engine rank

    @property
    def wire_bytes(self) -> int:
        return sum(self.sent)

    @property
    def engine_bytes(self) -> int:
        return sum(self.owned)

    @property
    def fingerprint(self) -> str:
        assert self.trainer is not None and self.engine is not None
        both = {"sender": self.trainer.layout(), "receiver": self.engine.layout()}
        return hashlib.sha256(json.dumps(both, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------ sides


def _side(
    role: str, path: str, sizes: dict[str, int], world: int | None, plan: Plan
) -> Side | None:
    """Lint one spec at its sizes and collect its HF tensors (None: it cannot be planned;
    the reasons are in ``plan``)."""
    results, outcome = lint_specs([path], sizes, world)
    plan.sources.update(outcome.sources)
    shown, res = results[0]
    errors = [d for d in outcome.diagnostics if d.is_error]
    plan.diagnostics.extend(errors)
    if res is None or outcome.input_error:
        plan.status = 2
        return None
    if errors:
        return None
    if res.spec.hf is None or res.manifest is None or res.mesh is None:
        what = "hf block" if res.spec.hf is None else "manifest"
        plan.diagnostics.append(
            diag(
                "SS128",
                f"the {role} spec {shown} has no {what}: the pair is joined through both "
                "specs' hf blocks, over their manifests' parameters",
                Span(shown, 1, 1),
                'add `manifest "model.manifest.json"` and an `hf { ... }` block mapping the '
                "Hugging Face names to the model's (a transformers model used as it is maps "
                "each name to itself, as specs/phi3.shard does)",
            )
        )
        return None
    side = Side(role, shown, res, build_hfmap(res.spec.hf, res.hf_manifest), res.mesh)
    _collect(side, plan)
    return side


def _collect(side: Side, plan: Plan) -> None:
    """Every HF tensor the side's parameters come from, with every rank's holding."""
    res, hfmap = side.res, side.hfmap
    for fqn, m in res.stored:
        layout, mesh = m.layout, res.mesh_for(m)
        if layout is None or mesh is None:
            continue
        if any(d.name_indexed for d in layout.dims):
            assert m.winner is not None
            if m.winner not in side.unsupported:  # once per rule
                side.unsupported.add(m.winner)
                rule = next(r for r in res.spec.rules if r.index == m.winner)
                names = ", ".join(d.name for d in layout.dims if d.name_indexed)
                plan.diagnostics.append(
                    diag(
                        "SS127",
                        f"{fqn}: a dimension indexed by the module's name ({names}) cannot be "
                        "planned for a transfer yet",
                        rule.span,
                        "hold the experts as one stacked parameter (a `[e]` map line) on "
                        "this side, or transfer this model another way for now",
                    )
                )
            continue
        _collect_param(side, fqn, m.entry.dtype, layout, mesh, hfmap)


def _collect_param(
    side: Side, fqn: str, dtype: str, layout: ParamLayout, mesh: Mesh, hfmap: HFMap
) -> None:
    fused = fused_of(layout.dims)
    for name, shape in unit_names(fqn, layout.dims, ()):
        if hfmap.kept(name):
            continue
        found = hfmap.sources(name, shape, fused)
        if len(found) != 1:  # lint reports none (SS071) or several (SS072)
            continue
        src: Source = found[0]
        component = name.rpartition(".")[2] if fused is not None and name != fqn else None
        for key, held in holdings(fqn, layout, mesh, component, src).items():
            t = side.tensors.setdefault(key, Tensor(key, src.shape, dtype, src.rule))
            t.held += [_on_stage(side, h, layout, mesh) for h in held]
        for key in src.keys:  # a key no rank holds (an empty shard everywhere) still counts
            side.tensors.setdefault(key, Tensor(key, src.shape, dtype, src.rule))


def _on_stage(side: Side, h: Holding, layout: ParamLayout, mesh: Mesh) -> Holding:
    """``h`` under the name its rank's pipeline stage model gives the parameter: a layer
    renumbered from 0 per stage (`split ... local`), a tied weight's alias on the alias's
    stage; the global name without a pipeline."""
    stages = side.res.stages
    if stages is None or layout.stage_axis is None:
        return h
    stage = mesh.coord_of(h.rank)[mesh.names.index(layout.stage_axis)]
    name = stages.local_name(h.param, stage)
    return h if name == h.param else dataclasses.replace(h, param=name)


# ------------------------------------------------------------------------------ checks


def _source_of(trainer: Side, key: str) -> Tensor | None:
    """The trainer's tensor for HF key ``key``: its own, or the one a ``tie`` aliases."""
    t = trainer.tensors.get(key)
    if t is None and (tied := trainer.hfmap.tie_of(key)) is not None:
        t = trainer.tensors.get(tied)
    return t


def _pair_findings(trainer: Side, engine: Side) -> list[Diagnostic]:
    """Every mismatch of the pair, located at the engine's map line (an HF tensor the
    trainer does not produce, another shape, a dtype of another kind) or the trainer's
    (a tensor the engine neither reads nor drops)."""
    out = []
    produced = sorted(trainer.tensors)
    for key in sorted(engine.tensors):
        e = engine.tensors[key]
        t = _source_of(trainer, key)
        span = engine.span(e.rule)
        if t is None:
            close = closest_few(key, produced, n=3, cutoff=0.6)
            out.append(
                diag(
                    "SS124",
                    f"the engine reads {key}, which the trainer spec {trainer.path} does not "
                    "produce",
                    span,
                    f"did you mean {', '.join(close)}? (the trainer's hf block names it so)"
                    if close
                    else f"add a map line for {key} to {trainer.path}'s hf block, or a `tie`",
                )
            )
        elif t.shape != e.shape:
            out.append(
                diag(
                    "SS125",
                    f"{key} is {list(t.shape)} on the trainer ({trainer.path}, line "
                    f"{trainer.span(t.rule).line}) and {list(e.shape)} on the engine",
                    span,
                    "the two specs describe different models (check both manifests' config: "
                    "hidden size, heads, vocabulary)",
                )
            )
        elif dtype_kind(t.dtype) != dtype_kind(e.dtype) or e.dtype not in ITEMSIZE:
            out.append(
                diag(
                    "SS126",
                    f"{key} is {t.dtype} on the trainer and {e.dtype} on the engine: the "
                    "sender cannot cast one into the other",
                    span,
                    "the sender casts between floating dtypes (fp32 -> bf16); integer, bool "
                    "and floating data do not convert",
                )
            )
    read = {key for key in engine.tensors}
    read |= {s for key in engine.tensors if (s := trainer.hfmap.tie_of(key)) is not None}
    for key in produced if not engine.unsupported else ():  # (the engine's reads unknown)
        if key not in read and not engine.hfmap.dropped(key):
            t = trainer.tensors[key]
            out.append(
                diag(
                    "SS129",
                    f"the trainer produces {key}, which the engine spec {engine.path} neither "
                    "reads nor drops: it is not sent",
                    trainer.span(t.rule),
                    f"map it in {engine.path}'s hf block, or `drop {key}` there to say it is "
                    "not needed",
                )
            )
    return out


# ------------------------------------------------------------------------------ the plan


def plan_transfer(
    train_path: str,
    infer_path: str,
    train_sizes: dict[str, int] | None = None,
    infer_sizes: dict[str, int] | None = None,
    train_world: int | None = None,
    infer_world: int | None = None,
) -> Plan:
    """Check the pair and, when no finding is an error, plan every move."""
    plan = Plan([], {}, 0)
    trainer = _side("trainer", train_path, train_sizes or {}, train_world, plan)
    engine = _side("engine", infer_path, infer_sizes or {}, infer_world, plan)
    plan.trainer, plan.engine = trainer, engine
    if trainer is not None and engine is not None:
        plan.diagnostics += _pair_findings(trainer, engine)
    if plan.status == 2:
        return plan
    if any(d.is_error for d in plan.diagnostics) or trainer is None or engine is None:
        plan.status = 1
        return plan
    _plan_moves(plan, trainer, engine)
    if any(d.is_error for d in plan.diagnostics):
        plan.status = 1
    return plan


def _plan_moves(plan: Plan, trainer: Side, engine: Side) -> None:
    load: dict[int, int] = {}
    received = [0] * engine.mesh.world
    owned = [0] * engine.mesh.world
    for key in sorted(engine.tensors):
        e = engine.tensors[key]
        t = _source_of(trainer, key)
        assert t is not None
        size = ITEMSIZE[e.dtype]
        dst = sorted(e.held, key=lambda h: (h.rank, h.param, h.fixed))
        moves, short = plan_tensor(t.held, dst, size, load)
        for m in moves:
            received[m.dst.rank] += m.count * size
        for h in dst:
            owned[h.rank] += h.count * size
        for h, n in short:
            plan.diagnostics.append(
                diag(
                    "SS124",
                    f"engine rank {h.rank} holds {h.count} elements of {key}, and "
                    f"{abs(n)} of them have {'no sender' if n > 0 else 'several senders'}",
                    engine.span(e.rule),
                    "the trainer spec keeps or leaves out part of this tensor; every element "
                    "the engine holds needs exactly one source",
                )
            )
        plan.tensors.append(TensorPlan(key, e.shape, t.dtype, e.dtype, size, moves))
    plan.sent = [load.get(r, 0) for r in range(trainer.mesh.world)]
    plan.received, plan.owned = received, owned


def plan_json(plan: Plan) -> dict[str, Any]:
    """The plan as the JSON object the module docstring describes."""
    assert plan.trainer is not None and plan.engine is not None

    def side(s: Side) -> dict[str, Any]:
        lay = s.layout()
        return {"spec": s.path, "world": s.mesh.world, "mesh": lay["mesh"], "layout": lay}

    def move(m: Move) -> dict[str, Any]:
        return {
            "src": m.src.rank,
            "dst": m.dst.rank,
            "count": m.count,
            "src_param": m.src.param,
            "src_fixed": [list(f) for f in m.src.fixed],
            "dst_param": m.dst.param,
            "dst_fixed": [list(f) for f in m.dst.fixed],
            "dims": [
                {"src_dim": sa.dim, "dst_dim": da.dim, "runs": [list(r) for r in runs]}
                for sa, da, runs in zip(m.src.axes, m.dst.axes, m.runs, strict=True)
            ],
        }

    return {
        "format": FORMAT,
        "fingerprint": plan.fingerprint,
        "sender": side(plan.trainer),
        "receiver": side(plan.engine),
        "balance": "greedy-least-loaded",
        "tensors": [
            {
                "hf": t.key,
                "shape": list(t.shape),
                "src_dtype": t.src_dtype,
                "dtype": t.dtype,
                "itemsize": t.itemsize,
                "moves": [move(m) for m in t.moves],
            }
            for t in plan.tensors
        ],
        "totals": {
            "sent": plan.sent,
            "received": plan.received,
            "owned": plan.owned,
            "wire_bytes": plan.wire_bytes,
            "engine_bytes": plan.engine_bytes,
        },
    }
