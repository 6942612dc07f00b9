"""What `graphdiff patch` writes beside its generated module (the manifest the runtime applies), and what
`graphdiff check` reports about a checked-in patch."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from graphdiff.records.files import SCHEMA_VERSION

# the attention splice's form: attention as the registry says the engine computes it, or the engine's own op
AttentionForm = Literal["fp32", "engine"]


class CheckFinding(BaseModel):
    kind: Literal["version", "model config", "compile config", "site", "patch file"]
    what: str
    was: str
    now: str


class CheckResult(BaseModel):
    """What `graphdiff check` reports: ok, or why the checked-in patch must be regenerated."""

    schema_version: int = SCHEMA_VERSION
    kind: Literal["graphdiff.check"] = "graphdiff.check"
    manifest: str
    model: str
    ok: bool = False
    findings: list[CheckFinding] = Field(default_factory=list)
    sites_left: int = 0  # one-sided sites the scan of the patched trainer found
    left_out: list[str] = Field(default_factory=list)  # of those, sites of regions the patch does not align
    regenerate: str = ""  # the command that makes the patch again
    notes: list[str] = Field(default_factory=list)


# --- patch manifest (`graphdiff patch`) ----------------------------------------------------------------

# 5: a splice holds only its target's fields (ManifestSplice: one record per target, as the runtime patches them)
MANIFEST_VERSION = 5


class SpliceBase(BaseModel):
    """What every splice holds: one place the runtime changes the HF model, the regions it aligns there, the generated
    function that does it."""

    key: str  # module pattern (`model.layers.*.self_attn.q_norm`) or dotted function path
    target: str  # which of ManifestSplice's records (each narrows it to its own)
    module: str  # HF module path pattern, layers collapsed as `layers.*`
    module_class: str = ""
    regions: list[str]
    torch_fn: str = ""  # name in the generated module
    triton_fn: str = ""  # "" when no Triton kernel could be generated (see triton_problem)
    triton_problem: str = ""
    problems: list[str] = Field(default_factory=list)  # non-empty: not generated, the reasons
    # the scanned decoder layers it serves, where its regions' layers run different rounding plans (one splice per
    # group of layers: first / middle / last, alternating types); [] = every layer the pattern matches
    layers: list[int] = Field(default_factory=list)


class CalledSplice(SpliceBase):
    """A splice whose generated function HF's own code calls in place of a module forward or a function."""

    # What feeds each input of the generated function: "arg:0" / "arg:NAME" (the forward's or the function's
    # argument), "param:NAME" (a module attribute); and where each output goes in the HF return value.
    inputs: list[str] = Field(default_factory=list)
    outputs: list[int] = Field(default_factory=list)
    # HF module -> the lanes its engine kernel sums rows in (Region.reduction_lanes); the runtime passes each
    # module's to the generated function, which sums the aligned regions' rows in that order
    reduction_lanes: dict[str, int] = Field(default_factory=dict)
    # the closed-form gradient of torch_fn in the generated module (an RMS norm's), called by the runtime's PyTorch
    # path with the gradient and torch_fn's inputs; "" where autograd differentiates torch_fn
    torch_backward: str = ""
    # the inputs (positions) whose values torch_backward reads (the others reach it as shapes: meta tensors), and those
    # it gives a gradient (another input needing one: autograd differentiates torch_fn)
    torch_backward_reads: list[int] = Field(default_factory=list)
    torch_backward_grads: list[int] = Field(default_factory=list)
    # inputs (positions) the traced trainer held in a low precision and made from no activation (a rotary embedding's
    # cos and sin): the runtime casts them back to that dtype (name) where an FP32 value upstream promoted their op
    fixed_inputs: dict[int, str] = Field(default_factory=dict)


class ModuleSplice(CalledSplice):
    """A module's forward replaced by the generated function."""

    target: Literal["module"] = "module"


class FunctionSplice(CalledSplice):
    """A module-level function replaced by the generated function while the modules that call it run."""

    target: Literal["function"] = "function"
    function: str  # dotted path of the replaced function


class CarrySplice(SpliceBase):
    """Hooks on a module whose own code only joins its child modules' outputs: its incoming activation (and the
    outputs named below) held as the engine holds them."""

    target: Literal["carry"] = "carry"
    # torch_fn carry_fp32_rounded: child modules (paths relative to the module) that read the incoming activation in
    # FP32 while the module's own ops read it rounded (a piecewise engine's BF16 graph boundary)
    fp32_children: list[str] = Field(default_factory=list)
    # torch_fn carry_fp32: child modules that read the incoming activation as the engine's stored BF16 copy while the
    # module's own ops read it in FP32 (OLMo 2's attention projections; carry_rounded_child)
    rounded_children: list[str] = Field(default_factory=list)
    # child modules (paths relative to the module) whose output the module's own code scales before the residual add;
    # the engine fuses the scale into its FP32 sum, so the child's output reaches it in FP32
    fp32_outputs: list[str] = Field(default_factory=list)
    # child module whose output the module's own code scales by a constant -> the child modules that read the product
    # (the first decoder layer reading the scaled embedding); the engine hands it on unrounded, so they get it in FP32
    # (torch_fn carry_scaled: the module's only sites; its incoming activation is not carried)
    fp32_scaled: dict[str, list[str]] = Field(default_factory=dict)
    # child module (path relative to the module) -> the decoder layers where the module's own residual add of that
    # child's output is rounded to BF16, as the engine stores that sum (the child's output may be held FP32)
    rounded_sums: dict[str, list[int]] = Field(default_factory=dict)
    # child module -> the decoder layers where the module's own residual add of that child's output is stored by the
    # engine in BF16 for the kernels after it (its own kernel's norm reads it in FP32): later adds read it rounded
    stored_sums: dict[str, list[int]] = Field(default_factory=dict)


class AttentionSplice(SpliceBase):
    """The attention function (registered with transformers' AttentionInterface), or torch's sdpa where a module's
    own code calls it."""

    target: Literal["attention"] = "attention"
    function: str  # the attention function swapped
    # modules the generated function imports when it runs, beyond torch and transformers (the engine's own attention
    # op: vllm._custom_ops); runtime.apply refuses the splice where they are missing
    imports: list[str] = Field(default_factory=list)


class MoeSplice(SpliceBase):
    """A router or experts module's forward computed as the engine's fused MoE does."""

    target: Literal["router", "experts"]
    imports: list[str] = Field(default_factory=list)  # as AttentionSplice's (the engine's own GEMM or fused-MoE op)


class LinearSplice(SpliceBase):
    """An nn.Linear computed as a tensor-parallel engine's ranks compute it: K split over `shards` ranks."""

    target: Literal["linear"] = "linear"
    shards: int  # the engine's tensor-parallel ranks the matmul's K is split over


# One place the runtime changes the HF model, one record per target (the runtime patches each target its own way)
ManifestSplice = Annotated[ModuleSplice | FunctionSplice | CarrySplice | AttentionSplice | MoeSplice | LinearSplice,
                           Field(discriminator="target")]


class RegionEffect(BaseModel):
    """What one region does to the engine-vs-trainer gap, measured on the engine's own samples (k3, 1e-4 units
    not applied: raw)."""

    metric: str  # "k3"
    without: float  # the gap with every enabled region but this one
    with_: float = Field(alias="with")  # the gap with every enabled region
    delta: float  # with - without: < 0 narrows the gap
    ci: tuple[float, float] | None = None  # 95% bootstrap interval of delta over sequences
    tokens: int
    # what kept or left it out: "k3" (the measured gap) or, for an `--exact` patch, "equality" (whether removing it
    # makes more of the trainer's log-probs equal the engine's prefill scoring)
    decided_by: Literal["k3", "equality"] = "k3"
    equal_with: int | None = None  # tokens equal to the engine's prefill scoring with every enabled region
    equal_without: int | None = None  # ... with every enabled region but this one
    model_config = {"populate_by_name": True}


class ManifestRegion(BaseModel):
    name: str
    kind: str
    module: str
    layers: list[int | None]
    sites: list[str]
    splices: list[str]  # keys of the splices that align this region's sites
    # its layers in groups that share one rounding plan, one splice each (ManifestSplice.layers); [] = one group
    layer_groups: list[list[int]] = Field(default_factory=list)
    generated: bool
    reason: str = ""  # why not, when not generated
    enabled: bool = True  # applied by default (`runtime.apply(model, manifest)`); False: measured to widen the gap
    effect: RegionEffect | None = None  # its measured effect on the gap, where measured
    # ms its splice adds to a training step (forward + backward, CPU time; a splice serving several regions counts for
    # each) of the gate's model at Manifest.step_tokens tokens, where measured
    step_ms: float | None = None
    # the recorded shapes where the region has sites, when not all of them (Region.shape_dependent): the code
    # rounds at the union of its sites, which is the engine's rounding only at these shapes
    shapes: list[str] = Field(default_factory=list)


class Manifest(BaseModel):
    """What `graphdiff patch` writes to DIR/manifest.json, beside the generated module."""

    schema_version: int = MANIFEST_VERSION
    kind: Literal["graphdiff.manifest"] = "graphdiff.manifest"
    model: str
    architecture: str
    config_sha256: str  # scan.json's: config.json without transformers_version/_name_or_path, at layers_scanned
    fingerprint: str = ""  # scan.json's: the checkpoint the scan ran
    scan_id: str = ""  # scan.json's: the scan the patch was generated from
    # transformers-normalized config fields that differ from their defaults, at layers_scanned (no run settings):
    # apply() compares the model's config with these
    config: dict[str, object]
    layers_scanned: int
    versions: dict[str, str] = Field(default_factory=dict)  # torch / transformers / engine the scan ran
    compilation_config: dict[str, object] = Field(default_factory=dict)  # as the scan asked for it (-O included)
    engine_config: dict[str, object] = Field(default_factory=dict)  # the engine's effective config the scan ran
    shapes: list[str] = Field(default_factory=list)  # the shapes the scan analysed (Shape.label)
    scan_command: str = ""  # the scan that made it
    module_file: str  # generated module, relative to the manifest
    module_sha256: str
    regions: list[ManifestRegion]
    splices: list[ManifestSplice]
    replaced: list[str] = Field(default_factory=list)  # HF module classes and functions replaced
    exact: bool = False  # made with --exact: the gate keeps a region by equality with the engine, not by k3
    step_tokens: int = 0  # the tokens (batch 1) ManifestRegion.step_ms was measured at; 0: not measured
    step_layers: int = 0  # the decoder layers of the model it was measured on
    notes: list[str] = Field(default_factory=list)
