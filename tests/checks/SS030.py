"""SS030 non-contiguous-shard: a rank's shard of a stored tensor is several pieces."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"w13": [16, 8]}

CASES = [
    {
        "name": "gate/up split per component but stored fused",
        "spec": HEAD
        + """\
param w13 [ffn, hidden] {
    fuse ffn as gate, up stored fused
    shard ffn over tp
    shard hidden over dp_shard
}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS030",
                5,
                "w13: rank 0 holds dimension 'ffn' as 2 separate pieces",
                "fuse ffn",
                "drop `stored fused`",
            )
        ],
    },
    {
        "name": "stored per component",
        "spec": HEAD
        + """\
param w13 [ffn, hidden] {
    fuse ffn as gate, up
    shard ffn over tp
    shard hidden over dp_shard
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "stored fused, fused dimension not sharded",
        "spec": HEAD
        + """\
param w13 [ffn, hidden] {
    fuse ffn as gate, up stored fused
    shard hidden over (tp, dp_shard)
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
]
