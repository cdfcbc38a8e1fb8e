"""SS101 view-world: views that do not factor the same world."""

MANIFEST = {"w": [8, 8]}
FSDP = "fsdp fsdp\nfsdp efsdp\n"
RULE = "param w [out, in] { shard out over tp }\n"


def spec(dense: str, expert: str) -> str:
    return f'manifest "m.json"\nmesh dense {dense}\nmesh expert {expert}\n' + FSDP + RULE


CASES = [
    {
        "name": "stated world sizes differ",
        "spec": spec("over 8 ranks { fsdp: *  tp: 2 }", "over 4 ranks { ep: 2  efsdp: * }"),
        "manifest": MANIFEST,
        "expect": [("SS101", 3, "view 'expert' is over 4 ranks, but view 'dense' over 8", "mesh")],
    },
    {
        "name": "sizes multiply to another world",
        "spec": spec("over 8 ranks { fsdp: *  tp: 2 }", "{ ep: 2  efsdp: 2 }"),
        "manifest": MANIFEST,
        "expect": [
            ("SS101", 3, "view 'expert': mesh {'ep': 2, 'efsdp': 2} has 4 ranks", "mesh"),
        ],
    },
    {
        "name": "sizes that do not divide the world",
        "spec": spec("over 8 ranks { fsdp: *  tp: 2 }", "{ ep: 3  efsdp: * }"),
        "manifest": MANIFEST,
        "expect": [("SS101", 3, "view 'expert': world size 8 is not divisible", "mesh")],
    },
    {
        "name": "a world from a fully sized view",
        "spec": spec("{ fsdp: 4  tp: 2 }", "{ ep: 2  efsdp: * }"),
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "one world stated twice",
        "spec": spec("over 8 ranks { fsdp: *  tp: 2 }", "over 8 ranks { ep: 2  efsdp: * }"),
        "manifest": MANIFEST,
        "expect": [],
    },
]

# One cause, one finding: with the views unsized, no parameter is placed, and the hf
# block's unit checks (SS073 unexpected keys, SS078 unused lines) stay quiet.
CASES.append(
    {
        "name": "views that do not factor one world, with an hf block",
        "spec": spec("over 8 ranks { fsdp: *  tp: 2 }", "{ ep: 3  efsdp: * }")
        + 'hf "hf.json" {\n    model.w -> w\n}\n',
        "manifest": MANIFEST,
        "hf_manifest": {"config": {}, "tensors": {"model.w": [8, 8]}},
        "expect": [("SS101", 3, "view 'expert': world size 8 is not divisible", "mesh")],
    }
)
