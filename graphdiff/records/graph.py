"""A captured graph, close to torch.fx: a list of nodes in topological order, each naming its inputs, plus what only
the engine has — the kernel partition Inductor chose (which FX nodes each generated kernel fuses, what it loads and
stores) — and the capture that holds one side's graphs of one model."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, Field, PrivateAttr, field_validator

from graphdiff.records.files import SCHEMA_VERSION, load_versioned
from graphdiff.sources import import_path

Side = Literal["train", "engine"]


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



def walk(starts: Iterable[str], step: Callable[[str], Iterable[str]], through: Callable[[str], bool] = lambda _: True,
         hops: int | None = None) -> Iterator[str]:
    """The nodes reached from `starts` along `step` (a node's inputs, or its users), breadth first, each once, nearest
    first; the starts themselves are not yielded. The walk goes on from every start, and from a reached node only where
    `through` holds; at most `hops` steps from the starts (None: no limit). Lazy: a caller may stop at what it seeks."""
    frontier = list(dict.fromkeys(starts))
    seen = set(frontier)
    while frontier and hops != 0:
        nxt = []
        for name in frontier:
            for other in step(name):
                if other not in seen:
                    seen.add(other)
                    yield other
                    if through(other):
                        nxt.append(other)
        frontier = nxt
        hops = None if hops is None else hops - 1

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


def load_capture(path: Path) -> Capture:
    return load_versioned(Capture, path / "capture.json" if path.is_dir() else path, "capture")


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
