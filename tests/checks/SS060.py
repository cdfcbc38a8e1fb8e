"""SS060 unused-suppression: a `# shardspec: ignore[...]` that silences nothing, or names
an unknown code. A used suppression silences its finding."""

HEAD = 'manifest "m.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }\nfsdp dp_shard\n'

CASES = [
    {
        "name": "nothing to silence",
        "spec": HEAD
        + """\
param w [out, in] {}  # shardspec: ignore[SS023]
""",
        "manifest": {"w": [8, 8]},
        "expect": [("SS060", 4, "suppression of SS023 silences nothing", "# shardspec", "delete")],
    },
    {
        "name": "used suppression silences the finding",
        "spec": HEAD
        + """\
param w [out, in] {}  # shardspec: ignore[SS023]
""",
        "manifest": {"w": [10, 8]},
        "expect": [],
    },
    {
        "name": "suppression on the rule's first line covers the rule",
        "spec": HEAD
        + """\
param w [out, in] {  # shardspec: ignore[SS023]
    shard in over tp
}
""",
        "manifest": {"w": [8, 5]},
        "expect": [],
    },
    {
        "name": "suppression of one code keeps the others",
        "spec": HEAD
        + """\
param w [out, in] {}  # shardspec: ignore[SS024]
""",
        "manifest": {"w": [6, 8]},
        "expect": [("SS023", 4, "dimension 'out' of size 6 does not divide")],
    },
    {
        "name": "suppression on another line silences nothing",
        "spec": HEAD
        + """\
# shardspec: ignore[SS023]
param w [out, in] {}
""",
        "manifest": {"w": [10, 8]},
        "expect": [
            ("SS060", 4, "suppression of SS023 silences nothing"),
            ("SS023", 5, "dimension 'out' of size 10 does not divide"),
        ],
    },
    {
        "name": "unknown code",
        "spec": HEAD
        + """\
param w [out, in] {}  # shardspec: ignore[SS999]
""",
        "manifest": {"w": [8, 8]},
        "expect": [("SS060", 4, "unknown code(s) SS999 in suppression", "# shardspec")],
    },
    {
        "name": "retired code",
        "spec": HEAD
        + """\
param w [out, in] {}  # shardspec: ignore[SS025]
""",
        "manifest": {"w": [8, 8]},
        "expect": [("SS060", 4, "unknown code(s) SS025 in suppression (SS025 retired")],
    },
    {
        "name": "no code",
        "spec": HEAD
        + """\
param w [out, in] {}  # shardspec: ignore[]
""",
        "manifest": {"w": [8, 8]},
        "expect": [("SS060", 4, "the suppression names no code")],
    },
    {
        "name": "suppression text in a string is no suppression",
        "spec": 'manifest "m.json# shardspec: ignore[SS023]"\n'
        "mesh over 8 ranks { dp_shard: * }\nfsdp dp_shard\n",
        "expect": [("SS002", 1, "cannot read manifest")],
    },
    {
        "name": "a manifest check's code while the manifest is unreadable: not known unused",
        "spec": 'manifest "missing.json"\nmesh over 8 ranks { dp_shard: * }\nfsdp dp_shard\n'
        "param w [out, in] {}  # shardspec: ignore[SS023]\n",
        "expect": [("SS002", 1, "cannot read manifest")],
    },
    {
        "name": "a structural code while the manifest is unreadable: still reported",
        "spec": 'manifest "missing.json"\nmesh over 8 ranks { dp_shard: * }\nfsdp dp_shard\n'
        "param w [out, in] {}  # shardspec: ignore[SS011]\n",
        "expect": [
            ("SS002", 1, "cannot read manifest"),
            ("SS060", 4, "suppression of SS011 silences nothing"),
        ],
    },
]
