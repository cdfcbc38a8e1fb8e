"""SS103 view-fsdp: an FSDP axis missing from a view, two for one view, or a shared one."""

MANIFEST = {"w": [8, 8]}
VIEWS = (
    'manifest "m.json"\nmesh dense over 16 ranks { dp_replicate: 2  fsdp: *  tp: 2 }\n'
    "mesh expert { dp_replicate: 2  efsdp: *  ep: 2 }\n"
)
RULE = "param w [out, in] { shard out over tp }\n"

CASES = [
    {
        "name": "a view without an fsdp axis",
        "spec": VIEWS + "fsdp fsdp\n" + RULE,
        "manifest": MANIFEST,
        "expect": [
            (
                "SS103",
                3,
                "view 'expert' has no fsdp axis, but view 'dense' has one",
                "expert",
                "add `fsdp AXIS` naming one of view 'expert''s own axes (efsdp, ep)",
            )
        ],
    },
    {
        "name": "two fsdp axes in one view",
        "spec": VIEWS + "fsdp fsdp\nfsdp efsdp\nfsdp tp\n" + RULE,
        "manifest": MANIFEST,
        "expect": [("SS103", 6, "view 'dense' has two fsdp axes, 'fsdp' and 'tp'", "tp")],
    },
    {
        "name": "a shared fsdp axis",
        "spec": VIEWS + "fsdp dp_replicate\n" + RULE,
        "manifest": MANIFEST,
        "expect": [
            (
                "SS103",
                4,
                "fsdp axis 'dp_replicate' is shared by views 'dense', 'expert'",
                "dp_replicate",
            )
        ],
    },
    {
        "name": "an fsdp axis per view",
        "spec": VIEWS + "fsdp fsdp\nfsdp efsdp\n" + RULE,
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "no fsdp axis at all",
        "spec": VIEWS + RULE,
        "manifest": MANIFEST,
        "expect": [],
    },
]
