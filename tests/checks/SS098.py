"""SS098 tie-layout: a rule for a pipeline tie's alias shards it differently from its
source."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { pp: 2  dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {
    "layers.0.mlp.weight": [8, 8],
    "layers.1.mlp.weight": [8, 8],
    "norm.weight": [8],
    "tok_embeddings.weight": [16, 8],
}
PIPELINE = """\
pipeline pp {
    first tok_embeddings
    split layers.{layer}
    last norm, output
    tie output.weight = tok_embeddings.weight
}
"""
COMMON = """\
param layers.*.mlp.weight [out, in] {}
param norm.weight [hidden] {}
param tok_embeddings.weight [vocab, hidden] {
    shard vocab over tp
}
"""


def case(name: str, head_rule: str, expect: list, listed: bool = False) -> dict:
    """``listed``: the manifest lists the alias too, tied to the source (as ``shardspec
    manifest`` writes a tied model)."""
    out = {
        "name": name,
        "spec": HEAD + PIPELINE + COMMON + head_rule,
        "manifest": MANIFEST,
        "expect": expect,
    }
    if listed:
        out["manifest"] = {**MANIFEST, "output.weight": [16, 8]}
        out["fields"] = {"output.weight": {"tied_to": "tok_embeddings.weight"}}
    return out


CASES = [
    case(
        "the alias, listed in the manifest, sharded on the other dimension",
        "param output.weight [vocab, hidden] {\n    shard hidden over tp\n}\n",
        [
            (
                "SS098",
                15,
                "tied output.weight is laid out differently from its source tok_embeddings.weight",
                "output.weight",
            )
        ],
        listed=True,
    ),
    case(
        "the head sharded on the other dimension",
        "param output.weight [vocab, hidden] {\n    shard hidden over tp\n}\n",
        [
            (
                "SS098",
                15,
                "tied output.weight is laid out differently from its source tok_embeddings.weight",
                "output.weight",
                "shard it over the same axes in the same order",
            )
        ],
    ),
    case(
        "the head replicated over dp_shard",
        "param output.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    replicate dp_shard\n}\n",
        [("SS098", 15, "tied output.weight is laid out differently", "output.weight")],
    ),
    case(
        "the same cut, with the head's style",
        "param output.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    style colwise output replicate\n}\n",
        [],
    ),
    case("no rule for the head: the source's layout", "", []),
]
