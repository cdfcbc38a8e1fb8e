"""SS051 fusion-indivisible: a component (or the group count) does not divide by the fused
dimension's first axis. The requirement is F % TP per component, not 2F % TP."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
W13 = """\
param w13 [ffn, hidden] {
    fuse ffn as gate, up
    shard ffn over tp
    shard hidden over dp_shard
}
"""
QKV = """\
param wqkv [qkv, hidden] {
    fuse qkv as 3 groups of q 32, k 16, v 16
    shard qkv over tp
    shard hidden over dp_shard
}
"""

CASES = [
    {
        "name": "ffn 2 x 3 over tp 2, although 6 % 2 == 0",
        "spec": HEAD + W13,
        "manifest": {"w13": [6, 8]},
        "expect": [
            (
                "SS051",
                5,
                "component(s) of 'ffn' not divisible by tp=2: gate 3, up 3",
                "fuse ffn",
            )
        ],
    },
    {
        "name": "ffn 2 x 4 over tp 2",
        "spec": HEAD + W13,
        "manifest": {"w13": [8, 8]},
        "expect": [],
    },
    {
        "name": "3 groups over tp 2",
        "spec": HEAD + QKV,
        "manifest": {"wqkv": [192, 8]},
        "expect": [("SS051", 5, "3 groups of 'qkv' do not divide over tp=2", "fuse qkv")],
    },
    {
        "name": "ffn 2 x 3, tp 1",
        "spec": HEAD.replace("tp: 2", "tp: 1") + W13,
        "manifest": {"w13": [6, 8]},
        "expect": [],
    },
]
