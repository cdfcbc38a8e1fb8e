"""SS081 hf-bad-split: a split line (one HF tensor to the components of a fused dimension)
that does not fit its target."""

from tests.checks.hf_model import GOOD, HEAD, HF, MANIFEST, TENSORS

# The checkpoint stores each layer's gate and up fused, up first: model.layers.N.gate_up.
FUSED = {k: v for k, v in TENSORS.items() if not k.endswith((".gate", ".up"))}
FUSED |= {f"model.layers.{i}.gate_up": [8, 8] for i in (0, 1)}
HF_FUSED = {**HF, "tensors": FUSED}
LINES = (
    "    model.layers.{i}.gate -> layers.{i}.w13.gate\n"
    "    model.layers.{i}.up -> layers.{i}.w13.up\n"
)
assert LINES in GOOD


def split(line: str) -> str:
    """The spec with the gate and up lines replaced by ``line`` (line 8 of the spec)."""
    return HEAD + GOOD.replace(LINES, f"    {line}\n")


def on_plain(name: str, tail: str) -> dict:
    """The norm line (line 7) with ``tail``, which only a split line may have."""
    return {
        "name": name,
        "spec": HEAD + GOOD.replace("norm.weight\n", f"norm.weight{tail}\n", 1),
        "manifest": MANIFEST,
        "hf_manifest": HF,
        "expect": [
            (
                "SS081",
                7,
                "line 7 splits 'norm.weight', which has no fused dimension",
                "norm.weight",
                "an `as` list and `grouped` say how an HF tensor holds the components",
            ),
            ("SS071", "m.json:6", "storage unit 'norm.weight' [8] is produced by no hf map line"),
            ("SS078", 7, "map line model.norm.weight -> norm.weight produces no storage unit"),
        ],
    }


CASES = [
    {
        "name": "a part that is no component",
        "spec": split("model.layers.{i}.gate_up -> layers.{i}.w13 as up, gate, down"),
        "manifest": MANIFEST,
        "hf_manifest": HF_FUSED,
        "expect": [
            (
                "SS081",
                8,
                "'down' is not a component of 'layers.0.w13', whose fused dimension is "
                "gate 4, up 4",
                "down",
                "name the components of the `fuse` line",
            ),
        ],
    },
    {
        "name": "a stated size that differs from the component's",
        "spec": split("model.layers.{i}.gate_up -> layers.{i}.w13 as up 8, gate 4"),
        "manifest": MANIFEST,
        "hf_manifest": HF_FUSED,
        "expect": [
            (
                "SS081",
                8,
                "part up is stated as 8, but component up of 'layers.0.w13' has 4",
                "8",
                "the components are gate 4, up 4",
            )
        ],
    },
    {
        "name": "a size from config.json that differs",
        "spec": split(
            "model.layers.{i}.gate_up -> layers.{i}.w13 as up (intermediate_size * 2), gate"
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF_FUSED,
        "expect": [("SS081", 8, "part up is stated as 8", "(intermediate_size")],
    },
    {
        "name": "a size from a config key that config.json lacks",
        "spec": split("model.layers.{i}.gate_up -> layers.{i}.w13 as up (ffn_size), gate"),
        "manifest": MANIFEST,
        "hf_manifest": HF_FUSED,
        "expect": [("SS081", 8, "config.json has no key 'ffn_size'", "ffn_size")],
    },
    on_plain("an as list on a parameter without a fused dimension", " as a, b"),
    on_plain("grouped on a parameter without a fused dimension", " grouped"),
    {
        "name": "up first, sizes from the fuse line, from numbers and from config.json",
        "spec": split(
            "model.layers.{i}.gate_up -> layers.{i}.w13 as up (intermediate_size), gate 4"
        ),
        "manifest": MANIFEST,
        "hf_manifest": HF_FUSED,
        "expect": [],
    },
    {
        "name": "the declared order, without an as list",
        "spec": split("model.layers.{i}.gate_up -> layers.{i}.w13"),
        "manifest": MANIFEST,
        "hf_manifest": HF_FUSED,
        "expect": [],
    },
]
