"""The data model: the contract between capture, analysis, reports and codegen.

Everything persisted is one of these pydantic models, written as versioned JSON with a
JSON Schema under graphdiff/schemas/ (regenerate with `python -m graphdiff.schemas`).
A captured graph is deliberately close to torch.fx: a list of nodes in topological
order, each naming its inputs, plus what only the engine has — the kernel partition
Inductor chose (which FX nodes each generated kernel fuses, what it loads and stores).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypedDict, TypeVar, get_args

from pydantic import BaseModel, Field, PrivateAttr, field_validator

from graphdiff.errors import GraphdiffError
from graphdiff.sources import import_path

if TYPE_CHECKING:  # the kernel buffer records hold tensors; the data model itself needs no torch
    import torch

SCHEMA_VERSION = 2
M = TypeVar("M", bound=BaseModel)

Side = Literal["train", "engine"]


# the attention splice's form: attention as the registry says the engine computes it, or the engine's own op
AttentionForm = Literal["fp32", "engine"]

class Source(BaseModel):
    """Where a node came from in the user's (or library's) Python code. `file` is the file's import path
    (`transformers/models/qwen3/modeling_qwen3.py`), never the recording machine's absolute path: a recorded absolute
    path is cut to its import path as it is read (graphdiff.sources resolves it in the installed package)."""

    file: str
    line: int
    code: str = ""
    function: str = ""

    @field_validator("file")
    @classmethod
    def _import_path(cls, file: str) -> str:
        return import_path(file)


NodeOp = Literal["placeholder", "call_function", "get_attr", "output"]  # the torch.fx opcodes of an ATen graph
NODE_OPS: tuple[NodeOp, ...] = get_args(NodeOp)
Role = Literal["in", "out", "inout", "scalar"]  # how a kernel uses one of its arguments


class Node(BaseModel):
    """One value-producing operation (or placeholder/output), as in torch.fx."""

    name: str
    op: NodeOp
    target: str  # e.g. "aten.mul.Tensor", "prims.convert_element_type.default", "getitem"
    inputs: list[str] = Field(default_factory=list)  # names of node inputs, in argument order
    args: str = ""  # the full argument list, node inputs by name (human-readable, for reports)
    # [args, kwargs] as JSON: node refs {"node": n}, {"dtype": "float32"}, {"device": "cpu"},
    # {"sym": "s72"}, {"float": "inf"}, {"repr": ...}; enough to re-execute the node (replay).
    call: list = Field(default_factory=lambda: [[], {}])
    dtype: str | None = None  # "bfloat16", "float32", ... ; None for non-tensors / tuples
    shape: list[int | str] | None = None  # symbolic sizes as strings ("s72")
    sym: str | None = None  # for symbolic-int values (e.g. the token count placeholder): the symbol
    source: Source | None = None
    module: str | None = None  # nn.Module path, e.g. "model.layers.0.mlp"
    module_type: str | None = None  # class name of that module
    param: str | None = None  # parameter/buffer name for placeholders that hold weights
    kernel: str | None = None  # id of the engine kernel that computes this node
    decomposed_from: str | None = None  # the ATen op this node was decomposed from (engine), e.g. aten.silu.default


class BufferArg(BaseModel):
    """One argument of a kernel call: a buffer it reads and/or writes, or a scalar."""

    name: str  # buffer/graph-input name in the generated wrapper (buf3, arg2_1, s72)
    role: Role
    dtype: str | None = None  # element type the kernel reads/writes it as
    node: str | None = None  # FX node whose value the buffer holds, where known


class Kernel(BaseModel):
    """One kernel call in the engine's compiled code, in execution order."""

    id: str  # unique per call: "<kernel name>:<provenance handle>"
    name: str  # generated kernel name (shared by identical kernels in different layers)
    kind: Literal["generated", "extern"]
    nodes: list[str]  # FX nodes fused into this call (post-grad graph names)
    args: list[BufferArg] = Field(default_factory=list)
    code: str = ""  # generated kernel source (generated kernels only)


class PackedParam(BaseModel):
    """An engine parameter that packs several HF parameters (qkv_proj, gate_up_proj)."""

    engine: str  # e.g. "model.layers.0.self_attn.qkv_proj.weight"
    dim: int  # the dimension the HF tensors are concatenated along
    parts: list[tuple[str, int, int]]  # (hf name, start, stop) along `dim`


_LAYER = re.compile(r"\.(?:layers|h|blocks|layer)\.(\d+)(?:\.|$)")


def layer_of(module: str | None) -> int | None:
    """Decoder layer index in an HF module path ("model.layers.3.mlp" -> 3)."""
    m = _LAYER.search("." + (module or ""))
    return int(m.group(1)) if m else None


class Shape(BaseModel):
    """One forward the engine ran while it was captured: a prefill of a prompt, or a decode step of a batch."""

    label: str  # "prefill-16", "decode-8x64"
    phase: Literal["prefill", "decode"]
    tokens: int  # tokens in the forward (prefill: the prompt; decode: one per sequence)
    sequences: int = 1
    context: int = 0  # decode: tokens each sequence already holds in the KV cache
    prompts: list[list[int]] = Field(default_factory=list)  # the token ids that ran


class Graph(BaseModel):
    """One captured graph (the engine may compile several, split at attention)."""

    name: str
    nodes: list[Node]
    kernels: list[Kernel] = Field(default_factory=list)
    inputs: dict[str, str] = Field(default_factory=dict)  # placeholder -> model param/input name
    shapes: list[str] = Field(default_factory=list)  # labels of the recorded forwards that ran this graph

    _by_name: dict[str, Node] | None = PrivateAttr(default=None)
    _users: dict[str, list[str]] | None = PrivateAttr(default=None)
    _pos: dict[str, int] | None = PrivateAttr(default=None)
    _computed_in: tuple[int, dict[str, set[str]]] | None = PrivateAttr(default=None)

    def node_map(self) -> dict[str, Node]:
        """Nodes by name (cached: analyses look nodes up in loops over the whole graph)."""
        if self._by_name is None or len(self._by_name) != len(self.nodes):
            self._by_name = {n.name: n for n in self.nodes}
        return self._by_name

    def __eq__(self, other: object) -> bool:
        # The caches above are derived state: equality is about the graph itself.
        if not isinstance(other, Graph):
            return NotImplemented
        return (self.name, self.nodes, self.kernels, self.inputs, self.shapes) == (
            other.name, other.nodes, other.kernels, other.inputs, other.shapes)

    __hash__ = None  # type: ignore[assignment]  # unhashable (mutable, like every pydantic model)

    def position(self, name: str) -> int:
        """Index of a node in topological order."""
        if self._pos is None or len(self._pos) != len(self.nodes):
            self._pos = {n.name: i for i, n in enumerate(self.nodes)}
        return self._pos[name]

    def users(self) -> dict[str, list[str]]:
        """Names of the nodes that consume each node (cached)."""
        if self._users is None:
            users: dict[str, list[str]] = {}
            for n in self.nodes:
                for i in n.inputs:
                    users.setdefault(i, []).append(n.name)
            self._users = users
        return self._users

    def computed_in(self) -> dict[str, set[str]]:
        """Ids of the kernels computing each node (cached; Inductor may recompute a node in several kernels)."""
        if self._computed_in is None or self._computed_in[0] != len(self.kernels):
            out: dict[str, set[str]] = {}
            for k in self.kernels:
                for n in k.nodes:
                    out.setdefault(n, set()).add(k.id)
            self._computed_in = (len(self.kernels), out)
        return self._computed_in[1]


# Capture.attention's fact: torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction in the engine's process
# ("true" / "false"), whether cuBLAS may round a BF16 GEMM's partial sums; absent: not recorded (unknown)
MATMUL_REDUCED_FACT = "matmul_bf16_reduced_reduction"


class Capture(BaseModel):
    """What `graphdiff capture` writes: one side's graph(s) of one model."""

    schema_version: int = SCHEMA_VERSION
    kind: Literal["graphdiff.capture"] = "graphdiff.capture"
    side: Side
    engine: str  # "vllm", "hf" or "dump"
    model: str
    architecture: str
    dtype: str = "bfloat16"
    versions: dict[str, str] = Field(default_factory=dict)
    graphs: list[Graph]
    packed: list[PackedParam] = Field(default_factory=list)
    buffers_file: str | None = None  # torch.save file with real kernel inputs/outputs, per shape label
    config_sha256: str = ""  # of the model config the capture ran (scan --engine-dump checks it)
    fingerprint: str = ""  # the checkpoint it ran (artifacts.model_fingerprint: config + weights headers/sizes)
    scan_id: str = ""  # the scan it belongs to ("" when made on its own)
    prompt_tokens: list[int] = Field(default_factory=list)  # the first shape's prompt (the trainer's)
    shapes: list[Shape] = Field(default_factory=list)  # the recorded forwards, in order
    # engine: its effective compilation config (mode, splitting ops, custom ops, passes, -O level, compile sizes)
    engine_config: dict[str, object] = Field(default_factory=dict)
    # engine: the compilation config as asked (`-cc` JSON, -O as "optimization_level"): what starts the same engine
    # again (`scan --engine-dump` passes it on to the patch's measurement and to `kl`)
    compilation_config: dict[str, object] = Field(default_factory=dict)
    startup_s: float | None = None  # engine: how long its start-up (load + compile) took
    # engine: its attention kernel (opaque to the scan) and the facts its other opaque kernels are looked up by
    # (analysis.opaque), e.g. {"backend": "CPU_ATTN", "isa": "vec", "device": "cpu", "build": "_C", "cpu": ...};
    # on CUDA also MATMUL_REDUCED_FACT; no "device" recorded: a CPU capture
    attention: dict[str, str] = Field(default_factory=dict)
    # engine: parameters it loaded, holding values, that its compiled graphs never read (engine_model.unread_params)
    unread_params: list[str] = Field(default_factory=list)
    # engine: the weight its logits are computed with ("lm_head.weight", or "input embedding" where its model has
    # no LM head of its own); "" where not recorded
    logits_weight: str = ""
    # engine: the device its kernels' tensors lived on when recorded ("cpu", "cuda:0"); "" where not recorded. A fact
    # about the recording only: the analysis reads the buffers on the CPU, and a kernel's code decides its replay
    device: str = ""
    notes: list[str] = Field(default_factory=list)


def save_json(obj: BaseModel, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(obj.model_dump_json(indent=1))
    tmp.replace(path)  # never leave a half-written file behind
    return path


KIND_NAMES = {"graphdiff.capture": "capture", "graphdiff.scan": "scan", "graphdiff.kl": "kl result",
              "graphdiff.manifest": "patch manifest", "graphdiff.engine_samples": "engine samples file",
              "graphdiff.check": "check result"}
REMAKE = {"capture": "graphdiff capture", "scan": "graphdiff scan", "kl result": "graphdiff kl",
          "patch manifest": "graphdiff patch"}


def parse_versioned(cls: type[M], path: Path, what: str, version: int = SCHEMA_VERSION) -> M:
    """`path` read as a `cls`, or one GraphdiffError naming the file and the fix: unreadable, not JSON, another kind
    of graphdiff file, a newer or older schema, or the first field that does not validate."""
    from pydantic import ValidationError

    remake = REMAKE.get(what, "graphdiff")
    try:
        data = json.loads(path.read_bytes())
    except OSError as e:
        raise GraphdiffError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = f"{e.msg} at line {e.lineno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8 text"
        raise GraphdiffError(f"{path} is not valid JSON ({why}): regenerate it with `{remake}`") from None
    kind = cls.model_fields["kind"].default if "kind" in cls.model_fields else None
    found = data.get("kind") if isinstance(data, dict) else None
    if kind and found != kind:
        is_a = f"a graphdiff {KIND_NAMES[found]}" if found in KIND_NAMES else "not a graphdiff file"
        raise GraphdiffError(f"{path} is {is_a}, not a {what}: give the {what} (`{remake}` writes it)")
    got = data.get("schema_version", version)
    if isinstance(got, int) and got != version:
        how = "upgrade graphdiff" if got > version else f"regenerate it with `{remake}`"
        who = "a newer" if got > version else "an older"
        raise GraphdiffError(f"{path} is a {what} of schema {got}, written by {who} graphdiff (this one reads "
                             f"{version}): {how}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(map(str, err["loc"])) or "(top level)"
        raise GraphdiffError(f"{path} is not a valid {what}: field {field}: {err['msg']} "
                             f"(regenerate it with `{remake}`)") from None


def load_versioned(cls: type[M], path: Path, what: str) -> M:
    """A persisted model, or one clear GraphdiffError (missing, not valid, other kind or schema version)."""
    if not path.is_file():
        raise GraphdiffError(f"no {what} at {path}" if not path.is_dir() else f"{path} is a directory, not a {what}")
    return parse_versioned(cls, path, what)


def load_capture(path: Path) -> Capture:
    return load_versioned(Capture, path / "capture.json" if path.is_dir() else path, "capture")


# --- a capture's real kernel buffers (in memory, and DIR/buffers.pt), and progress messages -------------------

class WeightRef(TypedDict):
    """A large recorded kernel input, in buffers.pt, that the checkpoint holds under `weight` (resolved on load)."""

    weight: str
    shape: list[int]
    dtype: str  # "torch.bfloat16"


class _ExternCall(TypedDict):
    buffer: str  # the all-reduce's buffer in its graph
    partial: torch.Tensor  # the BF16 partial product it reduced (this rank's)
    reduced: torch.Tensor  # its output


class ExternRecord(_ExternCall, total=False):
    """A tensor-parallel all-reduce's recorded call (engines.vllm.tp_worker.extern_records)."""

    matmul: str  # kernel id of the matmul that wrote the partial
    matmul_input: torch.Tensor  # that matmul's input


# "in" is a keyword: the functional form. Written by capture.inductor_hooks.BufferRecorder, read by the replay.
_KernelCall = TypedDict("_KernelCall", {
    "in": "dict[str, torch.Tensor]",  # buffer -> the value it held before the call (loaded weights included)
    "out": "dict[str, torch.Tensor]",  # buffer -> the value the call stored
    "scalars": "dict[str, object]",  # non-tensor arguments (symbol values, sizes) by name
})


class KernelRecord(_KernelCall, total=False):
    """One kernel call's real buffers in a recorded forward."""

    extern: ExternRecord  # tensor-parallel capture: an all-reduce's call
    launch: dict[str, int]  # a Triton call's block sizes (XBLOCK, R0_BLOCK), where the recording knows them


Buffers = dict[str, dict[str, KernelRecord]]  # shape label -> kernel id -> that forward's record of the call
Progress = Callable[[str], None]  # a long step's one-line messages ("engine: compiling ...")


# --- scan results --------------------------------------------------------------------------------

# What a region of sites computes (analysis.plan.classify decides it), in the order reports list regions.
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


class RoutingAgreement(BaseModel):
    """MoE: how often the engine and the trainer choose different experts for the same token, in one layer."""

    layer: int
    shape: str  # the recorded shape (Shape.label) it was measured at
    tokens: int
    differing: int  # tokens whose set of top-k experts differs
    fraction: float
    trainer: str = "unpatched"  # the trainer compared: unpatched, or patched (kl: the manifest's regions)


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


class Departure(BaseModel):
    """The first matched trainer value (graph order) that is not bit-identical to its engine value, both in one
    dtype, on the scan's tokens: everything upstream of it is equal (graphdiff.analysis.departure)."""

    node: str
    op: str
    module: str | None = None
    layer: int | None = None
    dtype: str = ""
    engine_node: str
    engine_graph: str = ""
    kernel: str = ""  # the engine kernel (or extern) computing it
    differing: float  # fraction of its elements that differ
    first_row: int | None = None  # first differing row (token) of the trainer's value; None: layouts differ
    equal_before: int  # matched values before it that are bit-identical
    source: str = ""  # the trainer's source line
    # the compared (bit-identical) values it reads through uncompared ops, and those ops with it, in graph order:
    # where the difference arises; `cause` names the first of them that computes (not a view)
    inputs_agree: list[str] = Field(default_factory=list)
    cause_ops: list[str] = Field(default_factory=list)
    cause: str = ""


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
    # every module whose matched row reductions all sit in kernels of one such order, sites or not: a module with no
    # site still sums in another order than ATen's (codegen.norm_order makes it a region of its own)
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


# --- log-prob gap measurement (`graphdiff kl`) -------------------------------------------------------

EngineMode = Literal["compiled", "eager"]
TrainerMode = Literal["eager", "compiled", "engine-prefill"]  # engine-prefill: the engine scoring its own samples


class SampleAsk(BaseModel):
    """Seeded prompts the scan's engine samples after its capture (for the patch's gate and the gap): how many,
    how long, how many tokens each continues for."""

    count: int
    prompt_tokens: int
    max_tokens: int
    seed: int = 0
    temperature: float = 1.0


class SampleRequest(BaseModel):
    """What the engine's child process samples after its capture: the prompts themselves, and where the samples go
    (out_dir/engine_samples.json)."""

    prompts: list[list[int]]
    max_tokens: int
    seed: int
    temperature: float
    out_dir: str


class EngineSample(BaseModel):
    """One sampled continuation and the engine's own log-prob of each sampled token."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]  # FP32 values as the engine returned them (exact in JSON: Python floats round-trip)
    # the engine scoring the same prompt + tokens in one prefill (prompt_logprobs): its own decode/prefill floor
    prefill_logprobs: list[float] = Field(default_factory=list)
    # MoE: per layer, the top-k experts the engine chose for each token of prompt + tokens, scored in one prefill
    routing: dict[int, list[list[int]]] = Field(default_factory=dict)


class EngineSamples(BaseModel):
    """One engine configuration's samples, with everything that decides them (the cache key)."""

    engine: str = "vllm"
    mode: EngineMode
    model: str
    weights: str  # fingerprint of the checkpoint files (names, sizes, mtimes)
    seed: int
    temperature: float
    max_tokens: int
    versions: dict[str, str] = Field(default_factory=dict)
    compilation_config: dict[str, object] = Field(default_factory=dict)  # as given (compiled mode)
    tensor_parallel_size: int = 1  # the engine's ranks (their partial products are rounded before the all-reduce)
    samples: list[EngineSample]

    def key(self) -> tuple:
        """What decides the samples, the engine's version aside (compared separately: it may be absent)."""
        return (self.engine, self.mode, self.model, self.weights, self.seed, self.temperature, self.max_tokens,
                json.dumps(self.compilation_config, sort_keys=True), self.tensor_parallel_size,
                tuple(tuple(s.prompt) for s in self.samples))


class EngineSamplesFile(BaseModel):
    """DIR/engine_samples.json: the engine samples once; the trainer side can be re-run at will."""

    schema_version: int = SCHEMA_VERSION
    kind: Literal["graphdiff.engine_samples"] = "graphdiff.engine_samples"
    runs: list[EngineSamples] = Field(default_factory=list)


class PositionBin(BaseModel):
    """The gap over continuation positions [start, stop) (0 = the first sampled token)."""

    start: int
    stop: int
    tokens: int
    k1: float
    rms: float
    k3: float = 0.0
    bitexact_fraction: float = 0.0


class KLMeasurement(BaseModel):
    """The engine-vs-trainer gap of one configuration; diff = logp_engine - logp_train per sampled token."""

    engine_mode: EngineMode
    trainer_mode: TrainerMode
    regions: list[str] | None = None  # patched regions (None: unpatched trainer; [] never written)
    k1: float  # mean diff: the paper's per-token KL estimate
    k1_se: float | None = None  # its standard error, sequences as the independent units
    k3: float  # mean of exp(r) - 1 - r, r = -diff: unbiased, never negative per token
    k3_se: float | None = None  # its standard error, sequences as the independent units
    rms: float
    max_abs: float
    bitexact_fraction: float  # tokens whose FP32 log-probs agree bit for bit
    tokens: int
    sequences: int
    position: list[PositionBin] = Field(default_factory=list)
    label: str = ""  # what is compared, where it is not engine decode vs trainer (the floor)


GapName = Literal["attention order", "engine floor", "rest"]


class GapSource(BaseModel):
    """One named part of the patched gap, per position bucket: the mean square of diff it accounts for (the
    buckets of KLResult's measurements). Measured by substitution, not fitted."""

    name: GapName
    what: str  # how it is measured
    ms: list[float]  # per bucket, in diff^2 (rms^2 of the bucket); the parts add up to the patched ms
    share: list[float]  # ms / patched ms per bucket (0 where the patched ms is 0)


class ShapleyValue(BaseModel):
    region: str
    value: float  # gap reduction attributed to the region (same units as the metric)
    share: float | None = None  # value / full reduction (None when the full reduction is 0)
    ci_low: float
    ci_high: float


class Attribution(BaseModel):
    """Shapley attribution of the gap reduction to patched regions, with bootstrap CIs over sequences."""

    metric: str  # "k1" or "k3"
    regions: list[str]
    method: str  # "exact" (all 2^k subsets) or "sampled" (random permutations)
    permutations: int | None = None
    baseline: float  # gap with no region aligned
    aligned: float  # gap with every region aligned
    reduction: float  # baseline - aligned (= sum of the Shapley values)
    values: list[ShapleyValue]
    tokens: int
    sequences: int
    bootstrap: int
    confidence: float
    seed: int
    target: float  # fraction of `reduction` the minimal set must reach
    minimal_set: list[str] | None = None  # None when the full reduction is not positive
    minimal_set_reduction: float | None = None  # measured, not predicted
    minimal_set_method: str = ""
    subsets: dict[str, float] = Field(default_factory=dict)  # gap of every evaluated subset ("" = none)


class KLResult(BaseModel):
    """What `graphdiff kl` writes to DIR/kl.json."""

    schema_version: int = SCHEMA_VERSION
    kind: Literal["graphdiff.kl"] = "graphdiff.kl"
    model: str
    architecture: str
    fingerprint: str = ""  # the checkpoint measured (artifacts.model_fingerprint)
    scan_id: str = ""  # the scan it was measured for (`scan --kl`); "" for `graphdiff kl`
    engine: str = "vllm"
    versions: dict[str, str] = Field(default_factory=dict)
    seed: int
    temperature: float
    max_tokens: int
    prompts: int
    method: str  # exactly how each side's log-probs are computed
    measurements: list[KLMeasurement]
    # the engine's own floor: its decode log-probs vs its prefill scoring of the same sequences (compiled engine)
    floor: KLMeasurement | None = None
    # where the floor is not 0: the engine's ops probed for batch variance (measure.floor_ops), varying ones first
    floor_ops: list[str] = Field(default_factory=list)
    bucket: int = 128  # width of the position buckets (`position`) in tokens
    compilation_config: dict[str, object] = Field(default_factory=dict)  # the compiled engine's, as asked
    attribution: Attribution | None = None
    manifest: str | None = None  # the patch measured; `scan --kl`: relative to the scan directory
    # The patched trainer with the engine's own attention op (graphdiff.measure.engine_attention) and the patched
    # gap split into named sources by it; sources_note says why not, where they could not be measured
    engine_attention: KLMeasurement | None = None
    sources: list[GapSource] = Field(default_factory=list)
    sources_note: str = ""
    # regions the scan found that the patch does not apply ("name: why"): part of the patched gap, by name
    left_out: list[str] = Field(default_factory=list)
    # where the rest is over REST_LIMIT of the patched gap in some bucket: the patched trainer's first departure from
    # the engine on the scan's tokens (`scan --manifest` against the scan's engine capture), or why it is not known
    departure: Departure | None = None
    departure_note: str = ""
    # MoE: per layer, how often the eager trainer (unpatched, patched) chooses other experts than the compiled
    # engine on the samples' tokens (the engine's choices recorded while it scores each sample in one prefill)
    routing: list[RoutingAgreement] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    reproduce: str = ""
    notes: list[str] = Field(default_factory=list)


# --- the CI gate (`graphdiff check`) ------------------------------------------------------------------------

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

MANIFEST_VERSION = 4


class ManifestSplice(BaseModel):
    """One place the runtime changes the HF model: a module forward, a module-level function, a carry hook, the
    attention function (registered with transformers' AttentionInterface), or an nn.Linear computed as a
    tensor-parallel engine's ranks compute it (`linear`: K split over `shards` ranks)."""

    key: str  # module pattern (`model.layers.*.self_attn.q_norm`) or dotted function path
    target: Literal["module", "function", "carry", "attention", "router", "experts", "linear"]
    module: str  # HF module path pattern, layers collapsed as `layers.*`
    module_class: str = ""
    function: str = ""  # dotted path of the replaced function (target "function")
    regions: list[str]
    # What feeds each input of the generated function: "arg:0" / "arg:NAME" (the forward's or the function's
    # argument), "param:NAME" (a module attribute); and where each output goes in the HF return value.
    inputs: list[str] = Field(default_factory=list)
    outputs: list[int] = Field(default_factory=list)
    torch_fn: str = ""  # name in the generated module
    triton_fn: str = ""  # "" when no Triton kernel could be generated (see triton_problem)
    triton_problem: str = ""
    problems: list[str] = Field(default_factory=list)  # non-empty: not generated, the reasons
    # HF module -> the lanes its engine kernel sums rows in (Region.reduction_lanes); the runtime passes each
    # module's to the generated function, which sums the aligned regions' rows in that order
    reduction_lanes: dict[str, int] = Field(default_factory=dict)
    shards: int = 1  # target "linear": the engine's tensor-parallel ranks the matmul's K is split over
    # carry with torch_fn carry_fp32_rounded: child modules (paths relative to the module) that read the incoming
    # activation in FP32 while the module's own ops read it rounded (a piecewise engine's BF16 graph boundary)
    fp32_children: list[str] = Field(default_factory=list)
    # carry with torch_fn carry_fp32: child modules that read the incoming activation as the engine's stored BF16 copy
    # while the module's own ops read it in FP32 (OLMo 2's attention projections; carry_rounded_child)
    rounded_children: list[str] = Field(default_factory=list)
    # carry: child modules (paths relative to the module) whose output the module's own code scales before the
    # residual add; the engine fuses the scale into its FP32 sum, so the child's output reaches it in FP32
    fp32_outputs: list[str] = Field(default_factory=list)
    # carry: child module whose output the module's own code scales by a constant -> the child modules that read the
    # product (the first decoder layer reading the scaled embedding); the engine hands it on unrounded, so they get it
    # in FP32 (torch_fn carry_scaled: the module's only sites; its incoming activation is not carried)
    fp32_scaled: dict[str, list[str]] = Field(default_factory=dict)
    # carry: child module (path relative to the module) -> the decoder layers where the module's own residual add
    # of that child's output is rounded to BF16, as the engine stores that sum (the child's output may be held FP32)
    rounded_sums: dict[str, list[int]] = Field(default_factory=dict)
    # carry: child module -> the decoder layers where the module's own residual add of that child's output is stored
    # by the engine in BF16 for the kernels after it (its own kernel's norm reads it in FP32): later adds read it
    # rounded
    stored_sums: dict[str, list[int]] = Field(default_factory=dict)
    # the scanned decoder layers it serves, where its regions' layers run different rounding plans (one splice per
    # group of layers: first / middle / last, alternating types); [] = every layer the pattern matches
    layers: list[int] = Field(default_factory=list)
    # modules the generated function imports when it runs, beyond torch and transformers (the engine's own
    # attention op: vllm._custom_ops); runtime.apply refuses the splice where they are missing
    imports: list[str] = Field(default_factory=list)


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
    notes: list[str] = Field(default_factory=list)


def cut_layers(config: dict, layers: int | None) -> dict:
    """`config` with only its first `layers` decoder layers (unchanged when `layers` is None or not fewer).
    The patch runtime cuts a trainer's config the same way to compare it with the scanned one."""
    config = dict(config)
    old = int(config.get("num_hidden_layers", 0) or 0)
    if layers is None or not 1 <= layers < old:
        return config
    # Lists with one entry per layer (layer_types and the like) keep their first `layers` entries.
    config = {k: v[:layers] if isinstance(v, list) and len(v) == old else v for k, v in config.items()}
    config["num_hidden_layers"] = layers
    if isinstance(config.get("max_window_layers"), int):
        config["max_window_layers"] = min(config["max_window_layers"], layers)
    if isinstance(config.get("mlp_only_layers"), list):  # MoE: indices of dense layers
        config["mlp_only_layers"] = [i for i in config["mlp_only_layers"] if i < layers]
    return config
