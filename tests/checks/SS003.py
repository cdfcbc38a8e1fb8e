"""SS003 bad-manifest: the manifest is not valid JSON of the manifest format. The finding
points at the `manifest` statement and says where in the manifest the problem is."""

SPEC = """
    manifest "m.json"
    mesh over 8 ranks { dp_shard: * }
    fsdp dp_shard
    param w [out, in] {}
    """

CASES = [
    {
        "name": "invalid JSON",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/1",\n "entries": [}\n',
        "expect": [("SS003", 1, "m.json:2:14: manifest is not valid JSON", '"m.json"')],
    },
    {
        "name": "wrong format field",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/9", "entries": []}\n',
        "expect": [("SS003", 1, "m.json: manifest field format", '"m.json"')],
    },
    {
        "name": "a state_dict section in a format-1 manifest",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/1", "entries": '
        '[{"fqn": "w", "shape": [8, 8]}], "state_dict": {}}\n',
        "expect": [("SS003", 1, "m.json: manifest field state_dict: a shardspec-manifest/2")],
    },
    {
        "name": "a state_dict key added in place of no entry",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "w", "shape": [8, 8]}],\n'
        ' "state_dict": {"keys": [\n'
        '  {"fqn": "w.q", "change": "added", "from": ["v"]}]}}\n',
        "expect": [("SS003", 1, "m.json:4:4: manifest field state_dict: key 'w.q' is from 'v'")],
    },
    {
        "name": "a state_dict key of another change kind",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": '
        '[{"fqn": "w", "shape": [8, 8]}], "state_dict": {"keys": '
        '[{"fqn": "w", "change": "renamed"}]}}\n',
        "expect": [("SS003", 1, "state_dict.keys.0.change")],
    },
    {
        "name": "a format-2 manifest with a state_dict section",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": '
        '[{"fqn": "w", "shape": [8, 8]}], "state_dict": {"hooks": {"": ["overrides '
        'state_dict"]}, "keys": [{"fqn": "w2", "change": "added", "from": ["w"], '
        '"shape": [8, 8], "dtype": "float32"}]}}\n',
        "expect": [],
    },
    {
        "name": "unknown entry kind",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/1", "entries": '
        '[{"fqn": "w", "kind": "weight", "shape": [8, 8]}]}\n',
        "expect": [("SS003", 1, "entries.0.kind")],
    },
    {
        "name": "entry listed twice",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/1", "entries": [\n'
        '  {"fqn": "w", "shape": [8, 8]},\n'
        '  {"fqn": "w", "shape": [8, 8]}\n'
        "]}\n",
        "expect": [("SS003", 1, "m.json:3:3: manifest lists 'w' twice")],
    },
    {
        "name": "valid manifest",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/1", "entries": '
        '[{"fqn": "w", "shape": [8, 8]}]}\n',
        "expect": [],
    },
    {
        "name": "HF manifest of another format",
        "spec": 'manifest "m.json"\nmesh over 2 ranks { tp: 2 }\nparam w [a] {}\n'
        'hf "hf.json" { x -> w }\n',
        "manifest": {"w": [4]},
        "hf_manifest_text": '{"format": "shardspec-hf-manifest/9", "config": {}, "tensors": {}}',
        "expect": [("SS003", 4, "hf.json: HF manifest field format", '"hf.json"')],
    },
    {
        "name": "HF manifest that is not JSON",
        "spec": 'manifest "m.json"\nmesh over 2 ranks { tp: 2 }\nparam w [a] {}\n'
        'hf "hf.json" { x -> w }\n',
        "manifest": {"w": [4]},
        "hf_manifest_text": '{"format": "shardspec-hf-manifest/1",\n  "config": {,}}',
        "expect": [("SS003", 4, "hf.json:2:14: HF manifest is not valid JSON", '"hf.json"')],
    },
    {
        "name": "a valid HF manifest",
        "spec": 'manifest "m.json"\nmesh over 2 ranks { tp: 2 }\nparam w [a] {}\n'
        'hf "hf.json" { x -> w }\n',
        "manifest": {"w": [4]},
        "hf_manifest_text": '{"format": "shardspec-hf-manifest/1", "config": {}, "tensors": '
        '{"x": {"shape": [4], "dtype": "F32", "file": "model.safetensors"}}}',
        "expect": [],
    },
    {
        "name": "an entry whose dtype is no torch dtype",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "w", "shape": [8, 8], "dtype": "not_a_dtype"}]}\n',
        "expect": [
            (
                "SS003",
                1,
                "m.json:2:3: manifest entry 'w' has dtype 'not_a_dtype', which is no torch dtype",
                '"m.json"',
            )
        ],
    },
    {
        "name": "torch's other name of a dtype",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": '
        '[{"fqn": "w", "shape": [8, 8], "dtype": "float"}]}\n',
        "expect": [("SS003", 1, "dtype 'float', which is no torch dtype; did you mean 'float32'?")],
    },
    {
        "name": "a state_dict key whose dtype is no torch dtype",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": '
        '[{"fqn": "w", "shape": [8, 8]}], "state_dict": {"keys": [{"fqn": "w2", "change": '
        '"added", "from": ["w"], "shape": [8, 8], "dtype": "f32"}]}}\n',
        "expect": [("SS003", 1, "key 'w2' has dtype 'f32', which is no torch dtype")],
    },
    {
        "name": "torch's dtypes, and none recorded",
        "spec": SPEC.replace("param w [out, in] {}", "param w [out, in] {}\nparam v [a] {}"),
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "w", "shape": [8, 8], "dtype": "float8_e4m3fn"},\n'
        '  {"fqn": "v", "shape": [8]}]}\n',
        "expect": [],
    },
    {
        "name": "a tie to no entry",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "w", "shape": [8, 8], "tied_to": "embed.weight"}]}\n',
        "expect": [
            (
                "SS003",
                1,
                "m.json:2:3: manifest entry 'w' is tied to 'embed.weight', which is no "
                "parameter of the manifest",
            )
        ],
    },
    {
        "name": "a tie to a tensor of another shape",
        "spec": SPEC.replace("param w [out, in] {}", "param {w,v} [out, in] {}"),
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "v", "shape": [8, 4]},\n'
        '  {"fqn": "w", "shape": [8, 8], "tied_to": "v"}]}\n',
        "expect": [("SS003", 1, "m.json:3:3: manifest entry 'w' is tied to 'v', whose shape")],
    },
    {
        "name": "a tie to a tied name",
        "spec": SPEC.replace("param w [out, in] {}", "param {w,v,u} [out, in] {}"),
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "u", "shape": [8, 8]},\n'
        '  {"fqn": "v", "shape": [8, 8], "tied_to": "u"},\n'
        '  {"fqn": "w", "shape": [8, 8], "tied_to": "v"}]}\n',
        "expect": [
            ("SS003", 1, "m.json:4:3: manifest entry 'w' is tied to 'v', which is no first")
        ],
    },
    {
        "name": "a tied buffer",
        "spec": SPEC,
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "w", "shape": [8, 8]},\n'
        '  {"fqn": "b", "kind": "buffer", "shape": [8, 8], "tied_to": "w"}]}\n',
        "expect": [("SS003", 1, "m.json:3:3: manifest entry 'b' is a buffer: only parameters")],
    },
    {
        "name": "a tie as shardspec manifest records it",
        "spec": SPEC.replace("param w [out, in] {}", "param {w,v} [out, in] {}"),
        "manifest_text": '{"format": "shardspec-manifest/2", "entries": [\n'
        '  {"fqn": "v", "shape": [8, 8], "dtype": "float32", "module": "embedding", "class": '
        '"torch.nn.modules.sparse.Embedding"},\n'
        '  {"fqn": "w", "shape": [8, 8], "dtype": "float32", "module": "linear", "class": '
        '"torch.nn.modules.linear.Linear", "tied_to": "v"}]}\n',
        "expect": [],
    },
]
