"""SS035 bad-heads: a head size of 0, given twice, a name that resolves to nothing, or a
size that does not divide its dimension or component."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
QKV = """\
param wqkv [qkv, hidden] {
    fuse qkv as 2 groups of q 32, k 16, v 16
    heads qkv 16
    shard qkv over tp
    shard hidden over dp_shard
}
"""
HF = {"config": {"head_dim": 16, "act": "silu"}, "tensors": {"wk": [32, 8]}}
WK = """\
hf "hf.json" {
    wk -> wk
}
param wk [kv, hidden] {
    heads kv 16
    shard kv over tp
}
"""

CASES = [
    {
        "name": "heads of 3 do not divide 256",
        "spec": HEAD + "param wk [kv, hidden] {\n    heads kv 3\n    shard kv over tp\n}\n",
        "manifest": {"wk": [256, 8]},
        "expect": [
            (
                "SS035",
                5,
                "wk: heads of 3 do not divide dimension 'kv' of size 256",
                "kv 3",
                "not the number of heads",
            )
        ],
    },
    {
        "name": "a component's heads do not divide it",
        "spec": HEAD
        + QKV.replace("heads qkv 16", "heads qkv 16, v 12").replace(
            "heads qkv 16, v 12", "heads q 16, v 12"
        ),
        "manifest": {"wqkv": [128, 8]},
        "expect": [
            ("SS035", 6, "heads of 12 do not divide component 'v' of 'qkv' of size 16", "v 12")
        ],
    },
    {
        "name": "size 0, and given twice",
        "spec": HEAD + QKV.replace("heads qkv 16", "heads qkv 16, k 16\n    heads v 0"),
        "manifest": {"wqkv": [128, 8]},
        "expect": [
            ("SS035", 6, "heads of 'k' are given twice (line 6: `heads qkv 16`)", "k 16"),
            ("SS035", 7, "heads of 'v' have size 0", "v 0"),
            ("SS035", 7, "heads of 'v' are given twice (line 6: `heads qkv 16`)", "v 0"),
        ],
    },
    {
        "name": "a name that resolves to nothing",
        "spec": HEAD + QKV.replace("heads qkv 16", "heads qkv head_size"),
        "manifest": {"wqkv": [128, 8]},
        "factory_args": {"head_dim": 16},
        "expect": [
            (
                "SS035",
                6,
                "head size 'head_size' resolves to nothing",
                "head_size",
                "write the size",
            )
        ],
    },
    {
        "name": "a config.json value that is no whole number",
        "spec": HEAD + WK.replace("kv 16", "kv act"),
        "manifest": {"wk": [32, 8]},
        "hf_manifest": HF,
        "expect": [
            (
                "SS035",
                8,
                "head size 'act': the config.json key is 'silu', not a whole number",
                "act",
            )
        ],
    },
    # ---------------------------------------------------------------- passing variants
    {
        "name": "a literal size that divides every component",
        "spec": HEAD + QKV,
        "manifest": {"wqkv": [128, 8]},
        "expect": [],
    },
    {
        "name": "a factory argument",
        "spec": HEAD + QKV.replace("heads qkv 16", "heads qkv head_dim"),
        "manifest": {"wqkv": [128, 8]},
        "factory_args": {"head_dim": 16},
        "expect": [],
    },
    {
        "name": "a config.json key of the HF manifest",
        "spec": HEAD + WK.replace("kv 16", "kv head_dim"),
        "manifest": {"wk": [32, 8]},
        "hf_manifest": HF,
        "expect": [],
    },
]
