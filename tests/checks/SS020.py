"""SS020 unknown-dim: a statement names a dimension the rule does not declare."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"w": [8, 8]}

CASES = [
    {
        "name": "typo in shard",
        "spec": HEAD
        + """\
param w [out, in] {
    shard outt over tp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS020", 5, "unknown dimension 'outt'", "outt", "did you mean 'out'?")],
    },
    {
        "name": "typo in fuse",
        "spec": HEAD
        + """\
param w [ffn, hidden] {
    fuse fnn as gate, up
    shard hidden over dp_shard
}
""",
        "manifest": MANIFEST,
        "expect": [("SS020", 5, "unknown dimension 'fnn'", "fnn", "did you mean 'ffn'?")],
    },
    {
        "name": "declared dimensions",
        "spec": HEAD
        + """\
param w [ffn, hidden] {
    fuse ffn as gate, up
    shard ffn over tp
    shard hidden over dp_shard
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "typo in heads",
        "spec": HEAD
        + """\
param w [qkv, hidden] {
    fuse qkv as q, k, v
    heads qkv 4, kk 4
    shard hidden over dp_shard
}
""",
        "manifest": {"w": [24, 8]},
        "expect": [
            (
                "SS020",
                6,
                "heads: 'kk' is no dimension of the rule, nor a component of its fused dimension",
                "kk",
                "did you mean 'k'?",
            )
        ],
    },
    {
        "name": "heads of a dimension and of a component",
        "spec": HEAD
        + """\
param w [qkv, hidden] {
    fuse qkv as q, k, v
    heads q 4, hidden 8
    shard hidden over dp_shard
}
""",
        "manifest": {"w": [24, 8]},
        "expect": [],
    },
]
