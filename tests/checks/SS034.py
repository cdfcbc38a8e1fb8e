"""SS034 split-head: a shard boundary over a model-parallel axis falls inside a head."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 4 }\nfsdp dp_shard\n'
# Mistral-like attention: 32 query heads and 2 KV heads of 128.
MANIFEST = {
    "layers.0.attn.wq.weight": [4096, 512],
    "layers.0.attn.wk.weight": [256, 512],
    "layers.0.attn.wv.weight": [256, 512],
}
KV = """\
param layers.*.attn.w{k,v}.weight [kv, hidden] {
    heads kv 128
    shard kv over tp
}
"""
Q = """\
param layers.*.attn.wq.weight [q, hidden] {
    heads q 128
    shard q over tp
}
"""
QKV = """\
param wqkv [qkv, hidden] {
    fuse qkv as q 64, k 32, v 32
    heads qkv 16
    shard qkv over tp
    shard hidden over dp_shard
}
"""

CASES = [
    {
        "name": "2 KV heads over tp 4",
        "spec": HEAD + Q + KV,
        "manifest": MANIFEST,
        "expect": [
            (
                "SS034",
                10,
                "layers.0.attn.wk.weight (and 1 more): tp=4 cuts a head of 'kv' (2 heads of "
                "128): the shards of tp=0 and tp=1 (ranks 0 and 1, among others) meet at "
                "index 64, inside head 0 (indices 0-127)",
                "shard kv over tp",
                "every tp rank must hold whole heads: tp=1 or 2 keep them whole; or do not "
                "shard 'kv' over tp",
            )
        ],
    },
    {
        "name": "32 query heads over tp 3, uneven",
        "spec": HEAD.replace("over 8 ranks", "over 6 ranks").replace("tp: 4", "tp: 3") + Q,
        "manifest": {"layers.0.attn.wq.weight": [4096, 512]},
        "expect": [
            (
                "SS023",
                6,
                "dimension 'q' of size 4096 does not divide over tp=3 x dp_shard=2",
                "shard q",
                "torch.chunk sizes, which here cut heads (SS034)",
            ),
            (
                "SS034",
                6,
                "tp=3 cuts a head of 'q' (32 heads of 128): the shards of tp=0 and tp=1 "
                "(ranks 0 and 1, among others) meet at index 1366, inside head 10",
                "shard q over tp",
                "tp=1, 2, 4, 8, 16 or 32 keep them whole",
            ),
        ],
    },
    {
        "name": "-D tp=3 on the KV heads",
        "spec": HEAD + KV,
        "manifest": {"layers.0.attn.wk.weight": [256, 512]},
        "args": ["-D", "tp=3", "-D", "world=6"],
        "expect": [
            ("SS023", 6, "dimension 'kv' of size 256 does not divide over tp=3"),
            ("SS034", 6, "tp=3 cuts a head of 'kv' (2 heads of 128)"),
        ],
    },
    {
        "name": "a `*` axis takes the rest of the world: tp 8 over 8 ranks",
        "spec": 'manifest "m.json"\nmesh over 8 ranks { tp: * }\n' + Q,
        "manifest": {"layers.0.attn.wq.weight": [512, 64]},
        "expect": [("SS034", 5, "tp=8 cuts a head of 'q' (4 heads of 128)", "shard q")],
    },
    {
        "name": "fused q/k/v split per component: k cut at tp 4",
        "spec": HEAD + QKV.replace("q 64, k 32, v 32", "q, k, v").replace("qkv 16", "q 8, k 16"),
        "manifest": {"wqkv": [96, 8]},
        "expect": [
            (
                "SS034",
                7,
                "tp=4 cuts a head of component 'k' of 'qkv' (heads of 16): the shards of tp=0 "
                "and tp=1 (ranks 0 and 1, among others) meet at index 40, inside head 0 "
                "(indices 32-47)",
                "shard qkv",
                "tp=1 or 2 keep them whole",
            )
        ],
    },
    {
        "name": "a second model-parallel axis inside tp's block (2-D TP)",
        "spec": 'manifest "m.json"\nmesh over 8 ranks { tp: 2  cp: 4 }\n'
        + """\
param w [q, hidden] {
    heads q 16
    shard q over (tp, cp)
}
""",
        "manifest": {"w": [64, 8]},
        "expect": [
            (
                "SS034",
                5,
                "cp=4 cuts a head of 'q' (4 heads of 16): the shards of cp=0 and cp=1 of the "
                "block of tp=0 (ranks 0 and 1, among others) meet at index 8, inside head 0",
                "shard q",
                "cp=1 or 2 keep them whole",
            )
        ],
    },
    # ---------------------------------------------------------------- passing variants
    {
        "name": "2 KV heads over tp 2",
        "spec": HEAD.replace("tp: 4", "tp: 2") + Q + KV,
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "uneven shards on head boundaries: 5 heads of 2 over tp 3 (4, 4, 2 rows)",
        "spec": HEAD.replace("over 8 ranks", "over 3 ranks").replace("tp: 4", "tp: 3")
        + Q.replace("heads q 128", "heads q 2"),
        "manifest": {"layers.0.attn.wq.weight": [10, 64]},
        "expect": [
            (
                "SS023",
                6,
                "dimension 'q' of size 10 does not divide over tp=3",
                "shard q",
                "the model-parallel shards hold whole heads",
            )
        ],
    },
    {
        "name": "uneven over FSDP only: tp keeps heads whole",
        "spec": HEAD.replace("over 8 ranks", "over 6 ranks").replace("tp: 4", "tp: 2") + Q,
        "manifest": {"layers.0.attn.wq.weight": [4096, 512]},
        "expect": [
            (
                "SS023",
                6,
                "dimension 'q' of size 4096 does not divide over tp=2 x dp_shard=3",
                "shard q",
                "the model-parallel shards hold whole heads",
            )
        ],
    },
    {
        "name": "FSDP cuts heads: not checked (gathered before the forward)",
        "spec": 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
        + KV.replace("tp", "dp_shard"),
        "manifest": {"layers.0.attn.wk.weight": [256, 512]},
        "expect": [],
    },
    {
        "name": "grouped q/k/v: tp splits whole groups",
        "spec": HEAD.replace("tp: 4", "tp: 2")
        + QKV.replace("as q 64, k 32, v 32", "as 2 groups of q 32, k 16, v 16"),
        "manifest": {"wqkv": [128, 8]},
        "expect": [],
    },
    {
        "name": "suppressed on the shard line",
        "spec": HEAD
        + KV.replace("shard kv over tp", "shard kv over tp  # shardspec: ignore[SS034]"),
        "manifest": {"layers.0.attn.wk.weight": [256, 512]},
        "expect": [],
    },
]
