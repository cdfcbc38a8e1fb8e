"""The one registry of finding codes.

Each entry is documentation as much as code: ``docs/checks.md`` is generated from it
(``python -m shardspec.findings.catalogue``) and a test keeps the two in step. Codes never
change meaning; retired codes (``RETIRED``) are not reused.
"""

from __future__ import annotations

from dataclasses import dataclass

from shardspec.findings.diagnostics import Diagnostic, Severity, Span


@dataclass(frozen=True)
class Check:
    """One finding code: what it means, why it matters, and a bad and a good example."""

    code: str
    name: str
    severity: Severity
    summary: str
    why: str
    bad: str = ""
    good: str = ""
    needs_manifest: bool = False


E, W = Severity.ERROR, Severity.WARNING

CHECKS: tuple[Check, ...] = (
    # --- input ---------------------------------------------------------------------------
    Check(
        "SS001",
        "syntax-error",
        E,
        "The spec does not parse.",
        "A spec that does not parse cannot be checked or compiled. The finding names the "
        "tokens that were expected, and a hint for the usual mistakes.",
        "mesh over 8 ranks { dp_shard: *  tp 2 }",
        "mesh over 8 ranks { dp_shard: *  tp: 2 }",
    ),
    Check(
        "SS002",
        "unreadable-input",
        E,
        "A spec, manifest, HF manifest or output path cannot be read or written.",
        "Nothing can be checked without the input. The manifest path is relative to the "
        "spec's folder.",
        'manifest "llama.json"   # no such file next to the spec',
        'manifest "llama.manifest.json"',
    ),
    Check(
        "SS003",
        "bad-manifest",
        E,
        "The manifest (or the HF manifest, or for `shardspec hf-manifest` a Hugging Face "
        "directory's config.json, index or safetensors header) is not valid.",
        "Checks that need shapes would otherwise run on wrong data.",
        '{"format": "shardspec-manifest/9", "entries": []}',
        '{"format": "shardspec-manifest/2", "entries": []}',
    ),
    Check(
        "SS004",
        "bad-argument",
        E,
        "A command-line argument is malformed or unknown.",
        "`-D tpp=4` must not silently do nothing.",
        "shardspec lint -D tpp=4 specs/llama.shard",
        "shardspec lint -D tp=4 specs/llama.shard",
    ),
    Check(
        "SS005",
        "duplicate-statement",
        E,
        "A statement that may appear once (mesh, fsdp, manifest) appears twice.",
        "Two meshes or two FSDP axes leave it unclear which one holds.",
        "fsdp dp_shard\nfsdp dp_replicate",
        "fsdp dp_shard",
    ),
    Check(
        "SS006",
        "number-too-large",
        E,
        "A whole number in the spec (a mesh or world size, a group, head or part size, a "
        "split count, a `rope` head size, a number in a `config` product), in `-D` or in "
        "`shardspec manifest --arg` is larger than 2**63 - 1.",
        "No tensor dimension or count can be that large, and numbers of over 4,300 digits "
        "cannot even be read: the number is a typo, or not meant as one.",
        "mesh over 18446744073709551616 ranks { dp_shard: * }",
        "mesh over 64 ranks { dp_shard: * }",
    ),
    Check(
        "SS007",
        "token-too-long",
        E,
        "A name, pattern, quoted path or number in the spec is longer than 4096 characters.",
        "Real names are tens of characters. A token of megabytes is a mistake (a file pasted "
        "into a spec), and every check that read it would pay for its length; the finding "
        "quotes only its start and end.",
        "param layers.0.aaaa...(5,000 more letters).weight [a] {}",
        "param layers.0.attention.wq.weight [a] {}",
    ),
    # --- mesh ----------------------------------------------------------------------------
    Check(
        "SS010",
        "bad-mesh",
        E,
        "The mesh is missing, has no axes, repeats an axis, has an axis of size 0, has "
        "several `*` axes, or does not fit the world size.",
        "Every placement and every rank's offset depends on the mesh.",
        "mesh { dp_shard: *  tp: * }",
        "mesh over 8 ranks { dp_shard: *  tp: 2 }",
    ),
    Check(
        "SS011",
        "unknown-axis",
        E,
        "A rule or statement names an axis the mesh lacks.",
        "A typo in an axis name would otherwise replicate the tensor silently.",
        "shard vocab over tpp",
        "shard vocab over tp",
    ),
    Check(
        "SS012",
        "axis-reused",
        E,
        "One axis shards two dimensions, or one dimension twice; or one dimension has two "
        "`shard` statements; or an axis is both sharding and replicated.",
        "DTensor cannot place one mesh axis on two tensor dims; the layout would be ambiguous.",
        "shard vocab over tp\nshard hidden over tp",
        "shard vocab over tp",
    ),
    Check(
        "SS013",
        "manifest-mesh-mismatch",
        E,
        "A local axis's size differs from the size the manifest's model was built for.",
        "Modules built with local shapes for tp=2 hold the wrong slices under tp=4.",
        "mesh over 8 ranks { dp_shard: *  ep: 4 }   # manifest built with ep=2\n"
        "param local_experts.{e}.w1 [e, ffn, hidden] {\n    local ep\n    shard e over ep\n}",
        "mesh over 8 ranks { dp_shard: *  ep: 2 }",
        True,
    ),
    # --- dimensions ----------------------------------------------------------------------
    Check(
        "SS020",
        "unknown-dim",
        E,
        "A statement names a dimension the rule does not declare.",
        "Placements are written against dimension names; an unknown one has no meaning.",
        "param w [out, in] { shard outt over tp }",
        "param w [out, in] { shard out over tp }",
    ),
    Check(
        "SS021",
        "dims-rank-mismatch",
        E,
        "The number of named dimensions differs from the parameter's rank, or a rule that "
        "is not `replicate` names no dimensions.",
        "Reusing a 2-D layout on a 3-D grouped tensor (TransformerEngine's GroupedLinear "
        "stores [num_gemms, out, in]) puts every shard dimension off by one.",
        "param experts.fc1.weight [out, in] { shard out over tp }   # shape [8, 256, 64]",
        "param experts.fc1.weight [gemm, out, in] { shard out over tp }",
        True,
    ),
    Check(
        "SS022",
        "duplicate-dim",
        E,
        "A rule names the same dimension twice.",
        "Placements could not tell the two apart.",
        "param w [hidden, hidden] {}",
        "param w [out, hidden] {}",
    ),
    Check(
        "SS023",
        "uneven-shard",
        W,
        "A dimension is not divisible by the product of its axes; torch.chunk sizes apply.",
        "Uneven shards work with DTensor, but cost padding in collectives and surprise "
        "people reading per-rank shapes.",
        "param w [vocab, hidden] { shard vocab over tp }   # vocab 32001, tp 2",
        "param w [vocab, hidden] { shard vocab over tp }   # vocab padded to 32002",
        True,
    ),
    Check(
        "SS024",
        "empty-shard",
        W,
        "Some ranks hold an empty local shard of a parameter; the finding names them.",
        "Empty shards are legal but easy to mishandle: code that treats an empty local "
        "shard as missing may materialize the full parameter on that rank to fill it.",
        "param norm.weight [dim] {}   # dim 4, FSDP over dp_shard=8: ranks 4-7 get nothing",
        "param norm.weight [dim] replicate",
        True,
    ),
    Check(
        "SS026",
        "local-axis-not-outer",
        E,
        "A local axis comes after a non-local axis on the same dimension, or shards no "
        "dimension of the rule.",
        "A module built with a local shard holds a whole block of the local axis; "
        "other axes can only split that block further.",
        "shard ffn over (dp_shard, tp)\nlocal tp",
        "shard ffn over (tp, dp_shard)\nlocal tp",
    ),
    Check(
        "SS027",
        "name-indexed-dim",
        E,
        "A dimension indexed by a name capture is misused: it must be sharded over local "
        "axes only and cannot be fused, and captures must be declared dimensions.",
        "Per-expert modules (`local_experts.{expert}`) exist only on the ranks that own "
        "them; only a local axis says which rank that is.",
        "param local_experts.{expert}.w1.weight [expert, ffn, hidden] { shard expert over ep }",
        "param local_experts.{expert}.w1.weight [expert, ffn, hidden] {\n"
        "    local ep\n    shard expert over ep\n}",
    ),
    Check(
        "SS028",
        "bad-checkpoint-placement",
        E,
        "A checkpoint placement uses an axis the parameter is already sharded over (or a "
        "local one), shards a name-indexed dimension, or contradicts `checkpoint replicate`.",
        "A checkpoint split cuts a rank's stored chunk further over axes on which the "
        "parameter is replicated at run time, so that its replicas write different parts; "
        "over any other axis there is nothing to split, and the stored chunks would not tile "
        "the tensor.",
        "param embed.weight [vocab, hidden] {   # fsdp dp_shard shards vocab\n"
        "    checkpoint shard vocab over dp_shard\n}",
        "param embed.weight [vocab, hidden] {\n    shard vocab over dp_shard\n"
        "    checkpoint shard hidden over tp   # replicated over tp at run time\n}",
    ),
    # --- layout --------------------------------------------------------------------------
    Check(
        "SS029",
        "bad-tp-style",
        E,
        "A `style` line names an unknown style or activation layout, is the rule's second "
        "one, gives layouts to a style that takes none, or does not fit the rule's "
        "placements (colwise and rowwise need one dimension sharded over a model-parallel "
        "axis; sequence_parallel needs none).",
        "`parallelize` applies the stated style with torch's ParallelStyles; one that does "
        "not fit the placements would give the parameters another layout than the spec's, or "
        "run the forward on the wrong shards.",
        "param norm.weight [hidden] {\n    shard hidden over tp\n    style sequence_parallel\n}",
        "param norm.weight [hidden] {\n    style sequence_parallel\n}",
    ),
    Check(
        "SS030",
        "non-contiguous-shard",
        E,
        "Some rank's local shard of a stored tensor is not one contiguous block.",
        "DCP stores each rank's chunk as one box; a strided shard fails with "
        "'overlapping chunks' or stores wrong bytes. Fused dimensions split per component "
        "are fine when stored per component (the default), not with `stored fused`.",
        "fuse ffn as gate, up stored fused\nshard ffn over tp",
        "fuse ffn as gate, up\nshard ffn over tp",
        True,
    ),
    Check(
        "SS031",
        "not-representable",
        E,
        "No DTensor placements describe the layout on every rank, or torch's own "
        "full_tensor (redistribute) cannot gather the placements that do.",
        "distribute() could not build a DTensor whose full_tensor() is the parameter "
        "(for example FSDP on a dimension that TP already splits per component, or "
        "q/k/v of different sizes split per component over tp). torch 2.13 also cannot "
        "gather a tensor split per component over one axis while another dimension is cut "
        "against mesh order (experts over ep then dp_shard with the mesh listing dp_shard "
        "first): its full_tensor fails.",
        "fuse ffn as gate, up\nshard ffn over (tp, dp_shard)",
        "fuse ffn as gate, up\nshard ffn over tp\nshard hidden over dp_shard",
        True,
    ),
    # --- rules ---------------------------------------------------------------------------
    Check(
        "SS032",
        "tp-style-contradiction",
        E,
        "A stated `style` contradicts the style the placements give the module: a Linear "
        "whose out dimension is sharded is colwise, in dimension rowwise; an Embedding "
        "sharded on the vocabulary is rowwise, on its features colwise. Or a Linear's bias "
        "is not cut as its weight's out dimension over the model-parallel axes.",
        "A contradicting style would cut the weight on another dimension than the spec "
        "says, so the layout, the checkpoint and the forward would disagree.",
        "param output.weight [vocab, hidden] {   # an nn.Linear\n    shard vocab over tp\n"
        "    style rowwise\n}",
        "param output.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    style colwise output replicate\n}",
        needs_manifest=True,
    ),
    Check(
        "SS033",
        "no-tp-style",
        W,
        "A parameter sharded over a model-parallel axis belongs to a module that is neither "
        "a Linear, an Embedding nor transformers' Conv1D, so no tensor-parallel style derives "
        "from its placements.",
        "`parallelize` refuses such a module (give it a style with its `styles` option); "
        "a trainer that parallelizes itself can still check the result with `verify`.",
        "param layers.*.moe.experts.w1 [expert, ffn, hidden] {   # an Experts module\n"
        "    shard expert over ep\n}",
        "param layers.*.moe.experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n"
        "    style none   # parameters placed as declared; the module's forward handles ep\n}",
        needs_manifest=True,
    ),
    # --- heads (layout) ----------------------------------------------------------------
    Check(
        "SS034",
        "split-head",
        E,
        "A shard boundary over a model-parallel axis falls inside a head of a dimension "
        "(or fused component) with `heads`; the finding names the axis, the ranks and the "
        "index, and the hint the axis sizes that keep heads whole.",
        "Attention computes per head: a tensor-parallel rank holding half a head computes "
        "garbage without an error (Mistral's 2 KV heads at tp=4). Uneven shards are fine as "
        "long as every boundary falls between heads. The FSDP axis is not checked: FSDP2 "
        "gathers the dimension before the forward.",
        "param wk.weight [kv, hidden] {   # 2 KV heads of 128, tp=4\n    heads kv 128\n"
        "    shard kv over tp\n}",
        "param wk.weight [kv, hidden] {   # tp=2: one head per rank\n    heads kv 128\n"
        "    shard kv over tp\n}",
        True,
    ),
    Check(
        "SS035",
        "bad-heads",
        E,
        "A `heads` size is 0, is given twice for one dimension or component, names no "
        "whole-number factory argument of the manifest or config.json key of the HF "
        "manifest, or does not divide the dimension (or each component) it applies to.",
        "A head size that does not fit the tensor cannot be checked against the shards, and "
        "usually means the number of heads was written where one head's size belongs.",
        "param wk.weight [kv, hidden] {   # kv 256\n    heads kv 3\n    shard kv over tp\n}",
        "param wk.weight [kv, hidden] {\n    heads kv head_dim   # config.json: 128\n"
        "    shard kv over tp\n}",
        True,
    ),
    # --- tensor parallelism across modules ------------------------------------------------
    Check(
        "SS036",
        "unpaired-tp-cut",
        E,
        "Within a block (the smallest module holding two or more Linear or Embedding modules: "
        "an attention, an MLP), a module cuts its output on the features over a "
        "model-parallel axis (colwise) and none reads features cut that way (rowwise), or "
        "the converse: `qkv_proj` replicated over tp while `o_proj` is sharded over it.",
        "torch's styles hand a colwise module's output on as each rank's local columns, and "
        "a rowwise module reads its input as such columns. A replicated module fed local "
        "columns, or a rowwise one fed whole activations, fails on shapes in the forward, or "
        "computes garbage where the shapes happen to fit. A block is right when its modules "
        "are all replicated over the axis, or colwise ones feed rowwise ones. The check is "
        "per block, by module kind and placements: modules that hold local shards, run their "
        "own forward (`style none`) or are neither Linear nor Embedding exempt their block.",
        "param layers.*.self_attn.{q,k,v}_proj.weight [out, hidden] {}\n"
        "param layers.*.self_attn.o_proj.weight [hidden, heads] {\n"
        "    shard heads over tp   # reads columns nobody cut\n}",
        "param layers.*.self_attn.{q,k,v}_proj.weight [out, hidden] {\n"
        "    shard out over tp\n}\n"
        "param layers.*.self_attn.o_proj.weight [hidden, heads] {\n    shard heads over tp\n}",
        needs_manifest=True,
    ),
    Check(
        "SS037",
        "tied-parameter-sharded",
        W,
        "A parameter that is one tensor under two names (a tied embedding and head: the "
        "manifest's `tied_to`) is sharded over a model-parallel axis of size > 1.",
        "The embedding cuts the tied weight one way (rowwise over the vocabulary) and the head "
        "another (colwise); torch's styles give each module a DTensor of its own, which "
        "parts the tie, so `parallelize` refuses the model. `distribute`, `load_hf` and "
        "`export_hf` keep the tie and work (a spec for checkpoint conversion may suppress "
        "the finding). Across pipeline stages the two uses are two tensors, which TP cuts "
        "separately.",
        "param embed_tokens.weight [vocab, hidden] {   # lm_head.weight is tied to it\n"
        "    shard vocab over tp\n}",
        "param embed_tokens.weight [vocab, hidden] {\n    replicate tp\n}",
        needs_manifest=True,
    ),
    Check(
        "SS038",
        "custom-module-style",
        E,
        "A module gets torch's colwise or rowwise style (derived or stated) but its class "
        "runs a forward of its own, not torch's `nn.Linear` or `nn.Embedding` forward (the "
        "manifest's `class` and `forward`).",
        "torch's ColwiseParallel and RowwiseParallel cut the weight and redistribute the "
        "activations around torch's own Linear and Embedding forward. A subclass with its "
        "own forward (torchtitan's vocab-parallel Embedding, which does its own lookup) "
        "passes lint, `parallelize` and `verify` and fails in the first forward (`got mixed "
        "torch.Tensor and DTensor`), or computes garbage. Subclasses that inherit torch's "
        "forward are fine.",
        "param tok_embeddings.weight [vocab, hidden] {   # a VocabParallelEmbedding\n"
        "    shard vocab over tp\n}",
        "param tok_embeddings.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    style none   # its forward does the vocab-parallel lookup\n}",
        needs_manifest=True,
    ),
    Check(
        "SS040",
        "unmatched-parameter",
        E,
        "A parameter is matched by no rule or ignore, or an extra state by no ignore.",
        "Unmatched parameters would be silently replicated or skipped.",
        "param **.weight [out, in] {}   # the model also has attn.fp8._extra_state",
        "param **.weight [out, in] {}\nignore **._extra_state",
        True,
    ),
    Check(
        "SS041",
        "unused-rule",
        E,
        "A rule matches no parameter (or only ignored ones), or an ignore matches no "
        "entry of the manifest.",
        "Usually a typo (the hint names the closest parameters), a rule for modules that do "
        "not exist (bias rules when the model is built with bias=False), or a rule for a "
        "name that only state_dict() has: a key a state-dict hook writes in place of a "
        "parameter (torchtitan's fused wqkv shown as wq/wk/wv), or a buffer of a pipeline "
        "stage (saved as it is). Rules match parameters as the model holds them, and "
        "persistent buffers (SS087); the hint names the hook's module and the parameter to "
        "write the rule for.",
        "param layers.*.attention.wq.weight [out, in] {}   # wq: a state-dict hook's key",
        "param layers.*.attention.qkv_linear.wqkv.weight [out, in] {}   # the parameter",
        True,
    ),
    Check(
        "SS042",
        "shadowed-rule",
        W,
        "A rule matches parameters but never wins any.",
        "Another rule always takes precedence, so this one is dead and misleads readers.",
        "param layers.* [out, in] {}\nparam layers.wq [out, in] {}   # the only layers.* param",
        "param layers.wq [out, in] {}",
        True,
    ),
    Check(
        "SS043",
        "ambiguous-rules",
        E,
        "Two rules of equal precedence match the same parameter.",
        "File order never decides; the spec must say which rule wins.",
        "param layers.10.* [a, b] {}\nparam layers.*.w2 [a, b] {}   # both match layers.10.w2",
        "param layers.10.w2 [a, b] {}\nparam layers.*.w2 [a, b] {}",
        True,
    ),
    Check(
        "SS044",
        "bad-pattern",
        E,
        "A parameter pattern is malformed.",
        "A pattern that cannot match anything hides a mistake.",
        "param a..b [x] replicate",
        "param a.*.b [x] replicate",
    ),
    # --- fusion --------------------------------------------------------------------------
    Check(
        "SS050",
        "fusion-size-mismatch",
        E,
        "A fused dimension's components do not add up to its size.",
        "Each rank would take wrong slices of every component.",
        "fuse qkv as q 64, k 16, v 16   # qkv is 128",
        "fuse qkv as q 96, k 16, v 16",
        True,
    ),
    Check(
        "SS051",
        "fusion-indivisible",
        E,
        "A fused component (or the group count) is not divisible by its first axis.",
        "The requirement is F % TP per component, not 2F % TP for the fused tensor: "
        "ffn = 2 x 3 over tp = 2 cannot give each rank half of gate and half of up.",
        "fuse ffn as gate, up\nshard ffn over tp   # ffn = 2 x 3, tp = 2",
        "fuse ffn as gate, up\nshard ffn over tp   # ffn = 2 x 4, tp = 2",
        True,
    ),
    Check(
        "SS052",
        "bad-fusion",
        E,
        "A fusion is malformed: a dimension fused twice, two fused dimensions in one rule, "
        "components named twice, fewer than two components, a group count below 1, or "
        "sizes given for some components only.",
        "Component layouts must be unambiguous.",
        "fuse ffn as gate 8, up",
        "fuse ffn as gate 8, up 8",
    ),
    # --- hygiene -------------------------------------------------------------------------
    Check(
        "SS060",
        "unused-suppression",
        W,
        "A `# shardspec: ignore[...]` comment silences nothing, or names an unknown code.",
        "Stale suppressions hide the next real finding.",
        "param norm.weight [dim] {}   # shardspec: ignore[SS023]   (dim divides evenly)",
        "param norm.weight [dim] {}",
    ),
    Check(
        "SS061",
        "no-manifest",
        W,
        "The spec names no manifest: checks that need shapes did not run.",
        "Without shapes, divisibility and coverage are only checked at run time.",
        "mesh over 8 ranks { dp_shard: *  tp: 2 }   # and no manifest statement",
        'manifest "llama.manifest.json"\nmesh over 8 ranks { dp_shard: *  tp: 2 }',
    ),
    # --- Hugging Face mapping (hf block) -------------------------------------------------
    Check(
        "SS070",
        "bad-hf-item",
        E,
        "An hf block item is malformed: a map line with glob syntax (`*`, `**`, `{a,b}`), "
        "captures that are not on both sides, a stack index that is no capture of the Hugging "
        "Face name, an odd `rope` size, a bad drop/keep glob, a tie that is not two literal "
        "keys (or ties an alias twice, to itself or to another alias), a config name bound "
        "twice, or a component named twice in a split line's `as` list.",
        "The mapping must invert: load names the Hugging Face key of every storage unit, and "
        "export names the storage unit of every key, from the same line.",
        "model.layers.*.mlp.up_proj.weight -> layers.{i}.feed_forward.w13.weight.up",
        "model.layers.{i}.mlp.up_proj.weight -> layers.{i}.feed_forward.w13.weight.up",
    ),
    Check(
        "SS071",
        "hf-unit-not-produced",
        E,
        "A storage unit of the model (a parameter, a fused component, an expert) is produced "
        "by no hf map line and matched by no `keep`.",
        "load_hf would leave it uninitialised, and export_hf would write a checkpoint without it.",
        "hf { model.layers.{i}.mlp.gate_proj.weight -> layers.{i}.feed_forward.w13.weight.gate }"
        "\n# and nothing produces layers.{i}.feed_forward.w13.weight.up",
        "hf {\n    model.layers.{i}.mlp.gate_proj.weight -> layers.{i}.feed_forward.w13.weight.gate"
        "\n    model.layers.{i}.mlp.up_proj.weight -> layers.{i}.feed_forward.w13.weight.up\n}",
        True,
    ),
    Check(
        "SS072",
        "hf-unit-produced-twice",
        E,
        "A storage unit is produced by two hf map lines.",
        "Load would read one of two tensors and export would write the unit twice, under "
        "two names.",
        "model.norm.weight -> norm.weight\nmodel.final_norm.weight -> norm.weight",
        "model.norm.weight -> norm.weight",
        True,
    ),
    Check(
        "SS073",
        "hf-unexpected-key",
        E,
        "A tensor of the HF manifest is consumed by no map line (for a real storage unit, "
        "with a stack index inside its first dimension), not dropped and not a tie alias.",
        "A key nothing reads is usually a mapping typo, or a model that lost a module; "
        "ignoring it silently would load a partial model.",
        "# the checkpoint has model.layers.0.self_attn.q_norm.weight, the block no q_norm line",
        "model.layers.{i}.self_attn.q_norm.weight -> layers.{i}.attn.q_norm.weight",
        True,
    ),
    Check(
        "SS074",
        "hf-missing-key",
        E,
        "A storage unit needs a Hugging Face key that the HF manifest lacks (and no `tie` "
        "source of it is there).",
        "load_hf would fail on the real checkpoint; lint says so before the job starts.",
        "model.layers.{i}.mlp.gate.weight -> layers.{i}.moe.router.weight"
        "   # the key is ...mlp.router.weight",
        "model.layers.{i}.mlp.router.weight -> layers.{i}.moe.router.weight",
        True,
    ),
    Check(
        "SS075",
        "hf-shape-mismatch",
        E,
        "A Hugging Face tensor's shape differs from the shape its map line expects (the "
        "unit's shape inverted through the transforms, per stack index).",
        "Reading it would fail at load time, or worse, reinterpret the bytes.",
        "model.layers.{i}.mlp.gate.weight -> layers.{i}.moe.router.weight   # HF [64, 8]",
        "model.layers.{i}.mlp.gate.weight -> layers.{i}.moe.router.weight transpose",
        True,
    ),
    Check(
        "SS076",
        "hf-transform-invalid",
        E,
        "A transform cannot apply to the storage unit's shape: `transpose` on a tensor that "
        "is not 2-D, or `rope N` on a first dimension that is not a whole number of heads.",
        "A transform that does not fit the tensor cannot be inverted on export.",
        "model.norm.weight -> norm.weight transpose   # norm.weight is 1-D",
        "model.norm.weight -> norm.weight",
        True,
    ),
    Check(
        "SS077",
        "hf-config-mismatch",
        E,
        "A `config` binding names no dimension or component of any rule, uses a key "
        "config.json lacks (or that is not a whole number), or disagrees with the model's "
        "size of that dimension.",
        "A checkpoint of another model size would otherwise be found only at load time, "
        "or exported with a config.json that describes another model.",
        "config hidden = intermediate_size",
        "config hidden = hidden_size",
        True,
    ),
    Check(
        "SS078",
        "unused-hf-item",
        W,
        "An hf map line produces no storage unit, a `keep` matches none, or (with an HF "
        "manifest) a `drop` matches no Hugging Face key.",
        "Usually a typo in the target name (units are named like checkpoints name them: "
        "`<fqn>`, `<fqn>.<component>`, global expert indices).",
        "model.norm.weight -> final_norm.weight   # the model's is norm.weight",
        "model.norm.weight -> norm.weight",
        True,
    ),
    Check(
        "SS079",
        "no-hf-manifest",
        W,
        "The hf block names no HF manifest: checks that need Hugging Face keys, shapes or "
        "config did not run.",
        "Without the HF manifest, missing and unexpected keys and shape mismatches are only "
        "found when a checkpoint is loaded.",
        "hf { model.norm.weight -> norm.weight }",
        'hf "llama.hf.json" { model.norm.weight -> norm.weight }',
    ),
    Check(
        "SS080",
        "hf-name-read-twice",
        E,
        "Two map lines read the same Hugging Face name.",
        "Loading would copy one tensor into two parameters, and export would have to write "
        "two parameters under one key. Tied weights are one tensor in the HF checkpoint: "
        "map it once, and name the other key with `tie ALIAS = SOURCE`.",
        "model.embed_tokens.weight -> tok_embeddings.weight\n"
        "model.embed_tokens.weight -> output.weight",
        "model.embed_tokens.weight -> tok_embeddings.weight\n"
        "lm_head.weight -> output.weight\n"
        "tie lm_head.weight = model.embed_tokens.weight",
    ),
    Check(
        "SS081",
        "hf-bad-split",
        E,
        "A split line (one Hugging Face tensor to the components of a fused dimension) does "
        "not fit its target: an `as` list on a parameter without a fused dimension, a part "
        "that is no component of it, a stated size (a number or a config.json product) that "
        "differs from the component's, parts whose transforms put the fused dimension on "
        "different Hugging Face dimensions, or a stack index `[e]` over the fused dimension.",
        "Load cuts the Hugging Face tensor into the parts at the components' sizes, in the "
        "order written, and export joins them back: a part that is not a component, or a size "
        "the checkpoint does not have, would read the wrong rows.",
        "model.layers.{i}.mlp.gate_up_proj.weight -> layers.{i}.w13.weight as up 32, gate 32, down",
        "model.layers.{i}.mlp.gate_up_proj.weight -> layers.{i}.w13.weight as up 64, gate 64",
        True,
    ),
    Check(
        "SS082",
        "hf-own-tensor-not-grouped",
        E,
        "A split line reads a Hugging Face tensor named as the fused parameter itself (the "
        "model's own checkpoint) as its components one after another, while the parameter's "
        "fused dimension declares `N groups of` components.",
        "A checkpoint of the model's own names stores the tensor as the model holds it, "
        "groups included, and a split line without `grouped` reads all of one component, "
        "then all of the next: every component's rows would come from the wrong places, "
        "and export would write them back the same way, so a round trip hides it. Either "
        "the storage is grouped (gpt-oss's interleaved gate_up_proj: add `grouped`), or the "
        "model is not (Phi3's q|k|v blocks: drop `N groups of`). A line with transforms "
        "declares a storage of its own and is not checked.",
        "param **.experts.gate_up_proj [expert, hidden, ffn] {\n"
        "    fuse ffn as 32 groups of gate 1, up 1\n}\n"
        "hf {\n    m.{i}.experts.gate_up_proj -> m.{i}.experts.gate_up_proj\n}",
        "param **.experts.gate_up_proj [expert, hidden, ffn] {\n"
        "    fuse ffn as 32 groups of gate 1, up 1\n}\n"
        "hf {\n    m.{i}.experts.gate_up_proj -> m.{i}.experts.gate_up_proj grouped\n}",
        True,
    ),
    Check(
        "SS083",
        "hf-grouped-without-groups",
        E,
        "A split line says `grouped`, but its fused parameter declares no groups.",
        "`grouped` reads the Hugging Face tensor group by group, as the fused dimension's "
        "`N groups of` lays it out; without groups it changes nothing, so the tensor is read "
        "as its components one after another, which is not what the line says.",
        "param **.gate_up_proj [expert, hidden, ffn] { fuse ffn as gate, up }\n"
        "hf {\n    m.{i}.gate_up_proj -> m.{i}.gate_up_proj grouped\n}",
        "param **.gate_up_proj [expert, hidden, ffn] { fuse ffn as 32 groups of gate 1, up 1 }\n"
        "hf {\n    m.{i}.gate_up_proj -> m.{i}.gate_up_proj grouped\n}",
        True,
    ),
    Check(
        "SS084",
        "hf-dtype-kind",
        E,
        "The HF manifest gives a key that a map line reads a dtype of another kind than its "
        "parameter's (integer or bool data for a floating parameter, or the reverse), or a "
        "dtype that is no safetensors dtype.",
        "load_hf casts between floating dtypes (a bf16 checkpoint into an fp32 model), but "
        "never between kinds: integers are not the bit patterns of floats, so such a load "
        "would be garbage, and load_hf refuses it. A header relabelled from F32 to I32 (the "
        "same bytes) is the usual cause; a quantized checkpoint needs a conversion of its own.",
        '"model.norm.weight": {"shape": [64], "dtype": "I32", ...}   # norm.weight: float32',
        '"model.norm.weight": {"shape": [64], "dtype": "F32", ...}',
        True,
    ),
    Check(
        "SS086",
        "dropped-model-state",
        W,
        "A `drop` discards a Hugging Face tensor that holds a parameter or persistent buffer "
        "of the model (the key names it, or names its sibling of a mapped module), while no "
        "map line fills that entry: load_hf leaves it as it is and export_hf omits the key.",
        "A dropped key is gone without a word: a router's score-correction bias left at its "
        "initial value loads and exports cleanly, and the export's logits differ from the "
        "original's.",
        "model.layers.{i}.mlp.gate.weight -> layers.{i}.moe.router.weight\n"
        "drop model.layers.*.mlp.gate.e_score_correction_bias   # the model's router has it",
        "model.layers.{i}.mlp.gate.weight -> layers.{i}.moe.router.weight\n"
        "model.layers.{i}.mlp.gate.e_score_correction_bias -> "
        "layers.{i}.moe.router.e_score_correction_bias",
        True,
    ),
    Check(
        "SS087",
        "sharded-buffer",
        E,
        "A rule shards a persistent buffer over a mesh axis at run time (the `fsdp` default "
        "included): only whole buffers, local shards (`local AXIS`) and checkpoint-only "
        "splits (`checkpoint shard`) describe one.",
        "FSDP2 and torch's tensor-parallel styles leave buffers as plain tensors, whole on "
        "every rank; a checkpoint or load_hf cutting one by the rule's layout would read and "
        "write the wrong indices.",
        "param layers.*.moe.router.bias [experts] {}   # a buffer: FSDP shards experts",
        "param layers.*.moe.router.bias [experts] replicate",
        True,
    ),
    # --- pipeline stages ---------------------------------------------------------------
    Check(
        "SS090",
        "bad-pipeline",
        E,
        "The pipeline block is malformed: its axis is not a mesh axis, is the FSDP axis or is "
        "used by a rule; a pattern is malformed, the split captures other than one layer index "
        "or a first/last pattern captures; there is a second split; or the spec has no "
        "manifest.",
        "A stage holds its parameters whole on its own ranks, so no rule may place a "
        "parameter over the pipeline axis; and stages are found from the whole model's names, "
        "which only a manifest knows (a stage model holds only its own).",
        "mesh over 8 ranks { pp: 2  dp_shard: * }\npipeline stage { split layers.{layer} }",
        "mesh over 8 ranks { pp: 2  dp_shard: * }\npipeline pp { split layers.{layer} }",
    ),
    Check(
        "SS091",
        "no-stage",
        E,
        "A parameter lies on no pipeline stage: no `first`, `last` or split pattern covers it.",
        "Its stage would be a guess; a checkpoint saved from the stages would lack it.",
        "pipeline pp {\n    first tok_embeddings\n    split layers.{layer}\n}   # norm, output?",
        "pipeline pp {\n    first tok_embeddings\n    split layers.{layer}\n"
        "    last norm, output\n}",
        True,
    ),
    Check(
        "SS092",
        "stage-conflict",
        E,
        "A parameter is placed by two of `first`, `last` and the split.",
        "A parameter lives on exactly one stage; two claims would put it on two stages, "
        "trained apart and saved twice.",
        "pipeline pp {\n    first tok_embeddings, layers.0\n    split layers.{layer}\n}",
        "pipeline pp {\n    first tok_embeddings\n    split layers.{layer} as 1, 3\n}",
        True,
    ),
    Check(
        "SS093",
        "empty-stage",
        E,
        "A pipeline stage holds no parameter.",
        "torch.distributed.pipelining cannot run a stage without a module, and such a "
        "stage only adds a hop to every micro-batch.",
        "pipeline pp { split layers.{layer} as 0, 4 }   # stage 0 holds nothing",
        "pipeline pp { split layers.{layer} as 1, 3 }",
        True,
    ),
    Check(
        "SS094",
        "stage-split",
        E,
        "The layers do not split over the stages: an even split of a layer count that the "
        "pipeline size does not divide, or explicit counts (`as 3, 5`) for another number of "
        "stages or another number of layers.",
        "An uneven split must be stated; counts that do not add up would drop layers or "
        "invent them.",
        "mesh over 6 ranks { pp: 3  dp_shard: * }\n"
        "pipeline pp { split layers.{layer} }   # 4 layers",
        "mesh over 6 ranks { pp: 3  dp_shard: * }\npipeline pp { split layers.{layer} as 1, 1, 2 }",
        True,
    ),
    Check(
        "SS095",
        "stage-names",
        E,
        "Stage-local names cannot be mapped to global ones: the split captures something "
        "other than a layer number, or with `local` a layer number is written with leading "
        "zeros.",
        "Megatron numbers each stage's layers from 0; read naively, stage 1's layer 0 is "
        "the model's layer 0 and a checkpoint loads the wrong layers. Global names come "
        "from the stage and the local number, which must be a plain number.",
        "pipeline pp { split blocks.{kind} local }   # blocks.attn, blocks.mlp",
        "pipeline pp { split layers.{layer} local }",
        True,
    ),
    Check(
        "SS096",
        "unused-stage-pattern",
        E,
        "A `first`, `last` or split pattern places no parameter.",
        "Usually a typo (`embeddings` for `tok_embeddings`), which would leave the modules "
        "it meant on no stage or on the wrong one.",
        "pipeline pp { first embed  split layers.{layer}  last norm, output }",
        "pipeline pp { first tok_embeddings  split layers.{layer}  last norm, output }",
        True,
    ),
    Check(
        "SS097",
        "bad-tie",
        E,
        "A pipeline `tie ALIAS = SOURCE` does not fit the manifest: the source is no "
        "parameter, the alias is a parameter of its own (the model does not tie it; a "
        "manifest that records `tied_to` may list the alias tied to the source, and no "
        "other), or one of them is in the split family or the alias is on no stage (or two).",
        "The whole model holds a tied weight once, under the source's name; the alias's "
        "stage holds a copy that training keeps equal (its gradient is summed with the "
        "source's) and checkpoints store once. A tie the model does not have would make two "
        "weights one.",
        "pipeline pp {\n    first tok_embeddings\n    split layers.{layer}\n"
        "    last norm, output\n    tie output.weight = embed.weight\n}",
        "pipeline pp {\n    first tok_embeddings\n    split layers.{layer}\n"
        "    last norm, output\n    tie output.weight = tok_embeddings.weight\n}",
        True,
    ),
    Check(
        "SS098",
        "tie-layout",
        E,
        "A rule that matches a tie's alias shards it differently from its source's rule.",
        "The alias's stage holds a copy of the source's shards, summed with them every step "
        "and stored under the source's name: both must be cut the same way. The alias's rule "
        "may still state its module's style.",
        "param tok_embeddings.weight [vocab, hidden] { shard vocab over tp }\n"
        "param output.weight [vocab, hidden] { shard hidden over tp }",
        "param tok_embeddings.weight [vocab, hidden] { shard vocab over tp }\n"
        "param output.weight [vocab, hidden] {\n    shard vocab over tp\n"
        "    style colwise output replicate\n}",
        True,
    ),
    # --- views (several factorizations of one world) and expert parallelism -------------
    Check(
        "SS100",
        "mesh-views",
        E,
        "An unnamed mesh beside named meshes (views), or two views of one name.",
        "A spec has one unnamed mesh, or views only: a rule with no axis goes to the default "
        "view (the first declared), which an unnamed mesh beside views would make unclear.",
        "mesh { dp_shard: *  tp: 2 }\nmesh expert { efsdp: *  ep: 2 }",
        "mesh dense { fsdp: *  tp: 2 }\nmesh expert { efsdp: *  ep: 2 }",
    ),
    Check(
        "SS101",
        "view-world",
        E,
        "Views that do not factor the same world: stated world sizes or axis sizes that "
        "multiply to different numbers of ranks.",
        "Every view is a factorization of the same ranks (rank r has r's row-major "
        "coordinate in each); a view of another size would place parameters on ranks "
        "that do not exist, or leave ranks out.",
        "mesh dense over 8 ranks { fsdp: *  tp: 2 }\nmesh expert over 4 ranks { efsdp: *  ep: 2 }",
        "mesh dense over 8 ranks { fsdp: *  tp: 2 }\nmesh expert { efsdp: *  ep: 2 }",
    ),
    Check(
        "SS102",
        "shared-axes",
        E,
        "An axis named in two views that is not part of their common outermost prefix, "
        "in one order with one size.",
        "A shared axis (pp, dp_replicate) must give every rank the same coordinate in every "
        "view; that holds only for a prefix of outermost axes with equal sizes. Any other "
        "repeated name would be two different axes under one name.",
        "mesh dense { fsdp: *  dp_replicate: 2 }\nmesh expert { dp_replicate: 2  ep: * }",
        "mesh dense { dp_replicate: 2  fsdp: * }\nmesh expert { dp_replicate: 2  ep: * }",
    ),
    Check(
        "SS103",
        "view-fsdp",
        E,
        "An FSDP axis missing from a view, given twice for one view, or on an axis views share.",
        "FSDP2 shards each view's parameters over that view's own data axis (torchtitan's "
        "fsdp and efsdp); a view without one would keep its parameters whole on every rank "
        "while the other view's are sharded.",
        "mesh dense { fsdp: *  tp: 2 }\nmesh expert { efsdp: *  ep: 2 }\nfsdp fsdp",
        "mesh dense { fsdp: *  tp: 2 }\nmesh expert { efsdp: *  ep: 2 }\nfsdp fsdp\nfsdp efsdp",
    ),
    Check(
        "SS104",
        "rule-view",
        E,
        "A rule whose view is unclear: it names axes of two views, states a view its axes "
        "contradict, or names a view that does not exist.",
        "A parameter lives on one view: its layout and DeviceMesh are that view's. A rule "
        "that names no axis goes to the default view (the first declared) unless `view "
        "NAME` says otherwise.",
        "param layers.*.moe.experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n"
        "    shard ffn over tp\n}",
        "param layers.*.moe.experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n"
        "    style expert_parallel\n}",
    ),
    Check(
        "SS105",
        "pipeline-view",
        E,
        "The pipeline axis is not an axis of every view.",
        "A pipeline stage holds its dense and its expert parameters on the same ranks: the "
        "stage axis must be shared by every view, outermost.",
        "mesh dense { pp: 2  fsdp: * }\nmesh expert { ep: * }\npipeline pp { split layers.{i} }",
        "mesh dense { pp: 2  fsdp: * }\nmesh expert { pp: 2  ep: * }\n"
        "pipeline pp { split layers.{i} }",
    ),
    Check(
        "SS106",
        "expert-parallel-style",
        E,
        "`style expert_parallel` on a parameter that is no stacked expert weight: its first "
        "dimension not cut over one EP axis, an EP axis that is the FSDP axis or shared, "
        "parameters of one module with different styles, EP axes or expert counts, or an "
        "expert count the EP axis does not divide.",
        "The expert-parallel style dispatches tokens to the ranks that own their experts: "
        "every weight of the module must be `[expert, ...]` with whole experts per EP rank, "
        "cut the same way.",
        "param layers.*.moe.experts.w{1,2,3} [expert, ffn, hidden] {\n"
        "    shard ffn over ep\n    style expert_parallel\n}",
        "param layers.*.moe.experts.w{1,2,3} [expert, ffn, hidden] {\n"
        "    shard expert over ep\n    style expert_parallel\n}",
        True,
    ),
    Check(
        "SS107",
        "expert-on-tensor-parallel",
        E,
        "The EP axis of an expert-parallel rule is also cut over by colwise, rowwise or "
        "sequence-parallel rules.",
        "Ranks of a tensor-parallel group hold the same tokens cut by features; dispatching "
        "experts over them would send each token's features to different experts. Declare "
        "an expert view whose EP axis folds over the same ranks instead.",
        "mesh { dp: *  tp: 2 }\nparam experts.w [expert, ffn] {\n    shard expert over tp\n"
        "    style expert_parallel\n}\nparam attn.wq.weight [out, hidden] { shard out over tp }",
        "mesh dense { dp: *  tp: 2 }\nmesh expert { edp: *  ep: 2 }\n"
        "param experts.w [expert, ffn] {\n    shard expert over ep\n"
        "    style expert_parallel\n}",
        True,
    ),
    Check(
        "SS108",
        "expert-group-tokens",
        E,
        "Two ranks of one EP group hold the same tokens in another view: they differ there "
        "only in axes that tensor-parallel rules cut over, and that view is not sequence-"
        "parallel.",
        "Expert parallelism exchanges each rank's own tokens. Ranks that hold the same "
        "tokens would send every token twice and sum its experts' gradients twice. ep may "
        "take ranks of a tensor-parallel axis only where the MoE's input is cut by sequence "
        "over it (torchtitan's sequence-parallel norms); parallelize then runs each MoE "
        "block on its tp rank's own slice of the sequence.",
        "mesh dense { fsdp: *  tp: 2 }\nmesh expert { efsdp: *  ep: 2 }   # ep pairs tp ranks",
        "mesh dense { fsdp: *  tp: 2 }\nmesh expert { ep: 2  efsdp: * }   # ep pairs fsdp ranks",
        True,
    ),
    Check(
        "SS109",
        "unsummed-head-norm",
        E,
        "A one-dimensional parameter replicated over a tensor-parallel axis, whose size is "
        "the head size of a sibling module cut over that axis by heads, has no `style "
        "sequence_parallel input heads`.",
        "A per-head norm (Qwen3's q_norm and k_norm, of weight [head_dim]) runs on the heads "
        "its tp rank holds, so the gradient of its weight on each rank is only those heads' "
        "part. Replicated with no style, each rank steps its own copy with its own part: no "
        "error, the replicas drift apart. torch's SequenceParallel on the heads dimension "
        "makes the weight a replicated DTensor whose gradient is summed over tp.",
        "param attn.{q,k}_proj.weight [out, hidden] {\n    heads out 16\n"
        "    shard out over tp\n}\nparam attn.{q,k}_norm.weight [head_dim] {}",
        "param attn.{q,k}_proj.weight [out, hidden] {\n    heads out 16\n"
        "    shard out over tp\n}\nparam attn.{q,k}_norm.weight [head_dim] {\n"
        "    style sequence_parallel input heads\n}",
        True,
    ),
    # --- block-scaled FP8 Hugging Face tensors (`fp8` lines of the hf block) -----------
    Check(
        "SS110",
        "bad-quant-item",
        E,
        "An hf block's `fp8` line is malformed: a glob with `{...}` or an empty segment, a "
        "scale template without exactly one `{key}` (or with globs, or naming the weight "
        "itself), a block size of 0, an option given twice (the scale formats `float32`, "
        "`bfloat16`, `float16` and `ue8m0` count as one option, `e4m3` and `e5m2` as "
        "another), or the same glob on two lines.",
        "The line says how every matching Hugging Face tensor is stored and where its "
        "scales are: load_hf dequantizes with it and export_hf quantizes with it, so an "
        "ambiguous line would read or write the wrong bytes.",
        "fp8 model.layers.*.mlp.*_proj.weight scale weight_scale_inv",
        "fp8 model.layers.*.mlp.*_proj.weight scale {key}_scale_inv",
    ),
    Check(
        "SS111",
        "hf-quant-undeclared",
        E,
        "The HF manifest stores a tensor in an FP8 dtype (`F8_E4M3`, `F8_E5M2`, "
        "`F8_E8M0`) that no `fp8` line covers, is not the scale of one, and is not dropped.",
        "FP8 bytes are meaningless without their block scales: load_hf refuses an FP8 "
        "tensor it was not told how to dequantize, so the load would fail on the real "
        "checkpoint. Lint says so before the job starts.",
        'hf "hf.json" {\n    model.layers.{i}.mlp.up_proj.weight -> layers.{i}.w1\n}'
        "   # F8_E4M3 in the checkpoint",
        'hf "hf.json" {\n    model.layers.{i}.mlp.up_proj.weight -> layers.{i}.w1\n'
        "    fp8 model.layers.*.mlp.*_proj.weight\n}",
        True,
    ),
    Check(
        "SS112",
        "hf-quant-scale",
        E,
        "An FP8 weight's scale is wrong in the HF manifest: its key is missing, its dtype is "
        "not the line's scale format's (F32 by default; BF16 for `bfloat16`, F16 for "
        "`float16`, F32 or F8_E8M0 for `ue8m0`), its shape is not one per block "
        "(`ceil(rows / R) x ceil(cols / C)`, per expert for a stacked `[E, R, C]` weight), "
        "or the scale key is itself matched by an fp8 glob or read by a map line.",
        "Every block's values are its FP8 bytes times its scale: a missing or misshapen "
        "scale cannot be applied, and a scale read as a weight would be dequantized itself.",
        "fp8 model.layers.*.mlp.*_proj.weight   # the checkpoint has ...weight_scale, not "
        "...weight_scale_inv",
        "fp8 model.layers.*.mlp.*_proj.weight scale {key}_scale",
        True,
    ),
    Check(
        "SS113",
        "hf-quant-dtype",
        E,
        "A tensor that an `fp8` line covers is not stored in the line's FP8 dtype (BF16 "
        "where the line says FP8, F8_E5M2 where it says e4m3), or is not at least 2-D.",
        "DeepSeek-format checkpoints keep embeddings, norms, the router and its "
        "e_score_correction_bias in BF16/F32 beside FP8 linear layers: a glob that also "
        "covers those would dequantize BF16 bytes as FP8. Blocks tile a weight's last two "
        "dimensions, so a 1-D tensor has none.",
        "fp8 model.layers.*.**.weight   # covers model.layers.0.input_layernorm.weight (BF16)",
        "fp8 model.layers.*.mlp.*_proj.weight\nfp8 model.layers.*.self_attn.*_proj.weight",
        True,
    ),
    Check(
        "SS114",
        "unused-quant-item",
        W,
        "An `fp8` line matches no key of the HF manifest (or every key it matches is a "
        "scale), or every FP8 weight it matches is declared by an earlier line (the first "
        "line that matches a key applies).",
        "Usually a typo in the glob, which leaves the FP8 tensors it meant undeclared; or a "
        "wider glob above it, whose options then apply instead of this line's.",
        "fp8 model.layers.*.mlp.*_prj.weight",
        "fp8 model.layers.*.mlp.*_proj.weight",
        True,
    ),
    Check(
        "SS115",
        "half-sequence-parallel",
        E,
        "In a view whose norms are `style sequence_parallel`, a rowwise module has no "
        "`output sequence`, or the token embedding is not `rowwise output sequence`.",
        "Sequence parallelism cuts the residual stream by tokens over tp: torch's "
        "SequenceParallel norms take their input as the rank's slice of the sequence. Every "
        "module that writes the residual stream must leave it so (a rowwise module "
        "reduce-scattered, `output sequence`, and the embedding too), or a whole tensor is "
        "taken for a slice: the sequence comes out tp times too long, or the model computes "
        "wrongly.",
        "param attn.wo.weight [hidden, heads] {\n    shard heads over tp\n}\n"
        "param **.*norm.weight [dim] {\n    style sequence_parallel\n}",
        "param attn.wo.weight [hidden, heads] {\n    shard heads over tp\n"
        "    style rowwise output sequence\n}\n"
        "param **.*norm.weight [dim] {\n    style sequence_parallel\n}",
        True,
    ),
    Check(
        "SS116",
        "replicated-heads-size",
        E,
        "A component with `heads ... replicated` is split over an axis whose size neither "
        "divides its head count nor is a multiple of it.",
        "vLLM's QKVParallelLinear splits the KV heads over tp when tp divides their count, "
        "and replicates each head on tp / heads consecutive ranks when tp is a multiple of "
        "it; any other tp would give a rank part of a head, or heads unevenly, and vLLM "
        "refuses it. The finding lists the axis sizes that work.",
        'manifest "m.json"\nmesh { tp: 3 }\nparam qkv_proj.weight [qkv, hidden] {\n'
        "    fuse qkv as q 96, k 32, v 32\n    heads k 16 replicated, v 16 replicated\n"
        "    shard qkv over tp\n    local tp\n}",
        'manifest "m.json"\nmesh { tp: 4 }\nparam qkv_proj.weight [qkv, hidden] {\n'
        "    fuse qkv as q 64, k 32, v 32\n    heads k 16 replicated, v 16 replicated\n"
        "    shard qkv over tp\n    local tp\n}",
        True,
    ),
    Check(
        "SS117",
        "replicated-heads-layout",
        E,
        "`heads ... replicated` is on a dimension that is not fused (or fused in groups), "
        "has a head size that is a name, or is not split over exactly one local axis.",
        "Replicated heads are an engine's per-rank layout (vLLM's [q_r; k_r; v_r], KV head "
        "rank // (tp / kv heads)): several ranks hold the same head, which no DTensor "
        "placement describes, so the module must be built with its shard (`local tp`) of a "
        "fused dimension of components, and the layout needs the head size before any "
        "manifest is read.",
        "param qkv_proj.weight [qkv, hidden] {\n    fuse qkv as q 64, k 32, v 32\n"
        "    heads k 16 replicated\n    shard qkv over tp\n}",
        "param qkv_proj.weight [qkv, hidden] {\n    fuse qkv as q 64, k 32, v 32\n"
        "    heads k 16 replicated\n    shard qkv over tp\n    local tp\n}",
    ),
    Check(
        "SS118",
        "unknown-pad-dimension",
        E,
        "A map line's `pad NAME to M` names no dimension of the rules that place its target, "
        "or a dimension found at several indices there.",
        "`pad vocab to 64` names the target rule's dimension, as `shard vocab over tp` does; "
        "a typo would otherwise pad nothing, or the wrong dimension. The finding lists the "
        "dimension names that exist; where the name is ambiguous, give the index "
        "(`pad 0 to 64`).",
        "param embed.weight [vocab, hidden] {}\nhf {\n    embed.weight -> embed.weight "
        "pad vocb to 64\n}",
        "param embed.weight [vocab, hidden] {}\nhf {\n    embed.weight -> embed.weight "
        "pad vocab to 64\n}",
    ),
    # --- transfer (`shardspec transfer TRAIN ENGINE`) ------------------------------------
    Check(
        "SS124",
        "transfer-missing-source",
        E,
        "The engine spec reads a Hugging Face tensor (or part of one) that the trainer spec "
        "does not produce.",
        "A weight transfer joins the two specs through their hf blocks: every element an "
        "engine rank holds must come from some trainer rank, or the engine runs with a "
        "weight that was never updated.",
        "# trainer: model.layers.{i}.mlp.gate_proj.weight -> layers.{i}.w1.weight\n"
        "# engine:  model.layers.{i}.mlp.gate_prj.weight -> layers.{i}.gate.weight",
        "# engine:  model.layers.{i}.mlp.gate_proj.weight -> layers.{i}.gate.weight",
    ),
    Check(
        "SS125",
        "transfer-shape-mismatch",
        E,
        "A Hugging Face tensor has one shape on the trainer and another on the engine.",
        "The two specs describe different models (another hidden size, head count or "
        "vocabulary); no layout can turn one into the other.",
        "# trainer manifest: hidden 64; engine manifest: hidden 128",
        "# both manifests from the same model config",
    ),
    Check(
        "SS126",
        "transfer-dtype-mismatch",
        E,
        "A Hugging Face tensor's dtype on the trainer cannot be cast to the engine's (a "
        "floating tensor into an integer one, or the reverse).",
        "The sender casts as it sends (fp32 master weights to a bf16 engine); a cast "
        "between kinds is never a weight update.",
        "# trainer: layers.0.w.weight float32; engine: layers.0.w.weight int8",
        "# trainer: layers.0.w.weight float32; engine: layers.0.w.weight bfloat16",
    ),
    Check(
        "SS127",
        "transfer-unsupported-layout",
        E,
        "A parameter's layout cannot be planned for a transfer yet (a dimension indexed by "
        "the module's name).",
        "The planner computes every rank's elements from the layout; modules indexed by "
        "name (one module per local expert) are not planned yet, and silently leaving them "
        "out would leave their weights stale.",
        "param layers.*.moe.local_experts.{expert}.w1 [expert, ffn, hidden] { ... }",
        "param layers.*.moe.experts.w1 [expert, ffn, hidden] {\n    shard expert over ep\n}",
    ),
    Check(
        "SS128",
        "transfer-no-hf-block",
        E,
        "A spec of a transfer pair has no hf block or no manifest.",
        "Hugging Face names are the common language of the two specs: without an hf block "
        "(and the manifest's shapes) there is nothing to join.",
        'manifest "llama.manifest.json"   # and no hf block',
        'manifest "llama.manifest.json"\nhf "llama.hf.json" {\n    ...\n}',
    ),
    Check(
        "SS129",
        "transfer-unread-tensor",
        W,
        "The trainer produces a Hugging Face tensor that the engine spec neither reads nor drops.",
        "Usually a typo or a missing map line on the engine side; if the engine really does "
        "not need it, `drop` it there to say so.",
        "# engine hf block: no line for lm_head.weight",
        "# engine hf block:\ndrop lm_head.weight",
    ),
    Check(
        "SS130",
        "unknown-key-layout",
        E,
        "`checkpoint keys NAME` names no checkpoint key layout.",
        "save and load write and read the key layout the spec names by default; one the "
        "runtime does not know would fail every save and load. The layouts are `shardspec` "
        "(shardspec's own: fused parameters per component) and `torchtitan` (the keys "
        "torchtitan's state-dict hooks write: `wq`/`wk`/`wv` for a fused `wqkv`, other fused "
        "tensors whole).",
        "checkpoint keys titan",
        "checkpoint keys torchtitan",
    ),
    Check(
        "SS131",
        "key-layout-mismatch",
        E,
        "The spec's checkpoint key layout cannot store a fused parameter as it says: the "
        "layout splits it into other components than the `fuse` item declares, or stores it "
        "whole (optimizer state included) while a rank holds it in several pieces.",
        "A trainer's key layout stores a fused tensor as that trainer's state-dict hooks "
        "present it (torchtitan: `wqkv` as `wq`, `wk`, `wv`, in that order) and every other "
        "fused tensor, and the optimizer state of all of them, whole under the parameter's "
        "name; a declaration that does not match would fail every save, and a fused tensor "
        "stored whole must be one block on every rank (DCP stores one box per rank).",
        "checkpoint keys torchtitan\nparam layers.*.attention.qkv_linear.wqkv.weight [qkv, "
        "hidden] {\n    fuse qkv as q 64, kv 64\n}",
        "checkpoint keys torchtitan\nparam layers.*.attention.qkv_linear.wqkv.weight [qkv, "
        "hidden] {\n    fuse qkv as q 64, k 32, v 32\n}",
        True,
    ),
    Check(
        "SS132",
        "pad-size-mismatch",
        E,
        "A `pad D to M` line's model size is not the HF size rounded up to the multiple (or "
        "the HF size is unknown, or an axis it names is no mesh axis, or is named twice).",
        "load_hf reads the HF tensor's real rows and zero-fills the rest, export_hf writes the "
        "real rows back: both need the model's padded size to be exactly the HF size rounded "
        "up to the multiple (vLLM: to 64; Megatron: to `make_vocab_size_divisible_by` x tp), "
        "and the HF size from the spec's HF manifest.",
        "# HF vocab 1000, model 1024\nmodel.embed_tokens.weight -> tok.weight pad 0 to 256",
        "model.embed_tokens.weight -> tok.weight pad 0 to 64   # 1000 -> 1024",
    ),
    Check(
        "SS133",
        "pad-uneven-split",
        W,
        "A padded dimension does not split evenly over the mesh axes that shard it (FSDP's "
        "axis aside).",
        "Engines that pad a vocabulary pad it so that every tensor-parallel rank holds the same "
        "rows (vLLM's `VocabParallelEmbedding`: padded vocab / tp); an uneven split loads, but "
        "is not the layout such an engine holds.",
        "# 1000 -> 1040 rows over tp 16\nmodel.embed_tokens.weight -> tok.weight pad 0 to 16",
        "model.embed_tokens.weight -> tok.weight pad 0 to 64 x tp   # Megatron's rule",
    ),
)

# Codes that no check reports any more. They stay reserved: a code never changes meaning.
RETIRED: dict[str, str] = {
    "SS025": "indivisible-local: local shapes are multiplied up to global ones, so a "
    "dimension sharded over a local axis always divides by it",
}

BY_CODE: dict[str, Check] = {c.code: c for c in CHECKS}


def diag(code: str, message: str, span: Span, hint: str = "") -> Diagnostic:
    """A diagnostic for ``code`` with the registry's name and severity."""
    c = BY_CODE[code]
    return Diagnostic(code, c.name, c.severity, message, span, hint)
