"""SS061 no-manifest: without a manifest, the checks that need shapes do not run."""

CASES = [
    {
        "name": "no manifest",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            fsdp dp_shard
            param w [out, in] {}
            """,
        "expect": [("SS061", 1, "no manifest: shape, coverage and precedence checks did not run")],
    },
    {
        "name": "no manifest, silenced",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }  # shardspec: ignore[SS061]
            fsdp dp_shard
            param w [out, in] {}
            """,
        "expect": [],
    },
    {
        "name": "with a manifest",
        "spec": """
            manifest "m.json"
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            fsdp dp_shard
            param w [out, in] {}
            """,
        "manifest": {"w": [8, 8]},
        "expect": [],
    },
    {
        "name": "unreadable manifest is not reported as missing",
        "spec": """
            manifest "missing.json"
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            """,
        "expect": [("SS002", 1, "cannot read manifest")],
    },
]
