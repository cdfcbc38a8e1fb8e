"""SS024 empty-shard: some ranks hold nothing of a parameter; the finding names them."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'

CASES = [
    {
        "name": "tiny norm over dp_shard",
        "spec": HEAD
        + """\
param norm.weight [dim] {}
""",
        "manifest": {"norm.weight": [2]},
        "expect": [
            (
                "SS024",
                4,
                "norm.weight: ranks 4, 5, 6, 7 hold an empty local shard: dimension 'dim' "
                "of size 2 over dp_shard=4 (FSDP default)",
                "dim",
            ),
            ("SS023", 4, "dimension 'dim' of size 2 does not divide over dp_shard=4"),
        ],
    },
    {
        "name": "many empty ranks are counted",
        "spec": """
            manifest "m.json"
            mesh over 32 ranks { dp_shard: * }
            fsdp dp_shard
            param norm.weight [dim] {}
            """,
        "manifest": {"norm.weight": [4]},
        "expect": [
            ("SS024", 4, "ranks 4, 5, 6, 7, 8, 9, 10, 11 ... (28 ranks) hold an empty"),
            ("SS023", 4, "dimension 'dim' of size 4 does not divide over dp_shard=32"),
        ],
    },
    {
        "name": "uneven but nowhere empty",
        "spec": HEAD
        + """\
param norm.weight [dim] {}
""",
        "manifest": {"norm.weight": [7]},
        "expect": [("SS023", 4, "dimension 'dim' of size 7 does not divide over dp_shard=4")],
    },
    {
        "name": "tiny norm replicated",
        "spec": HEAD
        + """\
param norm.weight [dim] replicate
""",
        "manifest": {"norm.weight": [2]},
        "expect": [],
    },
]
