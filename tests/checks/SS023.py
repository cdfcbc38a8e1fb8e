"""SS023 uneven-shard: a dimension does not divide by the product of its axes."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'

CASES = [
    {
        "name": "vocab not divisible by tp",
        "spec": HEAD
        + """\
param output.weight [vocab, hidden] {
    shard vocab over tp
    shard hidden over dp_shard
}
""",
        "manifest": {"output.weight": [251, 64]},
        "expect": [
            (
                "SS023",
                5,
                "dimension 'vocab' of size 251 does not divide over tp=2; local sizes [125, 126]",
                "shard vocab",
            )
        ],
    },
    {
        "name": "FSDP default on an uneven first dimension",
        "spec": HEAD
        + """\
param w [out, in] {}
""",
        "manifest": {"w": [10, 8]},
        "expect": [
            (
                "SS023",
                4,
                "dimension 'out' of size 10 does not divide over dp_shard=4 (FSDP default)",
                "out",
            )
        ],
    },
    {
        "name": "one finding for a shared layout",
        "spec": HEAD
        + """\
param layers.*.w [out, in] {}
""",
        "manifest": {f"layers.{i}.w": [10, 8] for i in range(4)},
        "expect": [("SS023", 4, "layers.0.w (and 3 more): dimension 'out' of size 10")],
    },
    {
        "name": "vocab padded",
        "spec": HEAD
        + """\
param output.weight [vocab, hidden] {
    shard vocab over tp
    shard hidden over dp_shard
}
""",
        "manifest": {"output.weight": [252, 64]},
        "expect": [],
    },
    {
        "name": "suppressed on the rule's line",
        "spec": HEAD
        + """\
param w [out, in] {}  # shardspec: ignore[SS023]
""",
        "manifest": {"w": [10, 8]},
        "expect": [],
    },
    {
        "name": "FSDP over TP, uneven: torch cannot scatter the _StridedShard from one rank",
        "spec": HEAD
        + """\
param w [vocab, hidden] {
    shard vocab over (tp, dp_shard)
}
""",
        "manifest": {"w": [12, 8]},
        "expect": [
            (
                "SS023",
                5,
                "dimension 'vocab' of size 12 does not divide over tp=2 x dp_shard=4",
                "shard vocab",
                "torch's distribute_tensor cannot scatter 'vocab' from one rank: its cut over "
                "'dp_shard' is a _StridedShard (split factor 2) whose shards differ in size, "
                "which torch does not pad: give every rank the whole tensor and pass "
                "src_data_rank=None",
            ),
            ("SS024", 5, "w: ranks 6, 7 hold an empty local shard"),
        ],
    },
]
