"""SS011 unknown-axis: an axis name that the mesh does not declare."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
MANIFEST = {"w": [8, 8]}

CASES = [
    {
        "name": "typo in shard",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over tpp
}
""",
        "manifest": MANIFEST,
        "expect": [("SS011", 5, "unknown mesh axis 'tpp'", "tpp", "did you mean 'tp'?")],
    },
    {
        "name": "axis of the mesh",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over tp
}
""",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "unknown fsdp axis",
        "spec": """
            manifest "m.json"
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            fsdp dp
            param w [out, in] {
                shard out over tp
            }
            """,
        "manifest": MANIFEST,
        "expect": [("SS011", 3, "fsdp axis 'dp' is not a mesh axis", "dp", "dp_shard, tp")],
    },
    {
        "name": "unknown replicate and local axes",
        "spec": HEAD
        + """\
param w [out, in] {
    shard out over tp
    replicate dp
    local ep
}
""",
        "manifest": MANIFEST,
        "expect": [
            ("SS011", 6, "unknown mesh axis 'dp'", "dp"),
            ("SS011", 7, "unknown mesh axis 'ep'", "ep"),
        ],
    },
]
