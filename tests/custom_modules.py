"""Module classes that are not torch's, for the tests of tensor-parallel styles: an
Embedding subclass with a forward of its own (torchtitan-like vocab-parallel lookup) and
one that inherits torch's forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate


def with_embedding(model: nn.Module, cls: type[nn.Embedding]) -> nn.Module:
    """``model`` with its token embedding replaced by a ``cls`` holding the same weight."""
    old = model.tok_embeddings
    new = cls(old.num_embeddings, old.embedding_dim)
    with torch.no_grad():
        new.weight.copy_(old.weight)
    model.tok_embeddings = new
    return model


class VocabParallelEmbedding(nn.Embedding):
    """torchtitan-like: an Embedding whose forward does its own vocab-parallel lookup. With
    a weight cut on the vocabulary over tp (a DTensor), each rank looks up the ids among its
    rows, zeroes the others, and the rows are summed over tp; torch's RowwiseParallel would
    hand it DTensor ids it does not expect."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if not isinstance(w, DTensor):
            return F.embedding(ids, w)
        mesh = w.device_mesh
        local = w.to_local()
        rows = local.shape[0]
        start = mesh.get_local_rank() * rows  # an even cut of the vocabulary
        inside = ((ids >= start) & (ids < start + rows)).unsqueeze(-1)
        out = F.embedding((ids - start).clamp(0, rows - 1), local) * inside
        summed = DTensor.from_local(out, mesh, [Partial()]).redistribute(mesh, [Replicate()])
        return summed.to_local()


class NamedEmbedding(nn.Embedding):
    """An Embedding subclass that runs torch's own forward."""
