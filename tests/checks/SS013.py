"""SS013 manifest-mesh-mismatch: a local axis's size differs from the size the manifest's
model was built for (its factory_args)."""

SPEC = """
    manifest "m.json"
    mesh over 8 ranks { dp_shard: *  ep: EP }
    fsdp dp_shard
    param local_experts.{expert}.w1 [expert, ffn, hidden] {
        local ep
        shard expert over ep
    }
    """
MANIFEST = {"local_experts.0.w1": [16, 8], "local_experts.1.w1": [16, 8]}

CASES = [
    {
        "name": "mesh ep 4, model built for ep 2",
        "spec": SPEC.replace("EP", "4"),
        "manifest": MANIFEST,
        "factory_args": {"ep": 2},
        "expect": [("SS013", 5, "local axis 'ep' has size 4", "ep", "--arg ep=4")],
    },
    {
        "name": "-D ep 4, model built for ep 2",
        "spec": SPEC.replace("EP", "2"),
        "manifest": MANIFEST,
        "factory_args": {"ep": 2},
        "args": ["-D", "ep=4"],
        "expect": [("SS013", 5, "built with ep=2", "ep")],
    },
    {
        "name": "sizes agree",
        "spec": SPEC.replace("EP", "2"),
        "manifest": MANIFEST,
        "factory_args": {"ep": 2},
        "expect": [],
    },
    {
        "name": "manifest does not record the size",
        "spec": SPEC.replace("EP", "4"),
        "manifest": MANIFEST,
        "expect": [],
    },
    {
        "name": "a factory argument that is no size",
        "spec": SPEC.replace("EP", "4"),
        "manifest": MANIFEST,
        "factory_args": {"ep": True},
        "expect": [],
    },
]
