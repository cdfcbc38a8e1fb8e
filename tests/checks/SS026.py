"""SS026 local-axis-not-outer: a local axis after a non-local one, or a local axis that
shards nothing."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"w1": [8, 16]}

CASES = [
    {
        "name": "local axis inner",
        "spec": HEAD
        + """\
param w1 [ffn, hidden] {
    shard ffn over (dp_shard, tp)
    local tp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS026", 5, "local axis 'tp' comes after non-local axis 'dp_shard'", "tp)")],
    },
    {
        "name": "local axis shards nothing",
        "spec": HEAD
        + """\
param w1 [ffn, hidden] {
    shard ffn over dp_shard
    local tp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS026", 6, "local axis 'tp' shards no dimension of this rule", "tp")],
    },
    {
        "name": "local axis outer",
        "spec": HEAD
        + """\
param w1 [ffn, hidden] {
    shard ffn over (tp, dp_shard)
    local tp
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
]
