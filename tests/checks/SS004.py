"""SS004 bad-argument: a malformed or unknown command-line argument (exit status 2)."""

SPEC = """
    mesh over 8 ranks { dp_shard: *  tp: 2 }
    fsdp dp_shard
    """

CASES = [
    {
        "name": "-D names no mesh axis",
        "spec": SPEC,
        "args": ["-D", "tpp=4"],
        "expect": [("SS004", "<command line>:1", "-D tpp: spec")],
    },
    {
        "name": "-D size is not a number",
        "spec": SPEC,
        "args": ["-D", "tp=x"],
        "expect": [("SS004", "<command line>:1", "'tp=x' is not AXIS=N")],
    },
    {
        "name": "-D size is zero",
        "spec": SPEC,
        "args": ["-D", "tp=0"],
        "expect": [("SS004", "<command line>:1", "'tp=0' is not AXIS=N")],
    },
    {
        "name": "-D of a mesh axis",
        "spec": SPEC,
        "args": ["-D", "tp=4"],
        "expect": [],
    },
    {
        "name": "-D world",
        "spec": SPEC,
        "args": ["-D", "world=16"],
        "expect": [],
    },
]
