"""scan dir -> DIR/graphdiff_patch.py + DIR/manifest.json (deterministic: same scan, same bytes).

Pipeline: regions of scan.json -> fragments of train.capture.json (cut.py) -> PyTorch code
(emit_torch.py) -> bindings to HF's arguments (binding.py: a function's found by running the HF function against the
emitted code with no region aligned, which must agree bit for bit, or the splice is refused) -> the PyTorch code and
Triton kernels (emit_triton.py) with the bound names (names.py) -> manifest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from graphdiff import sources
from graphdiff.analysis import moe_engine
from graphdiff.analysis.moe import trainer_folds
from graphdiff.analysis.opaque import engine_device, exp_polynomial, truncates_output
from graphdiff.artifacts import ScanDir
from graphdiff.codegen import (
    attention_order,
    attention_splice,
    binding,
    carry,
    closed_form,
    copy_reads,
    emit_torch,
    emit_triton,
    exact_ops,
    inductor_lowering,
    math_order,
    moe_order,
    names,
    norm_order,
    prelude,
    probes,
    tp_linear,
)
from graphdiff.codegen.cut import cut_fragments
from graphdiff.codegen.fragment import Carry, Fragment, region_slug
from graphdiff.errors import GraphdiffError
from graphdiff.records import (
    MANIFEST_VERSION,
    AttentionForm,
    AttentionSplice,
    CalledSplice,
    Capture,
    CarrySplice,
    FunctionSplice,
    Graph,
    Manifest,
    ManifestRegion,
    ManifestSplice,
    ModuleSplice,
    MoeSplice,
    Node,
    Region,
    ScanResult,
    save_json,
)
from graphdiff.runtime import TORCH_SDPA, module_regex

MODULE_FILE = "graphdiff_patch.py"
SDPA_FUNCTION = "transformers.integrations.sdpa_attention.sdpa_attention_forward"
SDPA_FILE = "sdpa_attention.py"  # where transformers' attention interface calls torch's sdpa


def load_scan_dir(scan_dir: Path) -> tuple[ScanResult, Capture]:
    """The scan and the trainer graph it was made on, or one error saying how to make them."""
    d = ScanDir(scan_dir)
    scan = d.load_scan()
    if not scan.config:
        raise GraphdiffError(f"{d.scan_json} records no model config (written by an older graphdiff): rescan with "
                             f"`{scan.reproduce or 'graphdiff scan MODEL --out ' + str(scan_dir)}`")
    return scan, d.load_train()


def _compile(lines: list[str], name: str) -> Callable[..., Any]:
    """The emitted function `name` (its lines), calling the prelude's real functions."""
    scope = prelude.namespace()
    exec(compile("\n".join(lines), f"<graphdiff:{name}>", "exec"), scope)  # noqa: S102 - the code we emitted
    return scope[name]


def _attention_splice(r: Region, nodes: dict[str, Node], site_node: dict[str, str],
                      engine: dict[str, str], form: AttentionForm) -> tuple[AttentionSplice, list]:
    """An attention region is one opaque op: the trainer's own sdpa, called the way the engine computes it (its
    output truncated where the engine's op stores it so), or (`form` "engine") the engine's own op forward."""
    site = next((nodes[site_node[i]] for i in r.sites if site_node.get(i) in nodes), None)
    site = site or attention_order.attention_node(list(nodes.values()), r)
    owner = (site.module_type if site else "") or ""
    splice = AttentionSplice(key="attention", module=r.module, module_class=owner, regions=[r.name],
                             function=SDPA_FUNCTION,
                             torch_fn=(attention_splice.attention_fp32_inputs_truncated if truncates_output(engine)
                                       else attention_splice.attention_fp32_inputs).__name__,
                             triton_problem="calls torch's sdpa on FP32 inputs")
    lines = ["", "", f"# attention: region {r.name}",
             "# the engine's attention op computes exp (a softcap's tanh) by vLLM CPU's AVX-512 polynomial",
             f"ENGINE_EXP = {exp_polynomial(engine)}",
             "# the attention gradients runtime.apply(attention_gradient=...) may ask (\"bf16\": the BF16 flash",
             "# kernel's backward at this forward's output and log-sum-exp, where torch's CPU flash kernel runs it)",
             f"ATTENTION_GRADIENTS = {attention_splice.ATTENTION_GRADIENTS!r}", "", "",
             *prelude.source(attention_splice.FP32_PARTS)]
    if form == "engine":
        splice.torch_fn, splice.imports = attention_splice.attention_engine_op.__name__, ["vllm._custom_ops"]
        splice.triton_problem = "runs the engine's own attention op (vLLM CPU)"
        refusal = exact_ops.not_emitted(engine_device(engine), "attention")
        if refusal:  # a CUDA engine: its attention op is named, not emitted
            splice.problems.append(refusal)
        elif engine.get("backend") != "CPU_ATTN":
            splice.problems.append(f"--attention engine runs vLLM CPU's attention op; this engine ran "
                                   f"{engine.get('backend') or 'an unrecorded attention backend'}")
        lines += ["", "", "# the engine's own attention op forward, FP32 attention's gradient backward",
                  "import warnings", "", f"KV_BLOCK = {attention_splice.KV_BLOCK}", "", "",
                  *prelude.source(attention_splice.ENGINE_PARTS)]
    # The runtime swaps the attention function transformers' attention interface dispatches to; a module whose
    # code calls torch's sdpa itself (FalconAttention) gets that call swapped while it runs, by the same function
    # (sdpa_call adapts the call).
    called_from = Path(site.source.file).name if site is not None and site.source is not None else ""
    if called_from and called_from != SDPA_FILE:
        splice.function = TORCH_SDPA
        lines += ["", "", f"# {owner or r.module} calls torch's sdpa in its own code ({called_from})",
                  *prelude.source((attention_splice.sdpa_call,))]
    return splice, lines


def _module_class(graph: Graph, pattern: str) -> str:
    """The class of the modules a `layers.*` pattern names, from the trainer graph."""
    rx = module_regex(pattern)
    return next((n.module_type for n in graph.nodes if n.module and rx.match(n.module) and n.module_type), "") or ""


def _moe_splice(r: Region, graph: Graph, engine_experts: dict[str, str] | None, device: str = "cpu") -> MoeSplice:
    """A router or experts region: the module's forward replaced by the engine's computation (analysis.moe_engine);
    with `engine_experts` (--exact: how the engine's graph called its fused-MoE op), the experts by that op, where
    `exact_ops` says the op on the engine's `device` is emitted."""
    target: Literal["router", "experts"] = "router" if r.kind == "router" else "experts"
    fn = moe_engine.ROUTER_FN if r.kind == "router" else moe_engine.EXPERTS_FN
    splice = MoeSplice(key=f"{target} {r.module}", target=target, module=r.module,
                       module_class=_module_class(graph, r.module), regions=[r.name], torch_fn=fn,
                       triton_problem="the engine's fused MoE computation, run with PyTorch ops")
    if engine_experts and engine_experts.get("router_gemm") and target == "router":
        splice.torch_fn, splice.imports = moe_engine.ENGINE_ROUTER_FN, ["vllm._custom_ops"]
        splice.triton_problem = "the module's own routing, its logits by the engine's own GEMM op (vLLM CPU)"
    if engine_experts is not None and target == "experts":
        splice.torch_fn, splice.imports = moe_engine.ENGINE_EXPERTS_FN, ["vllm._custom_ops"]
        splice.triton_problem = "runs the engine's own fused-MoE op (vLLM CPU)"
        refusal = exact_ops.not_emitted(device, "experts")
        if refusal:  # a CUDA engine: its fused-MoE op is named, not emitted
            splice.problems.append(refusal)
        elif not engine_experts:
            splice.problems.append("--exact runs the engine's fused-MoE op, and the scan records no `_C.cpu_fused_moe` "
                                   "call in the engine's graph (an engine that fuses its experts otherwise, or a scan "
                                   "older than this graphdiff: rescan)")
    return splice


def _emit_splice(frag: Fragment, nodes: dict[str, Node], tokens: int) -> tuple[ManifestSplice, list[str]]:
    """One splice point: its PyTorch function (bound against HF's own code) and, where possible, its Triton kernels."""
    slug = region_slug(frag.key.rsplit(".", 1)[-1] if frag.target == "function" else frag.key)
    splice = _fragment_splice(frag)
    if not isinstance(splice, CarrySplice):
        splice.fixed_inputs = {k: frag.fixed_inputs[i] for k, i in enumerate(frag.inputs) if i in frag.fixed_inputs}
    body: list[str] = []
    if isinstance(splice, CarrySplice):
        body += _carry_splice(frag, frag.carry or Carry(), splice) if not frag.problems else []
    elif not frag.problems:
        try:
            lines = emit_torch.emit_function(frag, f"torch_{slug}", nodes)
        except emit_torch.Unsupported as e:
            frag.problems.append(f"PyTorch emitter: {e}")
        else:
            frag.compiled = _compile(lines, f"torch_{slug}")
            splice.torch_fn = f"torch_{slug}"
            frag.problems += list(filter(None, [probes.other_length_problem(frag, nodes, tokens)]))
            binding.bind(frag, splice, nodes)
            if not frag.problems:
                # named by role: a function's arguments by the HF parameters the binding found
                values = names.value_names(frag, binding.argument_names(frag, splice))
                lines = emit_torch.emit_function(frag, f"torch_{slug}", nodes, values)
                frag.compiled = _compile(lines, f"torch_{slug}")
                body += ["", "", f"# {frag.target} {frag.key}: regions {', '.join(frag.regions)}", *lines]
                body += _closed_form_backward(frag, splice, slug, nodes, values)
                kernel = ("its norm reads its input back rounded from the engine's store after the mean (PyTorch "
                          "only)" if emit_torch.store_readers(frag, nodes) else
                          "it rounds where its input's dtype at run time says (PyTorch only)" if frag.input_rounds else
                          "it reads an input as the engine's stored copy where another reader holds it FP32 (PyTorch "
                          "only)" if frag.rounded_reads else emit_triton.emit(frag, slug, nodes,
                                                                                               values))
                if isinstance(kernel, str):
                    splice.triton_problem = kernel
                else:
                    body += ["", "", "if triton is not None:", "", *kernel]
                    splice.triton_fn = f"triton_{slug}"
    splice.problems = list(frag.problems)
    return splice, body


def _closed_form_backward(frag: Fragment, splice: ModuleSplice | FunctionSplice, slug: str, nodes: dict[str, Node],
                          values: dict[str, str]) -> list[str]:
    """The lines of the splice's closed-form gradient where its fragment has one (an RMS norm, a one-op activation, a
    rotary embedding) and it checks out against autograd through the emitted function (`splice.torch_backward` names
    it, with what it reads and differentiates); else none."""
    form = closed_form.recognise(frag, nodes)
    if form is None or frag.compiled is None:
        return []
    name = f"torch_{slug}_backward"
    lines = closed_form.emit(frag, form, name, splice.torch_fn, values)
    why = closed_form.check(frag.compiled, _compile(lines, name), frag, nodes, form)
    if why:
        frag.notes.append(f"autograd differentiates {splice.torch_fn}: {why}")
        return []
    splice.torch_backward = name
    splice.torch_backward_reads, splice.torch_backward_grads = closed_form.saved(frag, form)
    return ["", "", *lines]


def _fragment_splice(frag: Fragment) -> ModuleSplice | FunctionSplice | CarrySplice:
    """The splice record of a fragment's target, with its key, module, regions and layers."""
    if frag.target == "carry":
        return CarrySplice(key=frag.key, module=frag.module, module_class=frag.module_class, regions=frag.regions,
                           layers=frag.layers)
    if frag.target == "function":
        return FunctionSplice(key=frag.key, module=frag.module, module_class=frag.module_class, regions=frag.regions,
                              layers=frag.layers, function=frag.function, reduction_lanes=frag.lanes)
    return ModuleSplice(key=frag.key, module=frag.module, module_class=frag.module_class, regions=frag.regions,
                        layers=frag.layers, reduction_lanes=frag.lanes)


def _carry_splice(frag: Fragment, held: Carry, splice: CarrySplice) -> list[str]:
    """A carry splice's fields from its fragment's carry, and the comments (and helpers) its module lines get."""
    body: list[str] = []
    splice.torch_fn = ("carry_scaled" if not held.input else
                       "carry_fp32_rounded" if held.rounded else "carry_fp32")
    splice.fp32_children = list(held.fp32_children)
    splice.rounded_children = list(held.rounded_children) if splice.torch_fn == "carry_fp32" else []
    splice.fp32_outputs = list(held.fp32_outputs)
    splice.fp32_scaled = {c: list(r) for c, r in held.fp32_scaled.items()}
    splice.rounded_sums = dict(held.rounded_sums)
    splice.stored_sums = dict(held.stored_sums)
    if held.rounded:
        body += ["", "", f"# carry {frag.key}: regions {', '.join(frag.regions)}; FP32 for "
                 f"{', '.join(held.fp32_children) or 'no child'}, rounded for the module's own ops",
                 *prelude.source(carry.ROUNDED_PARTS)]
    if splice.rounded_children:
        body += ["", "", f"# carry {frag.key}: regions {', '.join(frag.regions)}; FP32 for the module's own ops, "
                 f"the stored BF16 copy for {', '.join(splice.rounded_children)}",
                 *prelude.source(carry.HELD_PARTS)]
    for sums, what in ((held.rounded_sums, "rounded to BF16, where the engine stores it"),
                       (held.stored_sums, "read rounded by the layer's later adds (the engine's stored copy)")):
        if sums:
            where = "; ".join(f"{c} in layers {', '.join(map(str, ls))}" for c, ls in sums.items())
            body += ["", "", f"# carry {frag.key}: the residual sum of {where} {what} (carry_round_sums, below)"]
    return body


@dataclass
class _Parts:
    """What a patch collects: the module's body lines, its splices, and each region's problems ('': generated)."""

    body: list[str] = field(default_factory=list)
    splices: list[ManifestSplice] = field(default_factory=list)
    status: dict[str, str] = field(default_factory=dict)


def _wanted(scan: ScanResult, regions: list[str] | None, more: list[Region]) -> list[Region]:
    """The scan's regions and `more` named in `regions` (default all), or one error naming the unknown ones."""
    every = [*scan.regions, *more]
    if regions is not None:
        unknown = sorted(set(regions) - {r.name for r in every})
        if unknown:
            known = ", ".join(r.name for r in every)
            raise GraphdiffError(f"no region {', '.join(unknown)} in the scan; regions: {known}")
    return [r for r in every if regions is None or r.name in regions]


def _add_opaque(parts: _Parts, scan: ScanResult, graph: Graph, wanted: list[Region],
                attention: AttentionForm, exact: bool) -> None:
    """The splices that replace a whole op or module: attention, MoE routing and experts, tensor-parallel linears."""
    nodes = graph.node_map()
    site_node = {s.id: s.train.node for s in scan.sites}
    for r in (r for r in wanted if r.kind == "attention"):
        splice, lines = _attention_splice(r, nodes, site_node, scan.engine_attention, attention)
        parts.splices.append(splice)
        parts.body += lines if not splice.problems else []
        parts.status[r.name] = "; ".join(splice.problems)
    moe_regions = [r for r in wanted if r.kind in ("router", "expert_combine")]
    device = engine_device(scan.engine_attention)
    moe = [_moe_splice(r, graph, scan.engine_experts if exact else None, device) for r in moe_regions]
    parts.splices += moe
    parts.status.update({s.regions[0]: "; ".join(s.problems) for s in moe if s.problems})
    engine_experts = any(s.torch_fn == moe_engine.ENGINE_EXPERTS_FN and not s.problems for s in moe)
    engine_router = any(s.torch_fn == moe_engine.ENGINE_ROUTER_FN and not s.problems for s in moe)
    if moe_regions:  # the one-output linears by the engine's GEMM only beside the engine's experts op
        constants = scan.engine_experts if engine_experts else {**scan.engine_experts, "one_output_gemm": ""}
        parts.body += ["", "", "# MoE: routing and experts as the engine computes them (graphdiff.analysis.moe_engine)",
                       *moe_engine.moe_constants(constants), "", "",
                       *prelude.source(moe_engine.PATCH_PARTS)]
    if engine_experts:
        parts.body += ["", "", "# the engine's own fused-MoE op forward, the same computation's gradient backward",
                       *prelude.source(moe_engine.ENGINE_PARTS)]
    if engine_router or engine_experts:
        parts.body += ["", "", "# the engine's own GEMM op forward (a router's FP32 logits, the block's one-output "
                       "linears), the linear's gradient backward", *prelude.source(moe_engine.GEMM_PARTS)]
    if engine_router:
        parts.body += ["", "", *prelude.source(moe_engine.ROUTER_GEMM_PARTS)]
    if engine_experts:
        parts.body += ["", "", *prelude.source(moe_engine.LINEAR_PARTS)]
    if scan.addmm_folds or (moe_regions and scan.engine_experts.get("addmm_combine")):
        folds = trainer_folds(scan.addmm_folds, graph)
        parts.body += ["", "", "# where the engine adds a linear's GEMM to another value in one addmm: the module "
                       "pattern whose forward adds -> the linears folded there", f"ADDMM_FOLDS = {folds!r}",
                       "# a folded linear -> the linear whose output the engine adds it to, where that is another's",
                       f"ADDMM_BIASES = {scan.addmm_biases!r}", "", "",
                       *prelude.source(moe_engine.ADDMM_PARTS)]
    for r in (r for r in wanted if r.kind == "allreduce"):
        linear, lines = tp_linear.allreduce_splice(r, nodes, site_node, tp_linear.shards_of(scan.engine_config),
                                                   scan.engine_attention.get("build", ""))
        if not linear.problems and not any(s.target == "linear" and not s.problems for s in parts.splices):
            parts.body += lines  # one function serves every linear splice
        parts.splices.append(linear)
        parts.status[r.name] = "; ".join(linear.problems)


def _add_fragments(parts: _Parts, frags: list[Fragment], nodes: dict[str, Node], tokens: int) -> None:
    """The splices emitted from the trainer graph's fragments: PyTorch and Triton code, and carry hooks; `tokens`:
    the trainer capture's token count (each emitted function is also run at another)."""
    for frag in frags:
        splice, lines = _emit_splice(frag, nodes, tokens)
        parts.splices.append(splice)
        parts.body += lines
    if any(isinstance(s, CalledSplice) and s.torch_backward for s in parts.splices):
        parts.body += ["", "", "# closed-form gradients (the *_backward functions above)",
                       *prelude.source(closed_form.PARTS)]
    carries = [f.carry for f in frags if f.carry is not None and not f.problems]
    if any(c.rounded_sums or c.stored_sums for c in carries):
        parts.body += ["", "", *prelude.source(carry.SUM_PARTS)]
    if any(c.fp32_scaled for c in carries):
        parts.body += ["", "", "# carry: a child's output scaled by its parent's code, handed to its readers in FP32",
                       *prelude.source(carry.SCALED_PARTS)]
    for frag in frags:
        for r in frag.regions:  # a region is generated when every group of its layers is
            parts.status.setdefault(r, "")
            if frag.problems:
                where = f"layers {','.join(map(str, frag.layers))}: " if frag.layers else ""
                parts.status[r] = "; ".join(filter(None, [parts.status[r], where + "; ".join(frag.problems)]))


def _manifest(scan: ScanResult, wanted: list[Region], parts: _Parts, frags: list[Fragment],
              source: str) -> Manifest:
    """manifest.json: what the scan was made on, each region's splices (or why it has none), the module's hash."""
    splices, status = parts.splices, parts.status
    return Manifest(
        schema_version=MANIFEST_VERSION, model=scan.model, architecture=scan.architecture,
        config_sha256=scan.config_sha256, fingerprint=scan.fingerprint, scan_id=scan.scan_id,
        config=scan.config, layers_scanned=scan.layers_scanned,
        versions=scan.versions, compilation_config=scan.compilation_config, engine_config=scan.engine_config,
        shapes=[s.label for s in scan.shapes], scan_command=scan.reproduce,
        module_file=MODULE_FILE, module_sha256=hashlib.sha256(source.encode()).hexdigest(),
        regions=[ManifestRegion(name=r.name, kind=r.kind, module=r.module, layers=r.layers, sites=r.sites,
                                splices=[s.key for s in splices if r.name in s.regions and not s.problems],
                                layer_groups=[s.layers for s in splices if r.name in s.regions and s.layers],
                                generated=not status.get(r.name), reason=status.get(r.name, ""),
                                shapes=r.shapes if r.shape_dependent else [])
                 for r in wanted],
        splices=splices,
        replaced=sorted({(s.function if isinstance(s, FunctionSplice | AttentionSplice) else "") or s.module_class
                         for s in splices if not s.problems}),
        notes=[note for f in frags for note in f.notes] + shape_notes(wanted, [s.label for s in scan.shapes]),
    )


@dataclass
class Patch:
    """A generated patch: the module's source and the manifest that names its splices (written by `write_patch`)."""

    manifest: Manifest
    module: str


def make_patch(scan: ScanResult, train: Capture, regions: list[str] | None = None,
               attention: AttentionForm = "fp32", exact: bool = False) -> Patch:
    """The patch of `scan` made on the trainer graph `train` (its `regions`, default all); `attention`: the attention
    splice computes as the registry says the engine does ("fp32"), or runs the engine's own op ("engine"); `exact`:
    every splice whose forward no rounding plan can make equal runs the engine's own op (attention, the fused MoE),
    with the exact gradient of the same computation by recompute backward."""
    if exact:
        attention = "engine"
    graph = train.graphs[0]
    scan = norm_order.with_order_regions(scan, graph)  # norms with no site that the engine sums in its own order
    scan = math_order.with_math_regions(scan, graph)  # ops with no site the engine computes by Inductor's math
    scan = copy_reads.with_copy_regions(scan, graph)  # helpers that read the engine's stored copy of an FP32 value
    # the engine's attention op also where it rounds as sdpa does (no site): its key order is still its own
    more = attention_order.order_regions(scan, graph) if attention == "engine" else []
    if exact:
        more += moe_order.router_regions(scan, graph) + moe_order.experts_regions(scan, graph)
    wanted = _wanted(scan, regions, more)
    parts = _Parts()
    _add_opaque(parts, scan, graph, wanted, attention, exact)
    # every attention splice reads q, k and v as the engine stores them (rounding an FP32 one): they may reach it FP32
    stored_in = frozenset(r for s in parts.splices if s.target == "attention" and not s.problems for r in s.regions)
    experts = {s.module: s.regions[0] for s in parts.splices if s.target == "experts" and not s.problems}
    frags = cut_fragments(scan, graph, [r.name for r in wanted], stored_in, experts)
    for frag in frags:  # a splice bound against the installed code's lines: they must be the recorded ones
        files = {n.source.file for n in frag.nodes if n.source is not None}
        frag.problems += sorted(filter(None, (sources.version_mismatch(f, train.versions) for f in files)))
    _add_fragments(parts, frags, graph.node_map(), len(train.prompt_tokens))
    source = render_module(scan, parts.body, any(s.triton_fn for s in parts.splices))
    manifest = _manifest(scan, wanted, parts, frags, source)
    manifest.exact = exact
    return Patch(manifest, source)


def write_patch(patch: Patch, out_dir: Path) -> Manifest:
    """The patch directory: the generated module and manifest.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MODULE_FILE).write_text(patch.module)
    save_json(patch.manifest, out_dir / "manifest.json")
    return patch.manifest


def generate(scan_dir: Path, out_dir: Path, regions: list[str] | None = None,
             attention: AttentionForm = "fp32", exact: bool = False) -> Manifest:
    """The patch of the scan in `scan_dir` (`make_patch`) written into `out_dir`."""
    return write_patch(make_patch(*load_scan_dir(scan_dir), regions, attention, exact), out_dir)


def shape_notes(regions: list[Region], shapes: list[str]) -> list[str]:
    """What a shape-dependent region's code is right for: it rounds at the union of its sites."""
    return [f"{r.name}: its sites differ by shape (sites at {', '.join(r.shapes)} of {', '.join(shapes)}); the code "
            "rounds at the union of them, the engine's rounding at those shapes only" for r in regions
            if r.shape_dependent]


def render_module(scan: ScanResult, body: list[str], triton: bool) -> str:
    head = [
        f'"""Generated by graphdiff from the scan of {scan.model} ({scan.architecture}); do not edit.',
        "",
        "Each region: a plain PyTorch function (every op in FP32, `_round` only where the engine stores low",
        "precision) and, where the fragment allows it, Triton kernels for forward and backward doing the same in",
        "registers. `align` names the regions whose sites stay FP32; the others round where HF eager does.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import os",
        "",
        "import torch",
        "import torch.nn.functional as F",
        "import torch.utils.checkpoint",
        "",
        *prelude.source(prelude.PARTS),
        "",
        "",
        *prelude.source((carry.carry_fp32, carry.carry_fp32_output)),
    ]
    if triton:
        head += ["", "", f"# Triton kernels' math: {inductor_lowering.source()}", emit_triton.PRELUDE.strip("\n")]
    return "\n".join(head + body) + "\n"
