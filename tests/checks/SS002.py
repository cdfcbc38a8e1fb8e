"""SS002 unreadable-input: a spec or manifest that cannot be read."""

CASES = [
    {
        "name": "missing manifest",
        "spec": """
            manifest "missing.json"
            mesh over 8 ranks { dp_shard: * }
            """,
        "expect": [("SS002", 1, "cannot read manifest", '"missing.json"')],
    },
    {
        "name": "manifest found",
        "spec": """
            manifest "m.json"
            mesh over 8 ranks { dp_shard: * }
            fsdp dp_shard
            param w [out, in] {}
            """,
        "manifest": {"w": [8, 8]},
        "expect": [],
    },
    {
        "name": "missing spec",
        "spec_path": "missing.shard",
        "expect": [("SS002", "missing.shard:1", "cannot read spec")],
    },
    {
        "name": "spec is not UTF-8",
        "spec_bytes": b"mesh over 8 ranks { dp_shard: * }\n# caf\xe9\n",
        "expect": [("SS002", 1, "cannot read spec")],
    },
    {
        "name": "HF manifest missing",
        "spec": 'manifest "m.json"\nmesh over 2 ranks { tp: 2 }\nparam w [a] {}\n'
        'hf "nope.json" { x -> w }\n',
        "manifest": {"w": [4]},
        "expect": [("SS002", 4, "cannot read HF manifest", '"nope.json"', "shardspec hf-manifest")],
    },
]
