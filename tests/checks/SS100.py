"""SS100 mesh-views: an unnamed mesh beside named meshes (views), or two views of one name."""

MANIFEST = {"w": [8, 8]}
VIEWS = "mesh dense over 8 ranks { fsdp: *  tp: 2 }\nmesh expert { ep: 2  efsdp: * }\n"
FSDP = "fsdp fsdp\nfsdp efsdp\n"
RULE = "param w [out, in] { shard out over tp }\n"

CASES = [
    {
        "name": "an unnamed mesh beside views",
        "spec": 'manifest "m.json"\n' + VIEWS + "mesh { x: * }\n" + FSDP + RULE,
        "manifest": MANIFEST,
        "expect": [
            ("SS100", 4, "an unnamed mesh beside named meshes", "mesh", "name it"),
        ],
    },
    {
        "name": "two views of one name",
        "spec": 'manifest "m.json"\n' + VIEWS + "mesh dense { y: * }\n" + FSDP + RULE,
        "manifest": MANIFEST,
        "expect": [
            ("SS100", 4, "view 'dense' is declared twice", "dense", "the first is at line 2"),
        ],
    },
    {
        "name": "two views of their own names",
        "spec": 'manifest "m.json"\n' + VIEWS + FSDP + RULE,
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "one unnamed mesh",
        "spec": 'manifest "m.json"\nmesh over 8 ranks { fsdp: *  tp: 2 }\nfsdp fsdp\n' + RULE,
        "manifest": MANIFEST,
        "expect": [],
    },
]
