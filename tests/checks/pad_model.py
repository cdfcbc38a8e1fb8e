"""The small padded-vocabulary model that the SS132/SS133 cases share: an embedding whose
HF tensor has 1000 rows (not a multiple of 64) over tp."""

from typing import Any

# Lines 1-8: the model; the map line is line 8.
HEAD = """\
manifest "m.json"
mesh over 2 ranks { tp: 2 }
param tok.weight [vocab, hidden] {
    shard vocab over tp
}
param norm.weight [hidden] {}
hf "hf.json" {
"""
TAIL = """\
    model.norm.weight -> norm.weight
}
"""


def spec(line: str) -> str:
    """The spec with ``line`` mapping the embedding (line 8)."""
    return HEAD + f"    model.embed_tokens.weight -> tok.weight{line}\n" + TAIL


def manifest(rows: int) -> dict[str, list[int]]:
    return {"tok.weight": [rows, 8], "norm.weight": [8]}


HF: dict[str, Any] = {
    "config": {"vocab_size": 1000},
    "tensors": {"model.embed_tokens.weight": [1000, 8], "model.norm.weight": [8]},
}
