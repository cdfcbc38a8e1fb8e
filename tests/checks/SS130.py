"""SS130 unknown-key-layout: `checkpoint keys NAME` names no checkpoint key layout."""

HEAD = 'manifest "m.json"\nmesh over 4 ranks { dp_shard: * }\nfsdp dp_shard\n'
MANIFEST = {"w": [16, 8]}
BODY = "param w [out, hidden] {}\n"

CASES = [
    {
        "name": "a misspelt trainer",
        "spec": HEAD + "checkpoint keys titan\n" + BODY,
        "manifest": MANIFEST,
        "expect": [
            (
                "SS130",
                4,
                "`checkpoint keys titan`: no such checkpoint key layout",
                "titan",
                "did you mean 'torchtitan'? key layouts: shardspec, torchtitan",
            )
        ],
    },
    {
        "name": "torchtitan's key layout",
        "spec": HEAD + "checkpoint keys torchtitan\n" + BODY,
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "shardspec's own, said explicitly",
        "spec": HEAD + "checkpoint keys shardspec\n" + BODY,
        "manifest": MANIFEST,
        "expect": [],
    },
]
