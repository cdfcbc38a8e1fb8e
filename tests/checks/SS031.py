"""SS031 not-representable: no DTensor placements describe the layout on every rank."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MOE_HEAD = 'manifest "m.json"\nmesh {{ {order}  tp: {tp} }}\nfsdp dp_shard\n'
EXPERTS = """\
param experts.w13 [expert, ffn, hidden] {
    fuse ffn as gate, up
    shard expert over (ep, dp_shard)
    shard ffn over tp
    style none
}
"""

CASES = [
    {
        "name": "fused dim split per component over tp, then over dp_shard",
        "spec": HEAD
        + """\
param w13 [ffn, hidden] {
    fuse ffn as gate, up
    shard ffn over (tp, dp_shard)
}
""",
        "manifest": {"w13": [16, 8]},
        "expect": [
            (
                "SS031",
                6,
                "w13: no DTensor placements describe this layout (rank 0 at "
                "{'dp_shard': 0, 'tp': 0}",
                "shard ffn",
                "`shard hidden over dp_shard`",
            )
        ],
    },
    {
        "name": "fused dim over tp, FSDP default on it",
        "spec": HEAD
        + """\
param w13 [ffn, hidden] {
    fuse ffn as gate, up
    shard ffn over tp
}
""",
        "manifest": {"w13": [16, 8]},
        "expect": [
            (
                "SS031",
                6,
                "no DTensor placements describe this layout",
                "shard ffn",
                "FSDP shards the first dimension 'ffn' over 'dp_shard' by default",
            )
        ],
    },
    {
        "name": "FSDP moved to hidden",
        "spec": HEAD
        + """\
param w13 [ffn, hidden] {
    fuse ffn as gate, up
    shard ffn over tp
    shard hidden over dp_shard
}
""",
        "manifest": {"w13": [16, 8]},
        "expect": [],
    },
    {
        "name": "blocked q/k/v of unequal sizes over tp",
        "spec": HEAD
        + """\
param wqkv [qkv, hidden] {
    fuse qkv as q 64, k 16, v 16
    shard qkv over tp
    shard hidden over dp_shard
}
""",
        "manifest": {"wqkv": [96, 8]},
        "expect": [
            (
                "SS031",
                6,
                "wqkv: no DTensor placements describe this layout",
                "shard qkv",
                "Either keep 'qkv' whole over 'tp': `replicate tp` instead of `shard qkv over "
                "tp`; or build the module with its tp shard (Megatron style, each rank holding "
                "its slice of each component): `local tp`; or if the model's forward reads the "
                "rows per group (Megatron's GQA layout), `fuse qkv as 2 groups of q 32, k 8, "
                "v 8`",
            )
        ],
    },
    {
        "name": "q/k/v of unequal sizes kept whole over tp",
        "spec": HEAD
        + """\
param wqkv [qkv, hidden] {
    fuse qkv as q 64, k 16, v 16
    replicate tp
    shard hidden over dp_shard
}
""",
        "manifest": {"wqkv": [96, 8]},
        "expect": [],
    },
    {
        "name": "grouped q/k/v over tp",
        "spec": HEAD
        + """\
param wqkv [qkv, hidden] {
    fuse qkv as 2 groups of q 32, k 8, v 8
    shard qkv over tp
    shard hidden over dp_shard
}
""",
        "manifest": {"wqkv": [96, 8]},
        "expect": [],
    },
    {
        "name": "blocked q/k/v of equal sizes over tp",
        "spec": HEAD
        + """\
param wqkv [qkv, hidden] {
    fuse qkv as q, k, v
    shard qkv over tp
    shard hidden over dp_shard
}
""",
        "manifest": {"wqkv": [96, 8]},
        "expect": [],
    },
    {
        "name": "uneven dimension over tp, then over dp_shard",
        "spec": HEAD
        + """\
param w [vocab, hidden] {
    shard vocab over tp
}
""",
        "manifest": {"w": [9, 8]},
        "expect": [
            (
                "SS031",
                5,
                "w: no DTensor placements describe this layout (rank 6 at {'dp_shard': 3, 'tp': 0}",
                "shard vocab",
                "make its size divisible by tp x dp_shard",
            ),
            ("SS023", 5, "dimension 'vocab' of size 9 does not divide over tp=2 x dp_shard=4"),
            ("SS024", 5, "w: rank 6 holds an empty local shard"),
        ],
    },
    {
        "name": "even dimension over tp, then over dp_shard",
        "spec": HEAD
        + """\
param w [vocab, hidden] {
    shard vocab over tp
}
""",
        "manifest": {"w": [16, 8]},
        "expect": [],
    },
    {
        "name": "experts over ep then FSDP against mesh order, ffn per component over tp",
        "spec": MOE_HEAD.format(order="dp_shard: 2  ep: 2", tp=2) + EXPERTS,
        "manifest": {"experts.w13": [4, 16, 6]},
        "expect": [
            (
                "SS031",
                6,
                "experts.w13: torch cannot gather this layout (full_tensor, redistribute): "
                "'ffn' is split per component over 'tp'",
                "shard expert",
                "order the mesh's axes ep before dp_shard",
            )
        ],
    },
    {
        "name": "experts over ep then FSDP in mesh order, ffn per component over tp",
        "spec": MOE_HEAD.format(order="ep: 2  dp_shard: 2", tp=2) + EXPERTS,
        "manifest": {"experts.w13": [4, 16, 6]},
        "expect": [],
    },
    {
        "name": "experts over ep then FSDP against mesh order, ffn per component over tp of 1",
        "spec": MOE_HEAD.format(order="dp_shard: 2  ep: 2", tp=1) + EXPERTS,
        "manifest": {"experts.w13": [4, 16, 6]},
        "expect": [],
    },
    {
        "name": "GQA q|k|v of unequal sizes, FSDP's default over dp_shard (Phi3)",
        "spec": HEAD
        + """\
param qkv_proj.weight [qkv, hidden] {
    fuse qkv as q 64, k 32, v 32
    replicate tp
}
""",
        "manifest": {"qkv_proj.weight": [128, 64]},
        "expect": [
            (
                "SS031",
                4,
                "no DTensor placements describe this layout",
                "qkv,",
                "by default, cutting each separately, which no DTensor layout describes. "
                "Either add `shard hidden over dp_shard`; or add `replicate dp_shard` (every rank",
            )
        ],
    },
    {
        "name": "GQA q|k|v of unequal sizes, FSDP on hidden (the hint's fix)",
        "spec": HEAD
        + """\
param qkv_proj.weight [qkv, hidden] {
    fuse qkv as q 64, k 32, v 32
    replicate tp
    shard hidden over dp_shard
}
""",
        "manifest": {"qkv_proj.weight": [128, 64]},
        "expect": [],
    },
]
