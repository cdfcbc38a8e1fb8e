"""SS012 axis-reused: one mesh axis placed twice in one tensor's placement."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"w": [8, 8]}

CASES = [
    {
        "name": "one axis on two dimensions",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over tp
    shard in over tp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS012", 6, "it already shards dimension 'out'", "tp")],
    },
    {
        "name": "one axis twice on one dimension",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over (tp, tp)
}
""",
        "manifest": MANIFEST,
        "expect": [("SS012", 5, "axis 'tp' is listed twice for dimension 'out'", "tp)")],
    },
    {
        "name": "two shard statements for one dimension",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over tp
    shard out over dp_shard
}
""",
        "manifest": MANIFEST,
        "expect": [("SS012", 6, "dimension 'out' is sharded by two statements", "shard")],
    },
    {
        "name": "sharded and replicated",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over tp
    replicate tp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS012", 6, "axis 'tp' is both replicated and sharding dimension 'out'", "tp")],
    },
    {
        "name": "two axes on one dimension",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over (tp, dp_shard)
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "two axes on two dimensions",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over tp
    shard in over dp_shard
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
]
