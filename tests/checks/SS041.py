"""SS041 unused-rule: a rule or ignore that matches nothing."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'
NO_BIAS = {"attn.wq.weight": [8, 8], "attn.wo.weight": [8, 8]}

CASES = [
    {
        "name": "bias rule for a model built with bias=False",
        "spec": HEAD
        + """\
param **.weight [out, in] {}
param **.bias [out] replicate
""",
        "manifest": NO_BIAS,
        "expect": [("SS041", 5, "rule '**.bias' matches no parameter", "**.bias")],
    },
    {
        "name": "unused ignore",
        "spec": HEAD
        + """\
ignore **._extra_state
param **.weight [out, in] {}
""",
        "manifest": NO_BIAS,
        "expect": [("SS041", 4, "ignore '**._extra_state' matches nothing", "**._extra_state")],
    },
    {
        "name": "rule for ignored parameters only",
        "spec": HEAD
        + """\
ignore attn.wo.*
param attn.wo.weight [out, in] {}
param **.weight [out, in] {}
""",
        "manifest": NO_BIAS,
        "expect": [
            (
                "SS041",
                5,
                "rule 'attn.wo.weight' matches only ignored parameters (`ignore attn.wo.*`, "
                "line 4)",
                "attn.wo.weight",
            )
        ],
    },
    {
        "name": "every rule and ignore used",
        "spec": HEAD
        + """\
ignore attn.wo.*
param **.weight [out, in] {}
""",
        "manifest": NO_BIAS,
        "expect": [],
    },
    {
        "name": "a rule with a broken sibling is still checked",
        "spec": HEAD
        + """\
param **.weight [out, in] { shard out over tpp }
param **.bias [out] replicate
""",
        "manifest": NO_BIAS,
        "expect": [
            ("SS011", 4, "unknown mesh axis 'tpp'"),
            ("SS041", 5, "rule '**.bias' matches no parameter"),
        ],
    },
]
