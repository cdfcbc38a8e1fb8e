"""Execute a weight-transfer plan (``shardspec transfer TRAIN INFER --plan FILE``) over
torch.distributed point-to-point: every engine rank receives exactly its own elements of
every weight, written straight into its parameters' local tensors.

One process group holds both sides, trainer ranks ``[0, T)`` then engine ranks ``[T, T+N)``
(vLLM's nccl-m2n layout; the default group, or one ``new_group`` joining two jobs).
Trainer ranks call :func:`send_weights`, engine ranks :func:`receive_weights`, with the same
plan and ``bucket_bytes``::

    plan = load_plan("llama_to_engine.plan.json")  # once; reused every step
    if rank < plan.senders:
        send_weights(model, plan, spec=generated.llama, group=group)
    else:
        receive_weights(engine_model, plan, spec=generated.llama_engine, group=group)

What a call does, in order:

1. **Validation before any byte moves.** Each rank checks its side: the plan names this
   rank's spec (``spec.SPEC_SHA256`` against the plan's ``spec_sha256``: a plan made from
   another version of the spec is refused), the group has ``T + N`` ranks, every parameter
   a move names exists on this rank and every local position the move touches lies inside
   its local tensor (``DTensor.to_local()``: FSDP2's and TP's local shard), dtypes can be
   cast (floating to floating; the engine parameter already has the plan's dtype). Then
   one ``all_reduce`` (MAX) of five integers in the group: the first failing rank, the
   bucket size both ways and the plan's fingerprint both ways, so that one rank's refusal,
   a rank with another ``bucket_bytes`` or a rank with another plan fails every rank
   before any byte moves (:class:`TransferError`).
2. **Rounds of point-to-point messages.** The moves of each (sender, receiver) pair are
   packed, in plan order, into messages of at most ``bucket_bytes`` (a single move larger
   than that is a message of its own), and the messages are put into rounds so that no
   rank sends or receives more than ``bucket_bytes`` in a round. The schedule is a pure
   function of the plan and ``bucket_bytes``, the same on every rank, and cached on the
   plan: a message has both its ends in the same round, so the rounds cannot deadlock.
   Per round a rank posts one ``batch_isend_irecv`` of its messages and waits for each
   with ``timeout``. The sender packs a move block by block: one run of local positions
   per dimension is a strided view of its local tensor, permuted into HF order and
   copied, cast to the plan's dtype (fp32 master weights -> a bf16 engine), straight into
   its box of the message buffer; the receiver copies each box into the same view of its
   own local tensor (fused per-rank layouts included: the plan's runs say where). (A move
   of more than ``MAX_BLOCKS`` blocks goes through one index gather instead.) Each byte
   crosses the wire once; there is no all-gather, no broadcast and no full tensor: a rank
   holds at most one round's messages (``bucket_bytes``), and no packed copy besides.
3. **A closing check**: one ``all_reduce`` (MAX) of the first failing rank, with
   ``timeout``.

**Faults.** An error on a rank (a peer that died: gloo reports the closed connection, or
the op times out after ``timeout``) raises :class:`TransferError` naming the peer of the
op that failed (its group rank and side). A rank that had no message with the dead rank
learns of the failure from the closing check: its ``all_reduce`` either reports the
failing rank or fails itself (the dead rank cannot join it), and it raises
:class:`TransferError` too; that message names the failing rank when a survivor reported
it, and otherwise says that a rank of the group died. The group is then broken: destroy it
and build a new one. **The engine model is marked stale**: ``receive_weights`` sets
``model.shardspec_weights_stale = True`` (:data:`STALE_ATTR`, read it with
:func:`weights_stale`) before its first byte arrives and clears it only after the closing
check found every rank of both sides done, so an engine that serves from a model half old
and half new can tell (receiving into staging buffers instead would hold the whole model
twice). A transfer that fails validation changes nothing, the flag included.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed import ProcessGroup

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "FORMAT",
    "STALE_ATTR",
    "PlanError",
    "TransferError",
    "TransferPlan",
    "TransferStats",
    "load_plan",
    "receive_weights",
    "send_weights",
    "weights_stale",
]

# The plan format this runtime executes (shardspec.transfer.plan.FORMAT; a test keeps
# them equal: the runtime does not import the compiler).
FORMAT = "shardspec-transfer-plan/1"
DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_TIMEOUT = 300.0  # seconds a point-to-point op or the closing check may wait
STALE_ATTR = "shardspec_weights_stale"
ALIGN = 8  # every packed move starts at a multiple of this many bytes of its message

# Tests only: called with the round's index before each round (a kill-point test makes a
# rank die there).
_fault_point: Callable[[int], None] | None = None

# dtypes a plan may name: torch's names, bytes per element, kind.
_DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "float"),
    "float32": (4, "float"),
    "float16": (2, "float"),
    "bfloat16": (2, "float"),
    "float8_e4m3fn": (1, "float"),
    "float8_e5m2": (1, "float"),
    "int64": (8, "int"),
    "int32": (4, "int"),
    "int16": (2, "int"),
    "int8": (1, "int"),
    "uint8": (1, "int"),
    "bool": (1, "bool"),
    "complex64": (8, "complex"),
    "complex128": (16, "complex"),
}


class TransferError(RuntimeError):
    """A transfer refused before any byte moved, or failed while moving (the message names
    the rank and, where known, the peer)."""


class PlanError(TransferError, ValueError):
    """A plan file that cannot be used: not JSON, another format, damaged."""


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class Dim:
    """One HF dimension of a move: the local dims it lies along and its runs."""

    src_dim: int
    dst_dim: int
    runs: tuple[tuple[int, int, int, int, int], ...]

    @property
    def count(self) -> int:
        return sum(r[2] for r in self.runs)


@dataclass(frozen=True)
class Move:
    """``count`` elements of HF tensor ``tensor`` from sender ``src`` to receiver ``dst``."""

    tensor: int  # index into TransferPlan.tensors
    src: int
    dst: int
    count: int
    src_param: str
    src_fixed: tuple[tuple[int, int], ...]
    dst_param: str
    dst_fixed: tuple[tuple[int, int], ...]
    dims: tuple[Dim, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize


@dataclass(frozen=True)
class TensorInfo:
    hf: str
    src_dtype: str
    dtype: str


@dataclass
class TransferPlan:
    """A validated plan (:func:`load_plan`): both sides' worlds and layouts, every move,
    and the schedules computed from it (cached per ``bucket_bytes``)."""

    fingerprint: str
    sender: dict[str, Any]
    receiver: dict[str, Any]
    senders: int  # T
    receivers: int  # N
    tensors: list[TensorInfo]
    moves: list[Move]
    _schedules: dict[int, list[list[Message]]] = field(default_factory=dict, repr=False)

    @property
    def fingerprint_int(self) -> int:
        """The fingerprint's first 60 bits, for the validation all-reduce."""
        return int(self.fingerprint[:15], 16)

    def owned_bytes(self, receiver: int) -> int:
        """Bytes engine rank ``receiver`` receives (each of its elements once)."""
        return sum(m.nbytes for m in self.moves if m.dst == receiver)

    def schedule(self, bucket_bytes: int) -> list[list[Message]]:
        """The rounds of messages for ``bucket_bytes`` (module docstring, step 2)."""
        if bucket_bytes not in self._schedules:
            self._schedules[bucket_bytes] = _schedule(self.moves, bucket_bytes)
        return self._schedules[bucket_bytes]


@dataclass
class Message:
    """Moves of one (sender, receiver) pair sent as one buffer; ``offsets[i]`` is where
    move ``moves[i]`` starts in it."""

    src: int
    dst: int
    moves: list[Move] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    nbytes: int = 0

    def add(self, m: Move) -> None:
        start = -(-self.nbytes // ALIGN) * ALIGN
        self.moves.append(m)
        self.offsets.append(start)
        self.nbytes = start + m.nbytes


def _schedule(moves: list[Move], bucket: int) -> list[list[Message]]:
    pairs: dict[tuple[int, int], list[Message]] = {}
    for m in moves:
        msgs = pairs.setdefault((m.src, m.dst), [])
        if not msgs or (msgs[-1].moves and msgs[-1].nbytes + ALIGN + m.nbytes > bucket):
            msgs.append(Message(m.src, m.dst))
        msgs[-1].add(m)
    # Round-robin over the pairs, each message in the first round where both of its ends
    # still have room (an end with nothing in a round always has room).
    order: list[Message] = []
    queues = [pairs[k] for k in sorted(pairs)]
    for k in range(max((len(q) for q in queues), default=0)):
        order += [q[k] for q in queues if k < len(q)]
    rounds: list[list[Message]] = []
    load: dict[tuple[str, int], list[int]] = {}
    for msg in order:
        ends = [load.setdefault(("s", msg.src), []), load.setdefault(("r", msg.dst), [])]
        k = 0
        while any(k < len(e) and e[k] and e[k] + msg.nbytes > bucket for e in ends):
            k += 1
        while len(rounds) <= k:
            rounds.append([])
        rounds[k].append(msg)
        for e in ends:
            e.extend([0] * (k + 1 - len(e)))
            e[k] += msg.nbytes
    return rounds


def _fingerprint(sender: Any, receiver: Any) -> str:
    both = {"sender": sender, "receiver": receiver}
    return hashlib.sha256(json.dumps(both, sort_keys=True).encode()).hexdigest()


def load_plan(source: str | Path | Mapping[str, Any]) -> TransferPlan:
    """Read and validate a plan (a path to its JSON file, or the parsed object). Raises
    :class:`PlanError` with what is wrong and where for anything that is not an intact
    plan of this format; it never changes anything."""
    where = "the plan"
    if isinstance(source, (str, Path)):
        where = f"the plan {source}"
        try:
            with open(source, "rb") as f:
                doc: Any = json.loads(f.read())
        except OSError as e:
            raise PlanError(f"{where} cannot be read: {e.strerror or e}") from None
        except (ValueError, RecursionError) as e:
            raise PlanError(
                f"{where} is not JSON ({e}); write it again with `shardspec transfer "
                "TRAIN INFER --plan FILE`"
            ) from None
    else:
        doc = source
    try:
        return _parse(doc)
    except _Bad as e:
        raise PlanError(
            f"{where} is damaged or not a transfer plan: {e}; write it again with "
            "`shardspec transfer TRAIN INFER --plan FILE`"
        ) from None


class _Bad(Exception):
    pass


def _get(obj: Any, key: str, kind: type | tuple[type, ...], at: str) -> Any:
    if not isinstance(obj, dict):
        raise _Bad(f"{at} is not an object")
    if key not in obj:
        raise _Bad(f"{at} has no {key!r}")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise _Bad(f"{at}.{key} is not {getattr(kind, '__name__', kind)}")
    return value


def _int(obj: Any, key: str, at: str, low: int = 0) -> int:
    v = _get(obj, key, int, at)
    if isinstance(v, bool) or v < low:
        raise _Bad(f"{at}.{key} = {v!r} is not an integer >= {low}")
    return int(v)


def _ints(value: Any, n: int, at: str, low: int = 0) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or len(value) != n
        or any(isinstance(x, bool) or not isinstance(x, int) or x < low for x in value)
    ):
        raise _Bad(f"{at} is not a list of {n} integers >= {low}")
    return tuple(value)


def _parse(doc: Any) -> TransferPlan:
    fmt = _get(doc, "format", str, "plan")
    if fmt != FORMAT:
        raise _Bad(f"its format is {fmt!r}, this runtime executes {FORMAT!r}")
    fingerprint = _get(doc, "fingerprint", str, "plan")
    sides = []
    for name in ("sender", "receiver"):
        side = _get(doc, name, dict, "plan")
        _int(side, "world", name, 1)
        _get(side, "layout", dict, name)
        sides.append(side)
    sender, receiver = sides
    if _fingerprint(sender["layout"], receiver["layout"]) != fingerprint:
        raise _Bad("its fingerprint does not match its sender's and receiver's layouts")
    T, N = sender["world"], receiver["world"]
    tensors: list[TensorInfo] = []
    moves: list[Move] = []
    for i, t in enumerate(_get(doc, "tensors", list, "plan")):
        at = f"tensors[{i}]"
        hf = _get(t, "hf", str, at)
        dtypes = [_get(t, k, str, at) for k in ("src_dtype", "dtype")]
        for d in dtypes:
            if d not in _DTYPES:
                raise _Bad(f"{at} ({hf}) names dtype {d!r}")
        if _DTYPES[dtypes[0]][1] != _DTYPES[dtypes[1]][1]:
            raise _Bad(f"{at} ({hf}) casts {dtypes[0]} to {dtypes[1]}")
        itemsize = _int(t, "itemsize", at, 1)
        if itemsize != _DTYPES[dtypes[1]][0]:
            raise _Bad(f"{at} ({hf}) has itemsize {itemsize} for {dtypes[1]}")
        tensors.append(TensorInfo(hf, dtypes[0], dtypes[1]))
        for j, m in enumerate(_get(t, "moves", list, at)):
            moves.append(_move(m, f"{at}.moves[{j}]", i, T, N, itemsize))
    return TransferPlan(fingerprint, sender, receiver, T, N, tensors, moves)


def _move(m: Any, at: str, tensor: int, T: int, N: int, itemsize: int) -> Move:
    src, dst, count = _int(m, "src", at), _int(m, "dst", at), _int(m, "count", at, 1)
    if src >= T or dst >= N:
        raise _Bad(f"{at} moves from sender {src} of {T} to receiver {dst} of {N}")
    params = [_get(m, k, str, at) for k in ("src_param", "dst_param")]
    fixed = [
        tuple((f[0], f[1]) for f in (_ints(x, 2, f"{at}.{k}[]") for x in _get(m, k, list, at)))
        for k in ("src_fixed", "dst_fixed")
    ]
    dims = []
    n = 1
    for k, d in enumerate(_get(m, "dims", list, at)):
        dat = f"{at}.dims[{k}]"
        runs = tuple(_ints(r, 5, f"{dat}.runs[]") for r in _get(d, "runs", list, dat))
        dim = Dim(_int(d, "src_dim", dat), _int(d, "dst_dim", dat), runs)  # type: ignore[arg-type]
        if any(r[2] == 0 for r in runs):
            raise _Bad(f"{dat} has an empty run")
        dims.append(dim)
        n *= dim.count
    if n != count:
        raise _Bad(f"{at} says {count} elements and its runs hold {n}")
    return Move(
        tensor, src, dst, count, params[0], fixed[0], params[1], fixed[1], tuple(dims), itemsize
    )


# ------------------------------------------------------------------------------ local views


# A move whose runs make more blocks than this is packed with one index per dim instead.
MAX_BLOCKS = 64


@dataclass
class _View:
    """How a rank reads or writes one move in its local tensor: the dims in HF order
    after the fixed ones are selected (``perm[k]``: the local dim of HF dim ``k``), and per
    HF dim the runs of this side's local positions, ``(start, count, step)``. The move's
    buffer is the product of its dims' runs in HF order, so each combination of one run
    per dim is a *block*: a strided view of the local tensor and a box of the buffer."""

    local: torch.Tensor  # the fixed positions selected
    perm: tuple[int, ...]
    runs: list[list[tuple[int, int, int]]]

    @property
    def shape(self) -> list[int]:
        """The move's buffer shape (HF dim order)."""
        return [sum(r[1] for r in dim) for dim in self.runs]

    def blocks(self) -> Iterator[tuple[torch.Tensor, tuple[slice, ...]]]:
        """Each block: the local tensor's view (HF dim order; writable) and the buffer's
        slices. Steps are positive (the planner's runs), so every view is basic slicing:
        no copy, no index tensor."""
        offsets = []
        for dim in self.runs:
            at, starts = 0, []
            for r in dim:
                starts.append(at)
                at += r[1]
            offsets.append(starts)
        for combo in itertools.product(*(range(len(dim)) for dim in self.runs)):
            key: list[slice] = [slice(None)] * self.local.dim()
            box = []
            for k, i in enumerate(combo):
                start, count, step = self.runs[k][i]
                key[self.perm[k]] = slice(start, start + (count - 1) * step + 1, step)
                box.append(slice(offsets[k][i], offsets[k][i] + count))
            yield self.local[tuple(key)].permute(self.perm), tuple(box)

    def block_count(self) -> int:
        return math.prod(len(dim) for dim in self.runs)

    def index(self) -> tuple[torch.Tensor, ...]:
        """Advanced indices (local dim order) whose result is in HF dim order."""
        import torch

        k = len(self.perm)
        idx: list[Any] = [None] * k
        for j, (d, dim) in enumerate(zip(self.perm, self.runs, strict=True)):
            shape = [1] * k
            shape[j] = -1
            pos = [p for start, n, step in dim for p in range(start, start + n * step, step)]
            idx[d] = torch.tensor(pos, dtype=torch.long).reshape(shape)
        return tuple(idx)


def _check_move(m: Move, side: int, local: torch.Tensor) -> str | None:
    """Why move ``m`` does not fit this rank's local tensor (None: it fits). ``side``: 0
    sender, 1 receiver."""
    fixed = m.src_fixed if side == 0 else m.dst_fixed
    dims = [d.src_dim if side == 0 else d.dst_dim for d in m.dims]
    shape = tuple(local.shape)
    used = [d for d, _ in fixed] + dims
    if sorted(used) != list(range(local.dim())):
        return f"its dims {used} do not cover the local tensor's {list(shape)} once each"
    for d, p in fixed:
        if p >= shape[d]:
            return f"it selects position {p} of local dim {d} (size {shape[d]})"
    for d, dim in zip(dims, m.dims, strict=True):
        if dim.count > shape[d]:
            return f"it takes {dim.count} positions of local dim {d} (size {shape[d]})"
        for r in dim.runs:
            start, step = (r[0], r[3]) if side == 0 else (r[1], r[4])
            if start + (r[2] - 1) * step >= shape[d]:
                return f"its run {list(r)} reaches past local dim {d} (size {shape[d]})"
    return None


def _view(m: Move, side: int, local: torch.Tensor) -> _View:

    fixed = m.src_fixed if side == 0 else m.dst_fixed
    dims = [d.src_dim if side == 0 else d.dst_dim for d in m.dims]
    for d, p in sorted(fixed, reverse=True):
        local = local.select(d, p)
    gone = sorted(d for d, _ in fixed)
    perm = tuple(d - sum(1 for g in gone if g < d) for d in dims)
    runs = [
        [(r[0], r[2], r[3]) if side == 0 else (r[1], r[2], r[4]) for r in dim.runs]
        for dim in m.dims
    ]
    return _View(local, perm, runs)


def _local(param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return param.to_local() if isinstance(param, DTensor) else param


# ------------------------------------------------------------------------------ running


@dataclass
class TransferStats:
    """What one call moved: payload bytes this rank sent and received (padding to
    :data:`ALIGN` not counted), messages, rounds, the largest message (its buffer is the
    extra memory a round holds per peer), and seconds."""

    role: str
    rank: int  # this rank's rank on its side
    sent_bytes: int = 0
    received_bytes: int = 0
    messages: int = 0
    rounds: int = 0
    largest_round_bytes: int = 0
    seconds: float = 0.0


def weights_stale(model: nn.Module) -> bool:
    """Whether a transfer into ``model`` began and did not complete on every rank
    (module docstring, Faults)."""
    return bool(getattr(model, STALE_ATTR, False))


def send_weights(
    model: nn.Module,
    plan: TransferPlan | str | Path,
    *,
    spec: Any = None,
    group: ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
) -> TransferStats:
    """On trainer rank ``s`` (group rank ``s`` of ``[0, T)``): send this rank's share of
    the plan's moves from ``model``'s local shards. ``spec``: the trainer's generated module
    (its ``SPEC_SHA256`` must be the plan's sender's); every rank of the group calls
    :func:`send_weights` or :func:`receive_weights` with the same plan and
    ``bucket_bytes``. Raises :class:`TransferError` (module docstring)."""
    return _run(0, model, plan, spec, group, bucket_bytes, timeout)


def receive_weights(
    model: nn.Module,
    plan: TransferPlan | str | Path,
    *,
    spec: Any = None,
    group: ProcessGroup | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    timeout: float = DEFAULT_TIMEOUT,
) -> TransferStats:
    """On engine rank ``r`` (group rank ``T + r``): receive this rank's elements of every
    weight into ``model``'s local tensors in place. ``spec``: the engine's generated
    module. ``model`` is marked stale (:data:`STALE_ATTR`) from its first byte until every
    rank is done. Raises :class:`TransferError` (module docstring)."""
    return _run(1, model, plan, spec, group, bucket_bytes, timeout)


_ROLES = ("trainer", "engine")


def _who(g: int, T: int) -> str:
    return f"group rank {g} ({'trainer rank ' + str(g) if g < T else 'engine rank ' + str(g - T)})"


def _validate(
    side: int,
    model: nn.Module,
    plan: TransferPlan,
    spec: Any,
    g: int,
    world: int,
    bucket_bytes: int,
) -> tuple[str | None, dict[str, torch.Tensor]]:
    """This rank's reasons to refuse (None: none) and its local tensors by name."""
    import torch

    T, N = plan.senders, plan.receivers
    if world != T + N:
        return f"the group has {world} ranks and the plan {T} senders + {N} receivers", {}
    if (g < T) != (side == 0):
        call = "send_weights" if side == 0 else "receive_weights"
        return f"{call} called on a rank the plan makes a{'n engine' if g < T else ' trainer'}", {}
    if bucket_bytes < 1:
        return f"bucket_bytes = {bucket_bytes} is not positive", {}
    which = plan.sender if side == 0 else plan.receiver
    if spec is not None:
        have = getattr(spec, "SPEC_SHA256", None)
        want = which["layout"].get("spec_sha256")
        if have != want:
            return (
                f"the plan was made from another {_ROLES[side]} spec than "
                f"{getattr(spec, 'SPEC_PATH', spec)!r} was compiled from (spec sha256 "
                f"{str(want)[:12]} in the plan, {str(have)[:12]} compiled): make the plan "
                "again with `shardspec transfer TRAIN INFER --plan FILE`",
                {},
            )
    me = g if side == 0 else g - T
    params = dict(model.named_parameters())
    locals_: dict[str, torch.Tensor] = {}
    for m in plan.moves:
        if (m.src if side == 0 else m.dst) != me:
            continue
        name = m.src_param if side == 0 else m.dst_param
        hf = plan.tensors[m.tensor]
        if name not in locals_:
            p = params.get(name)
            if p is None:
                return f"{hf.hf}: the model has no parameter {name}", {}
            locals_[name] = _local(p.detach())
        t = locals_[name]
        want_dtype = getattr(torch, hf.dtype)
        if side == 1 and t.dtype != want_dtype:
            return (
                f"{hf.hf}: the engine parameter {name} is {t.dtype} and the plan sends "
                f"{hf.dtype} (the engine spec's manifest): build the engine model in "
                f"{hf.dtype} or make the plan again",
                {},
            )
        if t.is_floating_point() != want_dtype.is_floating_point or t.is_complex() != (
            want_dtype.is_complex
        ):
            return f"{hf.hf}: {name} is {t.dtype}, which cannot be cast to {hf.dtype}", {}
        why = _check_move(m, side, t)
        if why is not None:
            return (
                f"{hf.hf}: the plan's move {_ROLES[0]} {m.src} -> {_ROLES[1]} {m.dst} does "
                f"not fit {name}'s local tensor {list(t.shape)} on this rank: {why} (a plan "
                "for another mesh or model)",
                {},
            )
    return None, locals_


def _run(
    side: int,
    model: nn.Module,
    plan_arg: TransferPlan | str | Path,
    spec: Any,
    group: ProcessGroup | None,
    bucket_bytes: int,
    timeout: float,
) -> TransferStats:
    import torch
    import torch.distributed as dist

    started = time.monotonic()
    g, world = dist.get_rank(group), dist.get_world_size(group)
    plan: TransferPlan | None = None
    why: str | None
    locals_: dict[str, torch.Tensor] = {}
    try:
        plan = plan_arg if isinstance(plan_arg, TransferPlan) else load_plan(plan_arg)
        why, locals_ = _validate(side, model, plan, spec, g, world, bucket_bytes)
    except PlanError as e:
        why = str(e)
    except Exception as e:  # anything else this rank cannot use: refused on every rank
        why = f"{type(e).__name__}: {e}"
    fp = plan.fingerprint_int if plan is not None else 0
    status = torch.tensor([g + 1 if why else 0, bucket_bytes, -bucket_bytes, fp, -fp])
    _all_reduce_max(status, group, timeout, g, "validation")
    T = plan.senders if plan is not None else world
    if why is not None:
        raise TransferError(f"{_who(g, T)} refused the transfer before any byte moved: {why}")
    if status[0]:
        raise TransferError(
            f"{_who(g, T)}: {_who(int(status[0]) - 1, T)} refused the transfer before any "
            "byte moved (its error says why); nothing was changed"
        )
    if status[1] != -status[2]:
        raise TransferError(
            f"{_who(g, T)}: the ranks passed different bucket_bytes "
            f"({-int(status[2])} to {int(status[1])}); nothing was changed"
        )
    if status[3] != -status[4]:
        raise TransferError(
            f"{_who(g, T)}: the ranks hold different plans (fingerprints differ); load the "
            "same plan file everywhere; nothing was changed"
        )
    assert plan is not None
    _calls[plan.fingerprint] = _calls.get(plan.fingerprint, 0) + 1
    me = g if side == 0 else g - T
    stats = TransferStats(_ROLES[side], me)
    if side == 1:
        setattr(model, STALE_ATTR, True)
    failed: BaseException | None = None
    try:
        with torch.no_grad():
            for k, rnd in enumerate(plan.schedule(bucket_bytes)):
                if _fault_point is not None:
                    _fault_point(k)
                mine = [msg for msg in rnd if (msg.src if side == 0 else msg.dst) == me]
                if mine:
                    _round(side, mine, locals_, plan, group, timeout, g, stats)
    except TransferError as e:
        failed = e
    closing = torch.tensor([int(failed is not None) and g + 1])
    try:
        _all_reduce_max(closing, group, timeout, g, "closing check", plan.senders)
    except TransferError as e:
        if failed is None:
            failed = e
    if failed is not None:
        raise TransferError(f"{failed}{_gone(plan, g, world, timeout)}") from None
    if closing[0]:
        raise TransferError(
            f"{_who(g, T)}: {_who(int(closing[0]) - 1, T)} failed during the transfer "
            "(its error says why); "
            + (
                "this engine model is marked stale"
                if side == 1
                else "the engine model is marked stale"
            )
        )
    if side == 1:
        setattr(model, STALE_ATTR, False)
    stats.seconds = time.monotonic() - started
    return stats


_calls: dict[str, int] = {}  # transfers begun per plan fingerprint (store keys)


def _gone(plan: TransferPlan, g: int, world: int, timeout: float) -> str:
    """After a failure: every survivor checks in under a key of this transfer in the
    default group's store and waits up to ``timeout`` for the others; the ranks that never
    check in are named (they died or hang). Empty when the store is gone too (it lives
    on rank 0) or everyone checked in."""
    import torch.distributed as dist

    n = _calls.get(plan.fingerprint, 0)
    prefix = f"shardspec/transfer/{plan.fingerprint[:16]}/{n}/alive"
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set(f"{prefix}/{g}", "1")
        deadline = time.monotonic() + timeout
        while True:
            missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    except Exception:
        return ""
    if not missing:
        return ""
    names = ", ".join(_who(r, plan.senders) for r in missing)
    return f". Not answering after the failure (dead or hung): {names}"


def _all_reduce_max(
    t: torch.Tensor, group: ProcessGroup | None, timeout: float, g: int, what: str, T: int = 0
) -> None:
    import torch.distributed as dist

    try:
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True)
        assert work is not None
        work.wait(timedelta(seconds=timeout))
    except Exception as e:
        who = _who(g, T) if T else f"group rank {g}"
        raise TransferError(
            f"{who}: the transfer's {what} (an all_reduce of every rank's status) failed: a "
            f"rank of the group died, hangs or left ({type(e).__name__}: {_first_line(e)}); "
            "the group is broken: destroy it and build a new one"
        ) from None


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:300]


def _pieces(
    side: int, msg: Message, locals_: Mapping[str, torch.Tensor]
) -> Iterator[tuple[Move, int, _View]]:
    for m, off in zip(msg.moves, msg.offsets, strict=True):
        yield m, off, _view(m, side, locals_[m.src_param if side == 0 else m.dst_param])


def _round(
    side: int,
    msgs: list[Message],
    locals_: dict[str, torch.Tensor],
    plan: TransferPlan,
    group: ProcessGroup | None,
    timeout: float,
    g: int,
    stats: TransferStats,
) -> None:
    import torch
    import torch.distributed as dist

    T = plan.senders
    ops, bufs, peers = [], [], []
    for msg in msgs:
        if side == 0:
            buf = _fill(msg, locals_, plan)
            stats.sent_bytes += sum(m.nbytes for m in msg.moves)
        else:
            buf = torch.empty(msg.nbytes, dtype=torch.uint8)
        peer = msg.dst + T if side == 0 else msg.src
        fn = dist.isend if side == 0 else dist.irecv
        ops.append(dist.P2POp(fn, buf, group=group, group_peer=peer))
        bufs.append(buf)
        peers.append(peer)
    stats.messages += len(msgs)
    stats.rounds += 1
    stats.largest_round_bytes = max(stats.largest_round_bytes, sum(b.numel() for b in bufs))
    try:
        works = dist.batch_isend_irecv(ops)
    except Exception as e:
        raise TransferError(
            f"{_who(g, T)}: posting the round's messages to {', '.join(_who(p, T) for p in peers)} "
            f"failed ({type(e).__name__}: {_first_line(e)})"
        ) from None
    for work, peer in zip(works, peers, strict=True):
        try:
            work.wait(timedelta(seconds=timeout))
        except Exception as e:
            verb = "sending to" if side == 0 else "receiving from"
            raise TransferError(
                f"{_who(g, T)}: {verb} {_who(peer, T)} failed: it died, hangs or left the "
                f"group ({type(e).__name__}: {_first_line(e)}); "
                + (
                    "this engine model is marked stale"
                    if side == 1
                    else "the engine model is marked stale"
                )
            ) from None
    if side == 1:
        for msg, buf in zip(msgs, bufs, strict=True):
            _drain(msg, buf, locals_, plan)
            stats.received_bytes += sum(m.nbytes for m in msg.moves)


def _fill(msg: Message, locals_: Mapping[str, torch.Tensor], plan: TransferPlan) -> torch.Tensor:
    """The sender's buffer of ``msg``: each move's elements selected from its local
    tensor, in HF dim order, cast to the plan's dtype, at its offset. Each block of a move
    is one ``copy_`` from a view of the local tensor straight into the buffer (the cast
    included): no intermediate tensor, unless a move has more than :data:`MAX_BLOCKS`
    blocks (then one gather by index)."""
    import torch

    buf = torch.empty(msg.nbytes, dtype=torch.uint8)
    for m, off, view in _pieces(0, msg, locals_):
        dtype = getattr(torch, plan.tensors[m.tensor].dtype)
        out = buf[off : off + m.nbytes].view(dtype).view(view.shape)
        if view.block_count() <= MAX_BLOCKS:
            for part, box in view.blocks():
                out[box].copy_(part)
        else:
            out.copy_(view.local[view.index()])
    return buf


def _drain(
    msg: Message, buf: torch.Tensor, locals_: Mapping[str, torch.Tensor], plan: TransferPlan
) -> None:
    """Write the received buffer of ``msg`` into the receiver's local tensors, block by
    block (:func:`_fill`)."""
    import torch

    for m, off, view in _pieces(1, msg, locals_):
        dtype = getattr(torch, plan.tensors[m.tensor].dtype)
        data = buf[off : off + m.nbytes].view(dtype).view(view.shape)
        if view.block_count() <= MAX_BLOCKS:
            for part, box in view.blocks():
                part.copy_(data[box])
        else:
            view.local.index_put_(view.index(), data)
