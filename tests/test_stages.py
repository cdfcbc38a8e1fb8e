"""Pipeline stage arithmetic (``shardspec.core.stages``): which stage holds each parameter, the
layers per stage, and stage-local names, at any pipeline size. The compiler's checks and
the runtime both use these functions, so they are tested here on plain names."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardspec.checks.pipeline import STAGE_CODES
from shardspec.core.stages import (
    PipelineSpec,
    StageError,
    assignment_problems,
    claims,
    is_layer_number,
    layer_counts,
    layer_of,
    layers,
    places,
    plan,
    tie_problems,
)

LLAMA = PipelineSpec(
    axis="pp", first=("tok_embeddings",), last=("norm", "output"), split="layers.{layer}"
)
LOCAL = PipelineSpec(
    axis="pp",
    first=("tok_embeddings",),
    last=("norm", "output"),
    split="layers.{layer}",
    local_names=True,
)


def names(n_layers: int) -> list[str]:
    """A Llama-like model's parameter names (global), in manifest order."""
    out = ["norm.weight", "output.weight", "tok_embeddings.weight"]
    for i in range(n_layers):
        out += [f"layers.{i}.attention.wqkv.weight", f"layers.{i}.feed_forward.w2.weight"]
    return sorted(out)


# ----------------------------------------------------------------------------- patterns


@pytest.mark.parametrize(
    ("pattern", "fqn", "expected"),
    [
        ("output", "output.weight", True),
        ("output", "output.bias", True),
        ("output", "output", True),  # a module prefix covers the module itself
        ("output", "outputs.weight", False),
        ("output", "head.output.weight", False),  # a prefix, not a suffix
        ("layers.0", "layers.0.attention.wqkv.weight", True),
        ("layers.0", "layers.00.attention.wqkv.weight", False),
        ("layers.0", "layers.10.w", False),
        ("*norm", "norm.weight", True),
        ("*norm", "layers.0.ffn_norm.weight", False),
        ("**.*norm", "layers.0.ffn_norm.weight", True),
        ("tok_*", "tok_embeddings.weight", True),
    ],
)
def test_patterns_are_module_prefixes(pattern: str, fqn: str, expected: bool) -> None:
    assert places(pattern, fqn) is expected


def test_layer_of_and_claims() -> None:
    assert layer_of(LLAMA, "layers.12.attention.wqkv.weight") == "12"
    assert layer_of(LLAMA, "layers.12") == "12"
    assert layer_of(LLAMA, "norm.weight") is None
    assert layer_of(PipelineSpec(axis="pp", first=("a",)), "layers.1.w") is None  # no split
    inside = PipelineSpec(axis="pp", split="model.block{n}")  # a capture within a segment
    assert layer_of(inside, "model.block7.mlp.weight") == "7"
    assert claims(LLAMA, "tok_embeddings.weight") == ["first"]
    assert claims(LLAMA, "output.weight") == ["last"]
    assert claims(LLAMA, "layers.3.feed_forward.w2.weight") == ["split"]
    assert claims(LLAMA, "rope.freqs") == []
    both = PipelineSpec(axis="pp", first=("layers.0", "norm"), last=("norm",), split="layers.{l}")
    assert claims(both, "layers.0.w") == ["first", "split"]
    assert claims(both, "norm.weight") == ["first", "last"]
    assert assignment_problems(both, ["layers.0.w", "layers.1.w", "norm.weight", "x"]) == [
        ("layers.0.w", ["first", "split"]),
        ("norm.weight", ["first", "last"]),
        ("x", []),
    ]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", True),
        ("17", True),
        ("007", True),
        ("", False),
        ("a", False),
        ("1a", False),
        ("-1", False),
        ("\u00b2", False),
        ("\u0661", False),
        (" 1", False),
    ],
)
def test_is_layer_number(value: str, expected: bool) -> None:
    """ASCII digits only: ``'²'.isdigit()`` holds but ``int('²')`` fails."""
    assert is_layer_number(value) is expected


def test_layers_sort_by_number_then_text() -> None:
    found = layers(LLAMA, ["layers.10.w", "layers.2.w", "layers.2.v", "layers.1.w", "norm.w"])
    assert found == ("1", "2", "10")
    # `1` and `01` are distinct layers of equal number: the text breaks the tie, so every
    # process sorts them alike whatever its hash seed
    assert layers(LLAMA, ["layers.01.w", "layers.1.w", "layers.0.w"]) == ("0", "01", "1")
    assert layers(LLAMA, ["layers.1.w", "layers.01.w", "layers.0.w"]) == ("0", "01", "1")
    with pytest.raises(StageError) as e:
        layers(LLAMA, ["layers.0.w", "layers.\u00b2.w"])
    assert STAGE_CODES[e.value.problem] == "SS095" and "'²'" in str(e.value)


# ----------------------------------------------------------------------------- layer counts


def test_layer_counts_even_and_explicit() -> None:
    assert layer_counts(LLAMA, 8, 1) == (8,)
    assert layer_counts(LLAMA, 8, 2) == (4, 4)
    assert layer_counts(LLAMA, 8, 8) == (1,) * 8
    counted = PipelineSpec(axis="pp", split="layers.{layer}", counts=(3, 5))
    assert layer_counts(counted, 8, 2) == (3, 5)
    zero = PipelineSpec(axis="pp", split="layers.{layer}", counts=(0, 8))
    assert layer_counts(zero, 8, 2) == (0, 8)  # an empty stage is plan()'s finding (SS093)


@pytest.mark.parametrize(
    ("spec", "n_layers", "n_stages", "message", "hint"),
    [
        (
            LLAMA,
            4,
            3,
            "4 layers do not split evenly over 3 stages of 'pp'",
            "`split layers.{layer} as 1, 1, 2`",
        ),
        (
            LLAMA,
            30,
            4,
            "30 layers do not split evenly over 4 stages",
            "`split layers.{layer} as 7, 7, 8, 8`",
        ),
        (LLAMA, 4, 8, "4 layers cannot fill 8 stages of 'pp'", "use at most 4 stages"),
        (LLAMA, 4, 0, "the pipeline axis 'pp' has size 0", ""),
        (
            PipelineSpec(axis="pp", split="layers.{layer}", counts=(1, 1, 2)),
            4,
            2,
            "the split gives 3 stage(s) layers (1, 1, 2), but 'pp' has 2 stage(s)",
            "drop `as ...` for an even split of 4",
        ),
        (
            PipelineSpec(axis="pp", split="layers.{layer}", counts=(1, 2)),
            4,
            2,
            "the split's counts add up to 3 layers, but the model has 4",
            "must add up",
        ),
    ],
)
def test_layer_counts_refuse(
    spec: PipelineSpec, n_layers: int, n_stages: int, message: str, hint: str
) -> None:
    with pytest.raises(StageError) as e:
        layer_counts(spec, n_layers, n_stages)
    assert STAGE_CODES[e.value.problem] == "SS094"
    assert message in str(e.value) and hint in e.value.hint


def test_the_suggested_counts_are_a_valid_split() -> None:
    """The uneven-split hint's counts fit: one per stage, adding up, longest last."""
    for n_layers in range(1, 40):
        for n_stages in range(1, n_layers + 1):
            if n_layers % n_stages == 0:
                continue
            with pytest.raises(StageError) as e:
                layer_counts(LLAMA, n_layers, n_stages)
            counts = [int(c) for c in e.value.hint.split(" as ")[1].rstrip("`").split(", ")]
            assert len(counts) == n_stages and sum(counts) == n_layers
            assert counts == sorted(counts) and counts[-1] - counts[0] == 1


# ----------------------------------------------------------------------------- plans


def test_plan_places_every_parameter() -> None:
    sp = plan(LLAMA, names(4), 2)
    assert sp.n_stages == 2 and sp.stage_layers == (("0", "1"), ("2", "3"))
    assert sp.params_of(0) == [
        "layers.0.attention.wqkv.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.1.attention.wqkv.weight",
        "layers.1.feed_forward.w2.weight",
        "tok_embeddings.weight",
    ]
    assert sp.params_of(1) == [
        "layers.2.attention.wqkv.weight",
        "layers.2.feed_forward.w2.weight",
        "layers.3.attention.wqkv.weight",
        "layers.3.feed_forward.w2.weight",
        "norm.weight",
        "output.weight",
    ]
    assert set(sp.stage) == set(names(4))
    four = plan(LLAMA, names(4), 4)
    assert four.stage_layers == (("0",), ("1",), ("2",), ("3",))
    assert four.stage["tok_embeddings.weight"] == 0 and four.stage["output.weight"] == 3
    one = plan(LLAMA, names(4), 1)
    assert set(one.stage.values()) == {0} and one.stage_layers == (("0", "1", "2", "3"),)


def test_plan_sorts_layers_by_number() -> None:
    sp = plan(LLAMA, names(12), 3)
    assert sp.stage_layers == (
        ("0", "1", "2", "3"),
        ("4", "5", "6", "7"),
        ("8", "9", "10", "11"),
    )
    assert sp.stage["layers.10.feed_forward.w2.weight"] == 2


def test_plan_with_counts_and_an_empty_layer_run() -> None:
    spec = PipelineSpec(
        axis="pp",
        first=("tok_embeddings",),
        last=("norm", "output"),
        split="layers.{l}",
        counts=(0, 3, 1),
    )
    sp = plan(spec, names(4), 3)
    assert sp.stage_layers == ((), ("0", "1", "2"), ("3",))
    assert sp.params_of(0) == ["tok_embeddings.weight"]


@pytest.mark.parametrize(
    ("spec", "params", "n_stages", "code", "message"),
    [
        (
            PipelineSpec(axis="pp", first=("tok_embeddings",), split="layers.{l}"),
            names(2),
            2,
            "SS091",
            "parameter 'norm.weight' is on no pipeline stage",
        ),
        (
            PipelineSpec(
                axis="pp",
                first=("tok_embeddings", "layers.0"),
                last=("norm", "output"),
                split="layers.{l}",
            ),
            names(2),
            2,
            "SS092",
            "parameter 'layers.0.attention.wqkv.weight' is placed by both first and split",
        ),
        (
            PipelineSpec(
                axis="pp",
                last=("tok_embeddings", "norm", "output"),
                split="layers.{l}",
                counts=(0, 2),
            ),
            names(2),
            2,
            "SS093",
            "stage 0 of 2 holds no parameter",
        ),
        (PipelineSpec(axis="pp", first=("**",)), names(2), 2, "SS093", "stage 1 of 2"),
        (LLAMA, names(4), 3, "SS094", "4 layers do not split evenly over 3 stages"),
        (
            PipelineSpec(axis="pp", split="blocks.{kind}"),
            ["blocks.attn.w", "blocks.mlp.w"],
            2,
            "SS095",
            "the split's capture is 'attn', not a layer number",
        ),
    ],
)
def test_plan_refuses(
    spec: PipelineSpec, params: list[str], n_stages: int, code: str, message: str
) -> None:
    with pytest.raises(StageError) as e:
        plan(spec, params, n_stages)
    assert STAGE_CODES[e.value.problem] == code and message in str(e.value)


def test_stage_of_names_outside_the_manifest() -> None:
    """Names the manifest lacks (modules built for another local size, new biases) are
    placed by their declaration; split names by their layer, if the plan has it."""
    sp = plan(LLAMA, names(4), 2)
    assert sp.stage_of("tok_embeddings.bias") == 0
    assert sp.stage_of("output.bias") == 1
    assert sp.stage_of("norm") == 1
    assert sp.stage_of("layers.1.attention.wqkv.bias") == 0
    assert sp.stage_of("layers.3.new_module.weight") == 1
    assert sp.stage_of("layers.4.attention.wqkv.weight") is None  # no such layer
    assert sp.stage_of("layers.03.attention.wqkv.weight") is None  # not layer '3'
    assert sp.stage_of("rope.freqs") is None  # nothing covers it
    both = PipelineSpec(
        axis="pp",
        first=("tok_embeddings", "extra"),
        last=("norm", "output", "extra"),
        split="layers.{l}",
    )
    assert plan(both, names(2), 2).stage_of("extra.weight") is None  # claimed twice


# ----------------------------------------------------------------------------- stage-local names


def test_global_names_are_kept_without_local() -> None:
    sp = plan(LLAMA, names(4), 2)
    for fqn in names(4):
        assert sp.local_name(fqn) == fqn
        assert sp.global_name(fqn, sp.stage[fqn]) == fqn
    # another stage's parameter is no parameter of this one
    assert sp.global_name("layers.3.feed_forward.w2.weight", 0) is None
    assert sp.global_name("tok_embeddings.weight", 1) is None
    assert sp.global_name("output.weight", 0) is None
    assert sp.global_name("rope.freqs", 0) is None
    # stages out of range hold nothing
    assert sp.global_name("tok_embeddings.weight", -1) is None
    assert sp.global_name("output.weight", 2) is None


def test_local_names_count_each_stages_layers_from_zero() -> None:
    sp = plan(LOCAL, names(6), 3)
    assert sp.stage_layers == (("0", "1"), ("2", "3"), ("4", "5"))
    assert sp.local_name("layers.0.feed_forward.w2.weight") == "layers.0.feed_forward.w2.weight"
    assert sp.local_name("layers.3.feed_forward.w2.weight") == "layers.1.feed_forward.w2.weight"
    assert sp.local_name("layers.4.attention.wqkv.weight") == "layers.0.attention.wqkv.weight"
    assert sp.local_name("tok_embeddings.weight") == "tok_embeddings.weight"
    assert sp.local_name("output.weight") == "output.weight"
    assert sp.local_name("layers.9.w") == "layers.9.w"  # on no stage: left alone
    assert sp.global_name("layers.0.attention.wqkv.weight", 0) == "layers.0.attention.wqkv.weight"
    assert sp.global_name("layers.0.attention.wqkv.weight", 1) == "layers.2.attention.wqkv.weight"
    assert sp.global_name("layers.1.attention.wqkv.weight", 2) == "layers.5.attention.wqkv.weight"
    assert sp.global_name("tok_embeddings.weight", 0) == "tok_embeddings.weight"
    assert sp.global_name("norm.weight", 2) == "norm.weight"
    for fqn in names(6):
        assert sp.global_name(sp.local_name(fqn), sp.stage[fqn]) == fqn


@pytest.mark.parametrize(
    ("name", "stage"),
    [
        ("layers.2.attention.wqkv.weight", 0),  # stage 0 holds 2 layers: local 0 and 1
        ("layers.2.attention.wqkv.weight", 1),
        ("layers.99.attention.wqkv.weight", 2),
        ("layers.01.attention.wqkv.weight", 1),  # leading zeros: not how locals are written
        ("layers.00.attention.wqkv.weight", 0),
        ("layers.x.attention.wqkv.weight", 0),
        ("layers.\u00b9.attention.wqkv.weight", 0),
        ("tok_embeddings.weight", 1),  # another stage's
        ("norm.weight", 0),
        ("rope.freqs", 0),  # nobody's
        ("layers.0.attention.wqkv.weight", 3),  # no such stage
        ("layers.0.attention.wqkv.weight", -1),
        ("tok_embeddings.weight", -3),
    ],
)
def test_global_name_refuses(name: str, stage: int) -> None:
    assert plan(LOCAL, names(6), 3).global_name(name, stage) is None


def test_local_names_of_zero_padded_layers_still_round_trip() -> None:
    """The plan maps zero-padded layers (the checks refuse them with `local`, SS095, as a
    local name cannot say which padding the global one had)."""
    params = [f"layers.{i:02d}.w" for i in range(4)]
    sp = plan(PipelineSpec(axis="pp", split="layers.{l}", local_names=True), params, 2)
    assert sp.stage_layers == (("00", "01"), ("02", "03"))
    assert [sp.local_name(f) for f in params] == [f"layers.{i}.w" for i in (0, 1, 0, 1)]
    assert all(sp.global_name(sp.local_name(f), sp.stage[f]) == f for f in params)


# ----------------------------------------------------------------------------- properties


def ones_then_rest(n_layers: int, n_stages: int) -> tuple[int, ...]:
    """Counts with every stage holding a layer: ones, the rest on the last stage."""
    return (1,) * (n_stages - 1) + (n_layers - n_stages + 1,)


@st.composite
def models(draw: st.DrawFn) -> tuple[PipelineSpec, list[str], int, tuple[int, ...]]:
    """A random model and pipeline: layer numbers (not necessarily 0..L-1), a few parameters
    per layer, embeddings first and a head last, a stage count, even or explicit counts."""
    numbers = sorted(draw(st.sets(st.integers(0, 200), min_size=1, max_size=40)))
    n_layers = len(numbers)
    n_stages = draw(st.integers(1, n_layers))
    explicit = draw(st.booleans())
    if explicit:
        # a random composition of n_layers into n_stages parts; the middle ones positive,
        # the first and last may be 0 (the embeddings and the head fill those stages)
        cuts = sorted(
            draw(st.lists(st.integers(0, n_layers), min_size=n_stages - 1, max_size=n_stages - 1))
        )
        counts = tuple(b - a for a, b in zip([0, *cuts], [*cuts, n_layers], strict=True))
        if any(c == 0 for c in counts[1:-1]):
            counts = ones_then_rest(n_layers, n_stages)
    elif n_layers % n_stages:
        n_stages = draw(st.sampled_from([d for d in range(1, n_layers + 1) if n_layers % d == 0]))
        counts = ()
    else:
        counts = ()
    kinds = draw(
        st.lists(
            st.sampled_from(["attn.wq", "attn.wo", "mlp.w1", "norm"]),
            min_size=1,
            max_size=3,
            unique=True,
        )
    )
    params = ["embed.weight", "head.weight", "final_norm.weight"]
    params += [f"blocks.{n}.{k}.weight" for n in numbers for k in kinds]
    random.Random(draw(st.integers(0, 2**16))).shuffle(params)
    spec = PipelineSpec(
        axis="pp",
        first=("embed",),
        last=("final_norm", "head"),
        split="blocks.{layer}",
        counts=counts,
        local_names=draw(st.booleans()),
    )
    want = counts or (n_layers // n_stages,) * n_stages
    return spec, params, n_stages, want


@settings(max_examples=300, deadline=None)
@given(models())
def test_every_layer_lands_on_one_stage_in_consecutive_runs(model) -> None:
    spec, params, n_stages, want = model
    sp = plan(spec, params, n_stages)
    # every parameter on exactly one stage, within range
    assert set(sp.stage) == set(params)
    assert all(0 <= s < n_stages for s in sp.stage.values())
    assert sorted(f for s in range(n_stages) for f in sp.params_of(s)) == sorted(params)
    # the layers, in numeric order, cut into consecutive runs of the expected lengths
    order = sorted({layer_of(spec, f) for f in params} - {None}, key=int)
    assert [v for run in sp.stage_layers for v in run] == order
    assert tuple(len(run) for run in sp.stage_layers) == want
    stage_of_layer = {v: s for s, run in enumerate(sp.stage_layers) for v in run}
    assert [stage_of_layer[v] for v in order] == sorted(stage_of_layer[v] for v in order)
    # a layer's parameters share its stage; first and last stages hold the rest
    for f in params:
        v = layer_of(spec, f)
        if v is not None:
            assert sp.stage[f] == stage_of_layer[v]
        elif f.startswith("embed"):
            assert sp.stage[f] == 0
        else:
            assert sp.stage[f] == n_stages - 1
    assert all(sp.params_of(s) for s in range(n_stages))


@settings(max_examples=300, deadline=None)
@given(models())
def test_local_and_global_names_round_trip(model) -> None:
    spec, params, n_stages, _ = model
    sp = plan(spec, params, n_stages)
    local_names: dict[int, set[str]] = {}
    for f in params:
        s = sp.stage_of(f)
        assert s == sp.stage[f]
        local = sp.local_name(f)
        assert sp.global_name(local, s) == f
        assert local not in local_names.setdefault(s, set())  # distinct within a stage
        local_names[s].add(local)
        for other in range(n_stages):
            if other != s:
                assert sp.global_name(local, other) != f
        if not spec.local_names:
            assert local == f
        elif layer_of(spec, f) is not None:
            number = layer_of(spec, local)  # counted from 0 on each stage
            assert number is not None and int(number) < len(sp.stage_layers[s])


# ----------------------------------------------------------------------------- ties

TIED = PipelineSpec(
    axis="pp",
    first=("tok_embeddings",),
    last=("norm", "output"),
    split="layers.{layer}",
    local_names=True,
    ties=(("output.weight", "tok_embeddings.weight"),),
)
SRC, ALIAS = "tok_embeddings.weight", "output.weight"


def tied_names(n_layers: int) -> list[str]:
    """A tied model's names: the head's weight is the embedding's, listed once."""
    return [n for n in names(n_layers) if n != ALIAS]


def test_a_tied_weight_lives_on_its_source_stage_and_its_alias_stage() -> None:
    sp = plan(TIED, tied_names(4), 2)
    assert sp.stage[SRC] == 0 and ALIAS not in sp.stage
    assert sp.tie_stage == {ALIAS: 1} and sp.tie_source == {ALIAS: SRC}
    assert sp.stages_of(SRC) == (0, 1) and sp.stages_of("norm.weight") == (1,)
    assert sp.stage_of(ALIAS) == 1  # the alias's own stage
    assert SRC in sp.params_of(0) and SRC in sp.params_of(1)
    # names: the source on its stage, the alias on the alias's
    assert sp.local_name(SRC, 0) == SRC and sp.local_name(SRC, 1) == ALIAS
    assert sp.alias_on(SRC, 1) == ALIAS and sp.alias_on(SRC, 0) is None
    assert sp.global_name(ALIAS, 1) == SRC
    assert sp.global_name(ALIAS, 1, ties=False) == ALIAS  # the name its rule goes by
    assert sp.global_name(SRC, 1) is None  # stage 1 holds it as the alias only
    assert sp.global_name(ALIAS, 0) is None  # another stage's
    # local layer names still work beside the tie
    assert sp.global_name("layers.0.attention.wo.weight", 1) == "layers.2.attention.wo.weight"


def test_at_one_stage_the_model_ties_the_weight_itself() -> None:
    sp = plan(TIED, tied_names(4), 1)
    assert sp.stages_of(SRC) == (0,) and sp.tie_stage == {ALIAS: 0}
    assert sp.local_name(SRC, 0) == SRC and sp.alias_on(SRC, 0) is None
    assert sp.global_name(SRC, 0) == SRC
    assert sp.global_name(ALIAS, 0) is None  # a separate tensor there would be untied


def test_at_four_stages_the_tie_joins_the_first_and_the_last() -> None:
    sp = plan(TIED, tied_names(4), 4)
    assert sp.stages_of(SRC) == (0, 3)
    assert [SRC in sp.params_of(s) for s in range(4)] == [True, False, False, True]


def test_a_stage_holding_only_a_tie_is_not_empty() -> None:
    spec = PipelineSpec(
        axis="pp",
        first=("tok_embeddings",),
        last=("output",),
        split="layers.{layer}",
        counts=(0, 1, 0),
        ties=(("output.weight", SRC),),
    )
    sp = plan(spec, [SRC, "layers.0.w"], 3)
    assert sp.stages_of(SRC) == (0, 2) and sp.params_of(2) == [SRC]


def test_a_manifest_that_lists_the_alias_tied_to_its_source() -> None:
    """``shardspec manifest`` lists a tied weight under both names, the alias with
    ``tied_to`` its first name: the plan is the tie's, as if the alias were not listed."""
    listed = [*tied_names(4), ALIAS]
    for n_stages in (1, 2, 4):
        sp = plan(TIED, listed, n_stages, tied_to={ALIAS: SRC})
        assert sp == plan(TIED, tied_names(4), n_stages)
    assert tie_problems(TIED, listed, {ALIAS: SRC}) == []


@pytest.mark.parametrize(
    ("tied_to", "message", "hint"),
    [
        ({}, "'output.weight' is a parameter of its own", "tie the weights in the model"),
        (
            {ALIAS: "norm.weight"},
            "alias 'output.weight' is tied to 'norm.weight' in the manifest, not to "
            "'tok_embeddings.weight'",
            "`tie output.weight = norm.weight`",
        ),
        (
            {SRC: ALIAS},
            "the manifest ties 'tok_embeddings.weight' to 'output.weight'",
            "`tie tok_embeddings.weight = output.weight`",
        ),
    ],
)
def test_a_listed_alias_the_manifest_does_not_tie_to_the_source(
    tied_to: dict, message: str, hint: str
) -> None:
    with pytest.raises(StageError) as e:
        plan(TIED, [*tied_names(4), ALIAS], 2, tied_to=tied_to)
    assert STAGE_CODES[e.value.problem] == "SS097"
    assert message in str(e.value) and hint in e.value.hint


@pytest.mark.parametrize(
    ("ties", "model", "message"),
    [
        ((("output.weight", "embed.weight"),), "tied", "source 'embed.weight' is not a parameter"),
        ((("output.weight", SRC),), "untied", "'output.weight' is a parameter of its own"),
        ((("layers.1.x", SRC),), "tied", "alias 'layers.1.x' is in the split family"),
        ((("head.weight", SRC),), "tied", "alias 'head.weight' is on no pipeline stage"),
        ((("output.weight", "layers.0.attention.wo.weight"),), "tied", "source"),
    ],
)
def test_ties_that_do_not_fit_the_manifest(ties: tuple, model: str, message: str) -> None:
    spec = PipelineSpec(
        axis="pp",
        first=("tok_embeddings",),
        last=("norm", "output"),
        split="layers.{layer}",
        ties=ties,
    )
    given_names = tied_names(4) if model == "tied" else names(4)
    with pytest.raises(StageError) as e:
        plan(spec, given_names, 2)
    assert STAGE_CODES[e.value.problem] == "SS097" and message in str(e.value)
    assert e.value.hint


def test_every_stage_problem_has_a_check_code() -> None:
    """The compiler reports each problem the stage arithmetic names under a code of the
    registry; the core itself carries no codes."""
    import inspect
    import re

    from shardspec.core import stages as stages_module
    from shardspec.core.stages import StageProblem
    from shardspec.findings.codes import BY_CODE

    assert set(STAGE_CODES) == set(StageProblem)
    assert all(code in BY_CODE for code in STAGE_CODES.values())
    assert not re.search(r"SS\d{3}", inspect.getsource(stages_module))
