"""SS102 shared-axes: an axis named in two views outside their common outermost prefix, in
another order or with another size."""

MANIFEST = {"w": [8, 8]}
RULE = "fsdp fsdp\nfsdp efsdp\nparam w [out, in] { shard out over tp }\n"


def spec(dense: str, expert: str) -> str:
    return (
        f'manifest "m.json"\nmesh dense over 16 ranks {{ {dense} }}\nmesh expert {{ {expert} }}\n'
        + RULE
    )


CASES = [
    {
        "name": "a shared axis after a view's own",
        "spec": spec("dp_replicate: 2  fsdp: *  tp: 2", "ep: 2  dp_replicate: 2  efsdp: *"),
        "manifest": MANIFEST,
        "expect": [
            (
                "SS102",
                3,
                "declares it after its own axis 'ep'",
                "dp_replicate",
                "come first, outermost",
            )
        ],
    },
    {
        "name": "shared axes in two orders",
        "spec": spec(
            "pp: 2  dp_replicate: 2  fsdp: *  tp: 2", "dp_replicate: 2  pp: 2  efsdp: *  ep: 2"
        ),
        "manifest": MANIFEST,
        "expect": [("SS102", 3, "orders its shared axes dp_replicate, pp", "dp_replicate")],
    },
    {
        "name": "a shared axis of two sizes",
        "spec": spec("dp_replicate: 2  fsdp: *  tp: 2", "dp_replicate: 4  efsdp: *  ep: 2"),
        "manifest": MANIFEST,
        "expect": [
            ("SS102", 3, "shared axis 'dp_replicate' has size 4 here, 2 at line 2", "dp_replicate")
        ],
    },
    {
        "name": "a shared prefix",
        "spec": spec("dp_replicate: 2  fsdp: *  tp: 2", "dp_replicate: 2  efsdp: *  ep: 2"),
        "manifest": MANIFEST,
        "expect": [],
    },
]
