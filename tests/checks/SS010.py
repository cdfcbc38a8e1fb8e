"""SS010 bad-mesh: no mesh, no axes, a repeated axis, size 0, two `*` axes, or sizes that
do not fit the world size."""

CASES = [
    {
        "name": "no mesh",
        "spec": """
            fsdp dp_shard
            param w [out, in] {}
            """,
        "expect": [("SS010", 1, "the spec declares no mesh", "", "mesh over N ranks")],
    },
    {
        "name": "duplicate axis",
        "spec": """
            mesh over 8 ranks {
                dp_shard: *
                tp: 2
                tp: 2
            }
            """,
        "expect": [("SS010", 4, "mesh axis 'tp' is declared twice", "tp")],
    },
    {
        "name": "duplicate axis with a manifest builds no layouts",
        "spec": """
            manifest "m.json"
            mesh over 8 ranks { dp_shard: 2  tp: 2  tp: 2 }
            fsdp dp_shard
            param w [out, in] {
                shard out over tp
            }
            """,
        "manifest": {"w": [8, 8]},
        "expect": [("SS010", 2, "mesh axis 'tp' is declared twice", "tp: 2 }")],
    },
    {
        "name": "two rest axes",
        "spec": """
            mesh over 8 ranks {
                dp_shard: *
                dp_replicate: *
            }
            """,
        "expect": [("SS010", 3, "'dp_replicate' also takes the rest of the world", "dp_replicate")],
    },
    {
        "name": "world not divisible",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 3 }
            """,
        "expect": [("SS010", 1, "world size 8 is not divisible by the other mesh axes' product 3")],
    },
    {
        "name": "fixed sizes do not make the world",
        "spec": """
            mesh over 8 ranks { dp_shard: 2  tp: 2 }
            """,
        "expect": [("SS010", 1, "has 4 ranks, but the world size is 8", "mesh")],
    },
    {
        "name": "rest axis without a world size, with a manifest to check",
        "spec": """
            manifest "m.json"
            mesh { dp_shard: *  tp: 2 }
            fsdp dp_shard
            param w [out, in] {}
            """,
        "manifest": {"w": [8, 8]},
        "expect": [("SS010", 2, "takes the rest, but no world size is known", "", "-D world=N")],
    },
    {
        # Without a manifest no check computes a layout; the runtime knows the world size.
        "name": "rest axis without a world size and no manifest",
        "spec": """
            mesh { dp_shard: *  tp: 2 }  # shardspec: ignore[SS061]
            """,
        "expect": [],
    },
    {
        "name": "rest axis with -D world",
        "spec": """
            mesh { dp_shard: *  tp: 2 }
            """,
        "args": ["-D", "world=8"],
        "expect": [],
    },
    {
        "name": "-D makes the world indivisible",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            """,
        "args": ["-D", "tp=3"],
        "expect": [("SS010", 1, "not divisible by the other mesh axes' product 3")],
    },
    {
        "name": "-D tp beyond the spec's world: the hint names -D world",
        "spec": """
            mesh over 4 ranks { dp_shard: *  tp: 2 }
            """,
        "args": ["-D", "tp=8"],
        "expect": [
            (
                "SS010",
                1,
                "world size 4 is not divisible by the other mesh axes' product 8",
                "mesh",
                "`-D world=16` keeps dp_shard 2, or `-D world=8` makes dp_shard 1",
            )
        ],
    },
    {
        "name": "-D tp with the world the hint names",
        "spec": """
            mesh over 4 ranks { dp_shard: *  tp: 2 }
            """,
        "args": ["-D", "tp=8", "-D", "world=8"],
        "expect": [],
    },
    {
        "name": "axis of size 0",
        "spec": """
            mesh { dp_shard: 4  tp: 0 }
            """,
        "expect": [("SS010", 1, "mesh axis 'tp' has size 0", "tp: 0")],
    },
    {
        "name": "world of 0 ranks",
        "spec": """
            mesh over 0 ranks { dp_shard: * }
            """,
        "expect": [("SS010", 1, "has an empty axis")],
    },
    {
        "name": "no axes",
        "spec": """
            mesh over 8 ranks { }
            """,
        "expect": [("SS010", 1, "the mesh has no axes")],
    },
    {
        "name": "mesh that fits",
        "spec": """
            mesh over 8 ranks { dp_shard: *  tp: 2 }
            """,
        "expect": [],
    },
    {
        "name": "fixed mesh without a world size",
        "spec": """
            mesh { dp_shard: 4  tp: 2 }
            """,
        "expect": [],
    },
    {
        "name": "a world too large to check (it overflowed, or ran out of memory)",
        "spec": """
            mesh over 4611686018427387904 ranks { dp_shard: *  tp: 2 }
            """,
        "expect": [
            (
                "SS010",
                1,
                "has 4611686018427387904 ranks; lint and compile check meshes of up to "
                "1048576 ranks",
                "",
                "at most 1048576 ranks (-D world=N)",
            )
        ],
    },
    {
        "name": "the largest world checked",
        "spec": """
            mesh over 1048576 ranks { dp_shard: *  tp: 2 }
            """,
        "expect": [],
    },
]

# One cause, one finding: the hf block's checks of storage units (SS073 unexpected keys,
# SS078 unused lines) need the layouts the mesh gives, and stay quiet without them.
from tests.checks import hf_model  # noqa: E402

CASES.append(
    {
        "name": "a mesh that does not fit its world, with an hf block",
        "spec": hf_model.HEAD.replace("over 2 ranks", "over 3 ranks") + hf_model.GOOD,
        "manifest": hf_model.MANIFEST,
        "hf_manifest": hf_model.HF,
        "expect": [("SS010", 2, "mesh {'tp': 2} has 2 ranks, but the world size is 3")],
    }
)
