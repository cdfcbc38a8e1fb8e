"""SS050 fusion-size-mismatch: a fused dimension's components do not add up to its size."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
BODY = """\
param wqkv [qkv, hidden] {
    fuse qkv as FUSION
    shard qkv over tp
    shard hidden over dp_shard
}
"""

CASES = [
    {
        "name": "sizes add up to less",
        "spec": HEAD + BODY.replace("FUSION", "q 64, k 16, v 16"),
        "manifest": {"wqkv": [128, 8]},
        "expect": [
            (
                "SS050",
                5,
                "components of 'qkv' add up to 96 (q 64 + k 16 + v 16), but the dimension "
                "has size 128",
                "fuse qkv",
            )
        ],
    },
    {
        "name": "equal parts that do not divide",
        "spec": HEAD + BODY.replace("FUSION", "q, k, v"),
        "manifest": {"wqkv": [128, 8]},
        "expect": [("SS050", 5, "does not split into 3 equal component(s)", "fuse qkv")],
    },
    {
        "name": "groups add up to more",
        "spec": HEAD + BODY.replace("FUSION", "2 groups of q 32, k 16, v 16"),
        "manifest": {"wqkv": [96, 8]},
        "expect": [("SS050", 5, "add up to 128 (q 32 + k 16 + v 16 x 2 groups)", "fuse qkv")],
    },
    {
        "name": "sizes add up",
        "spec": HEAD + BODY.replace("FUSION", "q 96, k 16, v 16"),
        "manifest": {"wqkv": [128, 8]},
        "expect": [("SS031", 6, "no DTensor placements describe this layout")],
    },
    {
        "name": "groups add up",
        "spec": HEAD + BODY.replace("FUSION", "2 groups of q 32, k 16, v 16"),
        "manifest": {"wqkv": [128, 8]},
        "expect": [],
    },
]
