"""Tensor-parallel styles: which torch ``ParallelStyle`` a module gets, derived from its
parameters' placements and the module's kind. Pure Python, shared by the compiler (lint
checks, the generated ``STYLES`` table) and the runtime (``parallelize``).

A Linear's weight is ``[out, in]``: sharding ``out`` makes it column-parallel, ``in``
row-parallel (its bias, ``[out]``, is sharded only column-parallel). An Embedding's weight
is ``[vocab, dim]``: sharding the vocabulary makes it row-parallel (each rank looks up its
rows and the outputs are summed), ``dim`` column-parallel.
"""

from __future__ import annotations

KINDS = ("colwise", "rowwise", "sequence_parallel", "none")
LAYOUTS = ("replicate", "sequence", "features")
# Module kinds a manifest records (the class name for any other module).
LINEAR, EMBEDDING = "linear", "embedding"


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
    return "?"


def why_not(module: str | None) -> str:
    """Why no style derives for a module of kind ``module``."""
    if module is None:
        return (
            "the manifest does not record the module's kind (rebuild it with `shardspec manifest`)"
        )
    return f"{module} is neither a Linear nor an Embedding"


def mp_dims(
    shard: dict[str, tuple[str, ...]], dims: list[str], fsdp: str | None, local: set[str]
) -> list[int]:
    """Indices (among ``dims``, the tensor's dimensions) of the dimensions sharded over a
    model-parallel axis: any axis but the fsdp one and the parameter's local axes."""
    return [
        i for i, d in enumerate(dims) if any(a != fsdp and a not in local for a in shard.get(d, ()))
    ]
