"""Tensor-parallel styles: which torch ``ParallelStyle`` a module gets, derived from its
parameters' placements and the module's kind. Pure Python, shared by the compiler (lint
checks, the generated ``STYLES`` table) and the runtime (``parallelize``).

A Linear's weight is ``[out, in]``: sharding ``out`` makes it column-parallel, ``in``
row-parallel (its bias, ``[out]``, is sharded only column-parallel). An Embedding's weight
is ``[vocab, dim]``: sharding the vocabulary makes it row-parallel (each rank looks up its
rows and the outputs are summed), ``dim`` column-parallel.

torch's ``ColwiseParallel`` and ``RowwiseParallel`` wrap the forward of ``nn.Linear`` and
``nn.Embedding``: they cut the weight and redistribute the activations around *that*
forward. A module that runs a forward of its own (torchtitan's vocab-parallel
``Embedding``, a scaled embedding) would meet DTensor weights it does not expect, so the
styles apply only to modules whose class runs torch's own forward: ``nn.Linear``,
``nn.Embedding`` and their subclasses that do not override ``forward``
(:func:`runs_torch_forward`). The manifest records each module's class and, where it is
inherited, the class whose ``forward`` it runs (:func:`forward_class`).

transformers' ``Conv1D`` (GPT-2) is a Linear whose weight is stored transposed, ``[in,
out]``, computing ``x @ W + b``: sharding ``out`` (dim 1) makes it column-parallel, ``in``
(dim 0) row-parallel, its bias ``[out]`` column-parallel only. The manifest records it as
kind ``conv1d`` (a module whose forward is exactly transformers' own), and the runtime gives
it :class:`~shardspec.runtime.conv1d.Conv1DColwise` / ``Conv1DRowwise``: torch's
``ColwiseParallel`` / ``RowwiseParallel`` with the transposed weight's placements.
"""

from __future__ import annotations

# `expert_parallel`: a stacked-experts module (every parameter `[expert, ...]`, dim 0 cut
# over the EP axis) whose forward dispatches tokens to the ranks that own their experts
# (all-to-all); the runtime's expert-parallel style runs it.
EXPERT_PARALLEL = "expert_parallel"
KINDS = ("colwise", "rowwise", "sequence_parallel", "none", EXPERT_PARALLEL)
# Styles that cut a module's activations over a tensor-parallel axis.
TENSOR_PARALLEL_KINDS = ("colwise", "rowwise", "sequence_parallel")
LAYOUTS = ("replicate", "sequence", "features")
# `style sequence_parallel input heads`: the module reads per-head activations
# [..., heads, head_dim] whose heads are cut over tp (a per-head q/k norm after
# column-parallel projections): torch's SequenceParallel on the heads dimension (-2), whose
# replicated weight's gradient DTensor sums over tp. Its tokens are not cut.
HEADS = "heads"
SEQUENCE_PARALLEL_LAYOUTS = (HEADS,)
HEADS_DIM = -2


def cuts_tokens(style: dict) -> bool:
    """Whether a rule's style (``{"kind": ..., "input": ...}``, as the generated module
    records it) makes the activations sequence-parallel: cut by tokens over tp. A
    `sequence_parallel input heads` style cuts heads, not tokens."""
    return style.get("kind") == "sequence_parallel" and style.get("input") != HEADS


# Module kinds a manifest records (the class name for any other module).
LINEAR, EMBEDDING, CONV1D = "linear", "embedding", "conv1d"
# Classes (qualified names) of forwards that run a Linear with the weight stored [in, out].
CONV1D_FORWARDS = frozenset(("transformers.pytorch_utils.Conv1D",))
# The classes (qualified names) whose forward torch's colwise/rowwise styles are made for.
TORCH_FORWARDS = {
    "torch.nn.modules.linear.Linear": LINEAR,
    "torch.nn.modules.sparse.Embedding": EMBEDDING,
}


def qualified_name(cls: type) -> str:
    """``module.QualName`` of a class, as the manifest records it."""
    return f"{cls.__module__}.{cls.__qualname__}"


def forward_class(cls: type) -> type:
    """The class whose ``forward`` instances of ``cls`` run: ``cls`` itself, or the
    nearest base that defines one."""
    return next((c for c in cls.__mro__ if "forward" in vars(c)), cls)


def runs_torch_forward(forward: str) -> bool:
    """Whether a module whose ``forward`` comes from class ``forward`` (a qualified name)
    runs torch's own Linear or Embedding forward, which torch's styles are made for."""
    return forward in TORCH_FORWARDS


def why_not_torch(cls: str, forward: str, style: str) -> str:
    """Why torch's ``style`` does not fit a module of class ``cls`` running ``forward``."""
    short = cls.rpartition(".")[2]
    own = "its own forward()" if forward == cls else f"the forward() of {forward}"
    return (
        f"{short} ({cls}) runs {own}, not torch's Linear or Embedding forward that torch's "
        f"{style} style wraps: it would meet DTensor weights its forward does not expect"
    )


def custom_module_hint(lint: bool) -> str:
    """What to do about a module whose forward torch's styles do not know (``lint``: the
    checker's hint, else parallelize's)."""
    own_style = (
        "pass torch's style for it in parallelize's `styles` option and suppress this finding"
        if lint
        else "pass torch's style for it in the `styles` option"
    )
    return (
        "state `style none` if the module's forward handles its shards itself (a "
        "vocab-parallel embedding), or build the model with its own parallel module and "
        "`local` axes; if its forward only calls torch's and rescales (a scaled embedding), "
        + own_style
    )


def derive(module: str | None, leaf: str, sharded_dim: int | None) -> str | None:
    """The style a module of kind ``module`` gets when its parameter ``leaf`` is sharded
    over the tensor-parallel axis on dimension ``sharded_dim`` (``None``: replicated).

    Returns ``"colwise"``, ``"rowwise"``, ``None`` (no style: replicated) or ``"?"`` (no
    style derives: a module that is neither Linear nor Embedding, or an unknown kind)."""
    if sharded_dim is None:
        return None
    if module == LINEAR:
        if leaf == "weight":
            return "colwise" if sharded_dim == 0 else "rowwise"
        if leaf == "bias":
            return "colwise"
    if module == EMBEDDING and leaf == "weight":
        return "rowwise" if sharded_dim == 0 else "colwise"
    if module == CONV1D:
        if leaf == "weight":
            return "colwise" if sharded_dim == 1 else "rowwise"
        if leaf == "bias":
            return "colwise"
    return "?"


def why_not(module: str | None) -> str:
    """Why no style derives for a module of kind ``module``."""
    if module is None:
        return (
            "the manifest does not record the module's kind (rebuild it with `shardspec manifest`)"
        )
    if module == "Conv1D":
        return (
            "Conv1D is not transformers' own Conv1D to this manifest (it records the class "
            "name only: rebuild it with `shardspec manifest` to record kind conv1d)"
        )
    return f"{module} is neither a Linear, an Embedding nor transformers' Conv1D"


def mp_dims(
    shard: dict[str, tuple[str, ...]], dims: list[str], fsdp: str | None, local: set[str]
) -> list[int]:
    """Indices (among ``dims``, the tensor's dimensions) of the dimensions sharded over a
    model-parallel axis: any axis but the fsdp one and the parameter's local axes."""
    return [
        i for i, d in enumerate(dims) if any(a != fsdp and a not in local for a in shard.get(d, ()))
    ]
