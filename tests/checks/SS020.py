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
]
