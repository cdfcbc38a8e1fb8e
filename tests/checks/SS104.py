"""SS104 rule-view: a rule naming axes of two views, a `view` its axes contradict, an
unknown view, a second `view`, or `view` without views."""

MANIFEST = {"w": [8, 8], "r": [8, 8]}
VIEWS = (
    'manifest "m.json"\nmesh dense over 8 ranks { fsdp: *  tp: 2 }\n'
    "mesh expert { ep: 2  efsdp: * }\nfsdp fsdp\nfsdp efsdp\n"
    "param r [out, in] {}\n"
)

CASES = [
    {
        "name": "axes of two views",
        "spec": VIEWS + "param w [out, in] {\n    shard out over ep\n    shard in over tp\n}\n",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS104",
                9,
                "the rule names axis 'ep' of view 'expert' and axis 'tp' of view 'dense'",
                "tp",
                "a parameter lives on one view",
            )
        ],
    },
    {
        "name": "a view its axes contradict",
        "spec": VIEWS + "param w [out, in] {\n    shard out over ep\n    view dense\n}\n",
        "manifest": MANIFEST,
        "expect": [
            (
                "SS104",
                9,
                "`view dense`, but axis 'ep' is an axis of view 'expert'",
                "dense",
                "state `view expert`",
            )
        ],
    },
    {
        "name": "an unknown view",
        "spec": VIEWS + "param w [out, in] {\n    view expret\n}\n",
        "manifest": MANIFEST,
        "expect": [("SS104", 8, "unknown view 'expret'", "expret", "did you mean 'expert'?")],
    },
    {
        "name": "two views in a rule",
        "spec": VIEWS + "param w [out, in] {\n    view expert\n    view dense\n}\n",
        "manifest": MANIFEST,
        "expect": [("SS104", 9, "a rule states one view", "dense")],
    },
    {
        "name": "a view without views",
        "spec": 'manifest "m.json"\nmesh over 8 ranks { fsdp: * tp: 2 }\nfsdp fsdp\n'
        "param r [out, in] {}\nparam w [out, in] {\n    view dense\n}\n",
        "manifest": MANIFEST,
        "expect": [("SS104", 6, "`view dense`, but the spec has one unnamed mesh", "dense")],
    },
    {
        "name": "a stated view that agrees",
        "spec": VIEWS + "param w [out, in] {\n    shard out over ep\n    view expert\n}\n",
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "a stated view for a rule without axes",
        "spec": VIEWS + "param w [out, in] {\n    view expert\n}\n",
        "manifest": MANIFEST,
        "expect": [],
    },
]
