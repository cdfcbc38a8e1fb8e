"""SS005 duplicate-statement: mesh, fsdp or manifest given twice."""

CASES = [
    {
        "name": "fsdp twice",
        "spec": """
            mesh over 8 ranks { dp_shard: *  dp_replicate: 2 }
            fsdp dp_shard
            fsdp dp_replicate
            """,
        "expect": [("SS005", 3, "`fsdp` appears more than once", "fsdp", "line 2")],
    },
    {
        "name": "mesh twice",
        "spec": """
            mesh over 8 ranks { dp_shard: * }
            fsdp dp_shard
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            """,
        "expect": [("SS005", 3, "`mesh` appears more than once", "mesh")],
    },
    {
        "name": "manifest twice",
        "spec": """
            manifest "m.json"
            manifest "other.json"
            mesh over 8 ranks { dp_shard: * }
            fsdp dp_shard
            param w [out, in] {}
            """,
        "manifest": {"w": [8, 8]},
        "expect": [("SS005", 2, "`manifest` appears more than once", "manifest")],
    },
    {
        "name": "each once",
        "spec": """
            manifest "m.json"
            mesh over 8 ranks { dp_shard: *  dp_replicate: 2 }
            fsdp dp_shard
            param w [out, in] {}
            """,
        "manifest": {"w": [8, 8]},
        "expect": [],
    },
]
