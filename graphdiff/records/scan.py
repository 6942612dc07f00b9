"""What a scan decides (`scan.json`): the plan of decisions, the sites rounded on one side, their regions, and the
replay evidence of every engine kernel."""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import BaseModel, Field

from graphdiff.records.files import SCHEMA_VERSION
from graphdiff.records.gap import Departure, KLResult, RoutingAgreement
from graphdiff.records.graph import Shape, Side, Source

# What a region of sites computes (analysis.kinds.classify decides it), in the order reports list regions.
RegionKind = Literal["rope", "qk_norm", "attention", "router", "expert_combine", "gated_act", "embedding_scale",
                     "residual_scale", "residual_norm", "norm_weight", "logit_scale", "allreduce", "sum_order", "math",
                     "stored_copy", "other"]
REGION_KINDS: tuple[RegionKind, ...] = get_args(RegionKind)


class SideRef(BaseModel):
    """One side's view of a site's value."""

    node: str
    op: str
    dtype: str | None = None
    module: str | None = None
    source: Source | None = None
    kernel: str | None = None  # engine: the kernel computing it
    how: str = ""  # how this side treats the value ("rounded: stored by K as bfloat16", "FP32 in K")


class SideState(BaseModel):
    """How one side holds a value after the op that computes it."""

    dtype: str | None = None  # the dtype the side materializes it in (the engine: FP32 inside a fused kernel)
    rounds: bool = False  # this side's op rounds it to low precision here (eager: stores it in its dtype)
    on_grid: bool = False  # it sits on the low-precision grid here (rounded here or upstream)
    changed: float | None = None  # fraction of elements the rounding here changes (trainer: measured)
    how: str = ""


Rule = Literal["matched", "inside-kernel", "opaque-registry", "no-engine-value"]


class Evidence(BaseModel):
    """What a decision rests on, as fields (reports and `graphdiff explain` read these, never prose)."""

    engine_node: str = ""  # the engine value matched to the trainer's
    engine_graph: str = ""
    kernel: str = ""  # id of the engine kernel computing it
    replay_predicted: float | None = None  # that kernel's replay under the predicted model
    replay_naive: float | None = None
    stretch: list[str] = Field(default_factory=list)  # [above, below]: engine values bounding an in-kernel stretch
    distance: float | None = None  # sorted-value distance of the match (relative L2)
    runner_up: float | None = None  # the next distinct candidate's distance
    confidence: float = 1.0
    registry: str = ""  # the opaque-kernel registry entry's source (rule opaque-registry)
    # Trainer consumers (decision ids) the engine feeds a low-precision copy of this value although it holds the
    # value itself in FP32 (a piecewise engine stores the residual in BF16 where it is live across a graph split).
    read_rounded_by: list[str] = Field(default_factory=list)


class Decision(BaseModel):
    """One trainer value the analysis decided on: how each side rounds it, by which rule, on what evidence."""

    id: str  # stable: module/file:line/op.position (see sites.stable_ids)
    node: str  # the trainer node (name in train.capture.json)
    op: str
    module: str | None = None
    layer: int | None = None
    train: SideState
    engine: SideState | None = None  # None: no evidence for the engine side
    rule: Rule
    evidence: Evidence = Field(default_factory=Evidence)
    site: bool = False  # rounded on exactly one side
    shapes: list[str] = Field(default_factory=list)  # shape labels (ScanResult.shapes) this decision holds at
    region: str = ""  # a site's region (the region's kind_reason says why it has its kind)
    kind: RegionKind | Literal[""] = ""  # a site's region kind; "" when not a site


class Site(BaseModel):
    """A value rounded to low precision on exactly one side."""

    id: str  # the Decision's id
    region: str
    kind: RegionKind
    layer: int | None = None
    rounded_on: Side
    train: SideRef
    engine: SideRef | None = None  # node "" when no engine node computes this value (other decomposition)
    matched: bool
    confidence: float
    changed_fraction: float  # fraction of elements the rounding changes on the rounding side
    evidence: str  # one-line summary of the Decision's evidence
    nonuniformity: float | None = None  # rounding-position statistic of the values rounded here
    shapes: list[str] = Field(default_factory=list)  # the recorded shapes where it is a site (Shape.label)
    proven: bool = True  # False: its engine side rests on a kernel that does not replay, or an unknown extern
    unproven: str = ""  # why not proven


class Region(BaseModel):
    name: str  # module pattern + "#" + kind
    kind: RegionKind
    kind_reason: str = ""  # the dataflow fact that decided the kind
    module: str  # HF module path pattern, layers collapsed as `layers.*`
    layers: list[int | None]
    sites: list[str]
    rounded_on: list[Side]
    kernels: list[str] = Field(default_factory=list)  # engine kernels (names) these sites sit in
    differing_layers: list[int] = Field(default_factory=list)  # layers whose sites differ from the first
    shapes: list[str] = Field(default_factory=list)  # shapes where it has sites (all recorded: shape-independent)
    shape_dependent: bool = False  # its sites are not the same at every recorded shape
    proven: bool = True  # every site proven
    # HF module -> the lanes its engine kernel sums rows in (KernelEvidence.reduction_lanes, at every shape); the
    # patch sums the region's rows in that order
    reduction_lanes: dict[str, int] = Field(default_factory=dict)


class KernelEvidence(BaseModel):
    kernel: str
    shape: str = ""  # the recorded forward it was replayed on (Shape.label)
    predicted_bitexact: float
    naive_bitexact: float
    elements: int
    fp32_max_rel_error: float = 0.0
    explicit_roundings: list[str] = Field(default_factory=list)
    error: str = ""
    outputs: dict[str, str] = Field(default_factory=dict)  # stored buffer -> the FX node it holds (as replayed)
    per_output: dict[str, tuple[float, float]] = Field(default_factory=dict)  # low-precision store -> (pred, naive)
    note: str = ""  # how it was checked, where not by re-running its fragment ("a copy: ...")
    # Its row sums replayed in the order its code sums (graphdiff.replay.sum_order: lanes, then a halving tree);
    # 0: ATen's order. With the lanes, the same replay in ATen's order (the evidence for the order).
    reduction_lanes: int = 0
    aten_order_bitexact: float | None = None
    aten_order_fp32_error: float | None = None
    # a C++ kernel computing INDUCTOR_MATH ops (erf, cos, ...), replayed as predicted: the same replay with ATen's eager
    # math for them (below predicted_bitexact: the kernel computes them with Inductor's math; analysis.math_ops)
    aten_math_bitexact: float | None = None


class ScanResult(BaseModel):
    schema_version: int = SCHEMA_VERSION
    kind: Literal["graphdiff.scan"] = "graphdiff.scan"
    model: str
    architecture: str
    config_sha256: str = ""
    fingerprint: str = ""  # the checkpoint both sides ran (artifacts.model_fingerprint)
    scan_id: str = ""  # this scan's id: every other file of its directory records it
    config: dict[str, object] = Field(default_factory=dict)  # runtime.scanned_config of the scanned model
    versions: dict[str, str] = Field(default_factory=dict)
    layers_scanned: int
    layers_total: int
    prompt_tokens: list[int] = Field(default_factory=list)
    shapes: list[Shape] = Field(default_factory=list)  # the engine forwards analysed; the first is the trainer's
    engine_config: dict[str, object] = Field(default_factory=dict)  # the engine's effective compilation config
    # the engine's attention kernel as its capture reports it (Capture.attention: backend, isa, CPU kind, ops build)
    engine_attention: dict[str, str] = Field(default_factory=dict)
    engine_device: str = ""  # where the engine's tensors lived when recorded (Capture.device)
    # the engine's fused-MoE op as its graph calls it (analysis.moe.engine_experts_op): op, activation, isa,
    # padded_intermediate; what `patch --exact` runs in the trainer
    engine_experts: dict[str, str] = Field(default_factory=dict)
    # module pattern whose forward adds -> the bias-free linears (module patterns; [] unnamed) whose GEMM the engine
    # adds to another value inside one ATen addmm (analysis.moe.addmm_folds: `_C_AVX2`'s GEMMs are ATen's)
    addmm_folds: dict[str, list[str]] = Field(default_factory=dict)
    # a folded linear -> the linear whose GEMM output the engine's addmm adds it to (analysis.moe.addmm_biases)
    addmm_biases: dict[str, str] = Field(default_factory=dict)
    # the dtype of the table the engine's rotary embedding gathers cos/sin from by position (vLLM's `cos_sin_cache`)
    # where it is low precision (analysis.scan.rope_table_dtype); "" where the engine computes them in its graph
    engine_rope_table: str = ""
    compilation_config: dict[str, object] = Field(default_factory=dict)  # as asked (-O as "optimization_level")
    plan: list[Decision] = Field(default_factory=list)  # every trainer value decided on; codegen reads it
    sites: list[Site]
    regions: list[Region]
    replay: list[KernelEvidence]
    matched: int = 0
    unmatched_train: list[str] = Field(default_factory=list)
    unmatched_engine_kernels: list[str] = Field(default_factory=list)
    not_replayed: list[str] = Field(default_factory=list)  # "kernel @ shape: why", every generated kernel not replayed
    unexplained: list[str] = Field(default_factory=list)  # kernels replaying below 99.9% (their sites: unproven)
    unregistered_externs: list[str] = Field(default_factory=list)  # opaque engine ops no registry entry describes
    # engine parameters holding values that its compiled graphs never read (Capture.unread_params): a difference
    # in what is computed, not in rounding
    engine_unread: list[str] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    reproduce: str = ""
    notes: list[str] = Field(default_factory=list)
    kl: KLResult | None = None  # filled by `graphdiff kl` when run as part of a scan
    # Rounding non-uniformity (measure.uniformity), median over layers: per region, and for
    # ordinary outputs ("contrast: ...") of the same trainer graph.
    nonuniformity: dict[str, float] = Field(default_factory=dict)
    routing: list[RoutingAgreement] = Field(default_factory=list)  # MoE models: engine vs trainer expert choice
    departure: Departure | None = None  # where the trainer's values first differ from the engine's (first shape)
    # HF module -> the lanes its engine kernel sums the module's row sums/means in (an RMS norm's mean of squares), for
    # every module whose matched row reductions all sit in kernels of one such order, sites or not, and by name for a
    # module no value match pairs (the final norm after the engine's FP32 residual): a module with no site still sums
    # in another order than ATen's (codegen.norm_order makes it a region of its own)
    ordered_sums: dict[str, int] = Field(default_factory=dict)
    # HF modules whose engine norm kernel reads its input back from the BF16 copy it stored, after summing the mean
    # over the FP32 values it computed (sum_order.cpp_rereads_store)
    norm_rereads: list[str] = Field(default_factory=list)
    # HF modules whose engine norm kernel stores its input in BF16 in a loop nest that computes nothing else and reads
    # every pass from that copy, the mean too (reload.stored_alone: GPT-2's and OPT's last residual re-sum)
    norm_reads_stored: list[str] = Field(default_factory=list)
    # trainer residual adds whose sum the engine rounds (stores in BF16 for every consumer), and those it computes in
    # one kernel in FP32 and stores in BF16 for the kernels after it (scan.residual_sums)
    rounded_sums: list[str] = Field(default_factory=list)
    stored_sums: list[str] = Field(default_factory=list)
    # HF module -> its trainer ops (GELU, erf, cos, ...) whose engine values an Inductor kernel computes with Inductor's
    # math, not ATen's, with no rounding site (analysis.math_ops; codegen.math_order makes a region of each module)
    inductor_math: dict[str, list[str]] = Field(default_factory=dict)
