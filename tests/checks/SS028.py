"""SS028 bad-checkpoint-placement: a checkpoint split over an axis that already shards the
parameter, a local axis, or a name-indexed dimension; or one that contradicts
`checkpoint replicate`."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"embed.weight": [16, 8]}

CASES = [
    {
        "name": "split over the fsdp axis, which already shards the parameter",
        "spec": HEAD
        + """\
param embed.weight [vocab, hidden] {
    checkpoint shard hidden over dp_shard
}
""",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS028",
                5,
                "axis 'dp_shard' already shards dimension 'vocab' at run time (the fsdp default)",
                "dp_shard",
            )
        ],
    },
    {
        "name": "split over an axis a shard statement uses",
        "spec": HEAD
        + """\
param embed.weight [vocab, hidden] {
    shard vocab over tp
    checkpoint shard hidden over tp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS028", 6, "axis 'tp' already shards dimension 'vocab'", "tp")],
    },
    {
        "name": "contradicts checkpoint replicate",
        "spec": HEAD
        + """\
param embed.weight [vocab, hidden] {
    checkpoint replicate
    checkpoint shard hidden over tp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS028", 5, "`checkpoint replicate` and `checkpoint shard` contradict")],
    },
    {
        "name": "split over a replicated axis",
        "spec": HEAD
        + """\
param embed.weight [vocab, hidden] {
    checkpoint shard hidden over tp
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "checkpoint replicate alone",
        "spec": HEAD
        + """\
param embed.weight [vocab, hidden] {
    checkpoint replicate
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
]
