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

# One cause, one finding: the broken rule places nothing, so the hf lines that would
# produce its parameter's units, and the HF keys they read, are not reported as unused
# (SS078) or unexpected (SS073); the lines of other parameters still are checked.
from tests.checks import hf_model  # noqa: E402

CASES += [
    {
        "name": "a broken rule whose parameter an hf block maps",
        "spec": hf_model.HEAD.replace(
            "{ fuse ffn as gate, up }", "{ fuse ffn as gate, up\n    shard ffn over nope }"
        )
        + hf_model.GOOD,
        "manifest": hf_model.MANIFEST,
        "hf_manifest": hf_model.HF,
        "expect": [("SS011", 5, "unknown mesh axis 'nope'", "nope")],
    },
    {
        "name": "a broken rule beside an hf line that maps nothing",
        "spec": hf_model.HEAD.replace(
            "{ fuse ffn as gate, up }", "{ fuse ffn as gate, up\n    shard ffn over nope }"
        )
        + hf_model.GOOD.replace(
            "    model.norm.weight -> norm.weight\n",
            "    model.norm.weight -> norm.weight\n    model.final.weight -> final.weight\n",
        ),
        "manifest": hf_model.MANIFEST,
        "hf_manifest": hf_model.HF,
        "expect": [
            ("SS011", 5, "unknown mesh axis 'nope'", "nope"),
            ("SS078", 9, "map line model.final.weight -> final.weight produces no storage unit"),
        ],
    },
]
