"""scan dir -> DIR/graphdiff_patch.py + DIR/manifest.json (deterministic: same scan, same bytes).

Pipeline: regions of scan.json -> fragments of train.capture.json (fragment.py) -> PyTorch code
(emit_torch.py) -> function bindings found by running the HF function against the emitted code with
no region aligned (must agree bit for bit, or the splice is refused) -> the PyTorch code and Triton
kernels (emit_triton.py) with the bound names (names.py) -> manifest.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from graphdiff import sources
from graphdiff.analysis import moe_engine
from graphdiff.analysis.opaque import engine_device, exp_polynomial, truncates_output
from graphdiff.artifacts import ScanDir
from graphdiff.codegen import (
    attention_order,
    attention_splice,
    carry,
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
    tp_linear,
)
from graphdiff.codegen.fragment import Fragment, cut_fragments, region_slug
from graphdiff.errors import GraphdiffError, first_line
from graphdiff.records import (
    MANIFEST_VERSION,
    AttentionForm,
    Capture,
    Graph,
    Manifest,
    ManifestRegion,
    ManifestSplice,
    Node,
    Region,
    ScanResult,
    save_json,
    walk,
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


def _probe_shape(node: Node, tokens: int = 0, other: int = 0, outer_only: bool = False) -> list[int]:
    """The node's captured shape (a symbolic size as 8), with the captured token count `tokens` made `other`:
    every size equal to it, or (`outer_only`) the outermost one only."""
    shape = [s if isinstance(s, int) else 8 for s in (node.shape or [])]
    hits = [k for k, s in enumerate(shape) if tokens and s == tokens][:1 if outer_only else None]
    return [other if k in hits else s for k, s in enumerate(shape)]


def _probe(node: Node, gen: torch.Generator, tokens: int = 0, other: int = 0, outer_only: bool = False
           ) -> torch.Tensor:
    shape = _probe_shape(node, tokens, other, outer_only)
    return torch.randn(shape, generator=gen).to(getattr(torch, node.dtype or "float32"))


def bind_function(frag: Fragment, fn: Callable[..., Any], nodes: dict[str, Node]) -> tuple[list[str], list[int]] | str:
    """Which HF parameter feeds each fragment input, which returned value each output is: found by running
    the HF function and the emitted HF-plan code on the same probe tensors (bit-identical, or no binding)."""
    positional = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    params = [p.name for p in positional]
    if len(params) < len(frag.inputs):
        return f"{frag.function} takes {len(params)} positional parameters, the fragment reads {len(frag.inputs)}"
    if not callable(frag.compiled):
        return f"{frag.key}: no emitted function to bind"
    rest = _settings(positional[len(frag.inputs):])
    if isinstance(rest, str):
        return f"{frag.function} also needs {rest}, which no tensor of the fragment is"
    gen = torch.Generator().manual_seed(0)
    probes = [_probe(nodes[i], gen) for i in frag.inputs]
    ours = frag.compiled(*probes, align=frozenset())
    found = []
    for perm in itertools.permutations(range(len(frag.inputs))):  # perm[k]: HF parameter index of input k
        args: list[torch.Tensor | None] = [None] * len(frag.inputs)
        for k, p in enumerate(perm):
            args[p] = probes[k]
        outs = _outputs_reproduced(fn, args, rest, ours)
        if outs is not None:
            found.append(([params[p] for p in perm], outs))
    if found:  # a commutative op binds either way: the one its source line names wins (`residual + out`)
        return max(found, key=lambda f: _named_operands(frag, f[0]))
    return f"no assignment of {frag.function}'s parameters reproduces it bit for bit with the emitted code"


_SETTINGS = {"float": 0.0, "int": 0, "bool": False}  # a setting's value under which the trainer graph was traced


def _settings(params: list[inspect.Parameter]) -> dict[str, Any] | str:
    """Values for a function's parameters after the fragment's tensors that have no default: each a setting its
    annotation says is a float, int or bool (`dropout_add`'s `prob: float, training: bool`), given the value under
    which the trainer graph was traced, in eval mode (0, False: no dropout, as the graph has none); or the first
    parameter that is not such a setting."""
    out: dict[str, Any] = {}
    for p in params:
        if p.default is not p.empty:
            continue
        kind = p.annotation if isinstance(p.annotation, str) else getattr(p.annotation, "__name__", "")
        if kind not in _SETTINGS:
            return f"its parameter {p.name}"
        out[p.name] = _SETTINGS[kind]
    return out


def _outputs_reproduced(fn: Callable[..., Any], args: list, rest: dict[str, Any],
                        ours: tuple) -> list[int] | None:
    """Which returned value of `fn(*args, **rest)` each of `ours` is, bit for bit; None where one is not."""
    try:
        with torch.no_grad():
            theirs = fn(*args, **rest)
    except Exception:  # a wrong assignment fails to broadcast: try the next one
        return None
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    outs: list[int] = []
    for o in ours:
        hit = [j for j, t in enumerate(theirs) if isinstance(t, torch.Tensor) and t.shape == o.shape
               and t.dtype == o.dtype and torch.equal(t, o) and j not in outs]
        if not hit:
            return None
        outs.append(hit[0])
    return outs


def _named_operands(frag: Fragment, bound: list[str]) -> int:
    """How many fragment inputs an op reads as an operand its source line names by the parameter bound to it (`out =
    residual + out`: the add's first operand is `residual`)."""
    score = 0
    for n in frag.nodes:
        try:
            expr = ast.parse(n.source.code.strip()).body[0] if n.source is not None else None
        except (SyntaxError, IndexError):
            continue
        value = getattr(expr, "value", None)
        if not isinstance(value, ast.BinOp):
            continue
        operands = [o.id if isinstance(o, ast.Name) else "" for o in (value.left, value.right)]
        for j, a in enumerate(n.call[0][:2]):
            k = frag.inputs.index(a["node"]) if isinstance(a, dict) and a.get("node") in frag.inputs else -1
            score += int(k >= 0 and operands[j] == bound[k])
    return score


def other_length_problem(frag: Fragment, nodes: dict[str, Node], tokens: int) -> str:
    """The emitted code run at another token count than the captured one: it must run and give each output its
    captured shape with that count (a size baked in from the capture fails here); "" when it does. A feature size
    that equals the captured count (GPT-NeoX's rotary dimension 16 at 16 tokens) makes the probe ambiguous: the
    code passes if it runs with every such size changed, or with only each input's outermost one."""
    if tokens < 2 or frag.compiled is None:  # one token, or nothing emitted: nothing to run at another count
        return ""
    problems = [_at_other_length(frag, nodes, tokens, outer_only) for outer_only in (False, True)]
    return "" if "" in problems else problems[0]


def _at_other_length(frag: Fragment, nodes: dict[str, Node], tokens: int, outer_only: bool) -> str:
    assert frag.compiled is not None
    other = tokens + 5
    gen = torch.Generator().manual_seed(1)
    # a parameter or buffer keeps its size (Phi's tiny inv_freq has 16 entries, as the captured prompt has tokens)
    probes = [_probe(nodes[i], gen, *((tokens, other, outer_only) if nodes[i].param is None else ()))
              for i in frag.inputs]
    try:
        with torch.no_grad():
            outs = frag.compiled(*probes, align=frozenset(frag.regions))
    except Exception as e:  # the emitted code's own failure at that size is the finding
        return f"the emitted code does not run at {other} tokens (captured at {tokens}): {first_line(e)[:120]}"
    for o, name in zip(outs, frag.outputs):
        if not _follows(list(o.shape), _probe_shape(nodes[name]), tokens, other):
            return (f"the emitted code gives {name} the shape {list(o.shape)} at {other} tokens, not "
                    f"{_probe_shape(nodes[name], tokens, other)}: a size of the capture is baked in")
    return ""


def _follows(shape: list[int], captured: list[int], tokens: int, other: int) -> bool:
    """Is `shape` the `captured` shape at `other` tokens? Each size the captured count is follows the count or, a
    feature size that happens to equal it (GPT-NeoX's rotary dimension 16 at 16 tokens), keeps it; one follows."""
    if len(shape) != len(captured):
        return False
    same = all(s == c or (c == tokens and s == other) for s, c in zip(shape, captured))
    return same and (tokens not in captured or other in shape)


def _compile(lines: list[str], name: str) -> Callable[..., Any]:
    """The emitted function `name` (its lines), calling the prelude's real functions."""
    scope = prelude.namespace()
    exec(compile("\n".join(lines), f"<graphdiff:{name}>", "exec"), scope)  # noqa: S102 - the code we emitted
    return scope[name]


def _attention_splice(r: Region, nodes: dict[str, Node], site_node: dict[str, str],
                      engine: dict[str, str], form: AttentionForm) -> tuple[ManifestSplice, list]:
    """An attention region is one opaque op: the trainer's own sdpa, called the way the engine computes it (its
    output truncated where the engine's op stores it so), or (`form` "engine") the engine's own op forward."""
    site = next((nodes[site_node[i]] for i in r.sites if site_node.get(i) in nodes), None)
    site = site or attention_order.attention_node(list(nodes.values()), r)
    owner = (site.module_type if site else "") or ""
    splice = ManifestSplice(key="attention", target="attention", module=r.module, module_class=owner,
                            regions=[r.name], function=SDPA_FUNCTION,
                            torch_fn=(attention_splice.attention_fp32_inputs_truncated if truncates_output(engine)
                                      else attention_splice.attention_fp32_inputs).__name__,
                            triton_problem="calls torch's sdpa on FP32 inputs")
    lines = ["", "", f"# attention: region {r.name}",
             "# the engine's attention op computes exp (a softcap's tanh) by vLLM CPU's AVX-512 polynomial",
             f"ENGINE_EXP = {exp_polynomial(engine)}", "", "", *prelude.source(attention_splice.FP32_PARTS)]
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


def _moe_splice(r: Region, graph: Graph, engine_experts: dict[str, str] | None, device: str = "cpu") -> ManifestSplice:
    """A router or experts region: the module's forward replaced by the engine's computation (analysis.moe_engine);
    with `engine_experts` (--exact: how the engine's graph called its fused-MoE op), the experts by that op, where
    `exact_ops` says the op on the engine's `device` is emitted."""
    target: Literal["router", "experts"] = "router" if r.kind == "router" else "experts"
    fn = moe_engine.ROUTER_FN if r.kind == "router" else moe_engine.EXPERTS_FN
    splice = ManifestSplice(key=f"{target} {r.module}", target=target, module=r.module,
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


METADATA = frozenset({"dtype", "device", "shape", "ndim"})  # attributes that read a tensor's metadata, not its values


def _forward_def(frag: Fragment) -> ast.FunctionDef | None:
    """The module's `forward` as written: the definition in its installed source file holding the fragment's
    lines."""
    src = next((n.source for n in frag.nodes if n.source is not None and n.source.function == "forward"), None)
    if src is None:
        return None
    tree = sources.parse_source(src.file)  # the installed package's file, found by module
    if tree is None:
        return None
    return next((f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "forward"
                 and f.lineno <= src.line <= (f.end_lineno or f.lineno)), None)


def _spans(node: ast.stmt, line: int) -> bool:
    return node.lineno <= line <= (node.end_lineno or node.lineno)


def _statement(fn: ast.FunctionDef, line: int) -> ast.stmt | None:
    """The innermost statement of `fn` on source line `line`."""
    found = [s for s in ast.walk(fn) if isinstance(s, ast.stmt) and s is not fn and _spans(s, line)]
    return min(found, key=lambda s: (s.end_lineno or s.lineno) - s.lineno, default=None)


def _values_read(tree: ast.AST) -> set[str]:
    """The names whose values `tree` reads: every name it loads but those it reads only metadata of (`x.dtype`)."""
    meta = {id(a.value) for a in ast.walk(tree) if isinstance(a, ast.Attribute) and a.attr in METADATA}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
            and id(n) not in meta}


def _module_argument(frag: Fragment, fn: ast.FunctionDef) -> str:
    """The forward parameter the activation input is: the one parameter whose values the lines reading it read
    (a rotary embedding's `position_ids`, beside an `x` it reads only the dtype of); "0", the first parameter (as
    for a norm's `hidden_states`), where that is the first or not one parameter."""
    params = [a.arg for a in (fn.args.posonlyargs + fn.args.args)[1:]]
    act = next(i for i in frag.inputs if i not in frag.params)
    read: set[str] = set()
    for n in frag.nodes:
        if act in n.inputs and n.source is not None and (stmt := _statement(fn, n.source.line)) is not None:
            read |= _values_read(stmt) & set(params)
    return read.pop() if len(read) == 1 and params and read != {params[0]} else "0"


def _variable(frag: Fragment, output: str, nodes: dict[str, Node], ret: ast.Return) -> str | None:
    """The variable an output's value is assigned to before the return statement (`cos` for `cos.to(x.dtype)`):
    the first line, walking back from the output, that assigns a simple variable."""
    inside = {n.name for n in frag.nodes}
    for name in itertools.chain([output], walk([output], lambda n: [i for i in nodes[n].inputs if i in inside])):
        src = nodes[name].source
        if src is not None and not _spans(ret, src.line) and (var := names.assigned(src.code)) is not None:
            return var
    return None


def _returned_positions(frag: Fragment, fn: ast.FunctionDef, nodes: dict[str, Node]) -> list[int] | str:
    """Where each output of a module forward returning a tuple goes in it: the item of its one return statement
    that reads the output's variable; or why that cannot be told."""
    returns = [r for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value is not None]
    if len(returns) != 1 or not isinstance(returns[0].value, ast.Tuple):
        return f"{frag.module_class}.forward has {len(frag.outputs)} outputs and not one `return` of a tuple"
    reads = [_values_read(item) for item in returns[0].value.elts]
    positions: list[int] = []
    for o in frag.outputs:
        var = _variable(frag, o, nodes, returns[0])
        hits = [k for k, r in enumerate(reads) if var in r]
        if len(hits) != 1 or hits[0] in positions:
            return f"cannot tell which value {frag.module_class}.forward returns {o} as ({var or 'no variable'})"
        positions.append(hits[0])
    return positions


def _bind_module(frag: Fragment, splice: ManifestSplice, nodes: dict[str, Node]) -> None:
    """A module forward's activation argument and, for a forward returning a tuple, each output's place in it; read
    from the forward's source (one activation, one output where it cannot be read: its first argument, returned)."""
    fn = _forward_def(frag)
    if fn is None:
        if len(frag.outputs) > 1:
            frag.problems.append(f"{frag.module_class}.forward's source is not readable: cannot tell which returned "
                                 "value each output is")
        return
    arg = _module_argument(frag, fn)
    splice.inputs = [f"param:{frag.params[i]}" if i in frag.params else f"arg:{arg}" for i in frag.inputs]
    if len(frag.outputs) > 1:
        positions = _returned_positions(frag, fn, nodes)
        if isinstance(positions, str):
            frag.problems.append(positions)
        else:
            splice.outputs = positions


def _bind(frag: Fragment, splice: ManifestSplice, nodes: dict[str, Node]) -> None:
    """Which forward or function argument feeds each input, which returned value each output is."""
    splice.inputs = [f"param:{frag.params[i]}" if i in frag.params else "arg:0" for i in frag.inputs]
    splice.outputs = [0]
    if frag.target == "module":
        _bind_module(frag, splice, nodes)
    elif frag.target == "function":
        owner, name = frag.function.rsplit(".", 1)
        fn = getattr(importlib.import_module(owner), name, None)
        if not callable(fn):  # a method (XIELU's _xielu_python), not a module-level function the runtime can swap
            frag.problems.append(f"{name} is not a module-level function of {owner} (a method of "
                                 f"{frag.module_class or 'its module'}?): the runtime replaces functions by name")
            return
        bound = bind_function(frag, fn, nodes)
        if isinstance(bound, str):
            frag.problems.append(bound)
        else:
            splice.inputs, splice.outputs = [f"arg:{p}" for p in bound[0]], bound[1]


def _argument_names(frag: Fragment, splice: ManifestSplice) -> list[str]:
    """The emitted function's argument names: the bound HF parameters (a module forward's activation bound to a
    parameter other than its first is named after it: `position_ids`)."""
    bound = [i.removeprefix("arg:") for i in splice.inputs]
    args = names.arguments(frag, bound)
    if frag.target != "module":
        return args
    return [b if s.startswith("arg:") and b != "0" else a for a, b, s in zip(args, bound, splice.inputs)]


def _emit_splice(frag: Fragment, nodes: dict[str, Node], tokens: int) -> tuple[ManifestSplice, list[str]]:
    """One splice point: its PyTorch function (bound against HF's own code) and, where possible, its Triton kernels."""
    slug = region_slug(frag.key.rsplit(".", 1)[-1] if frag.target == "function" else frag.key)
    splice = ManifestSplice(key=frag.key, target=frag.target, module=frag.module, module_class=frag.module_class,
                            function=frag.function, regions=frag.regions, reduction_lanes=frag.lanes,
                            layers=frag.layers)
    body: list[str] = []
    if frag.target == "carry" and not frag.problems:
        splice.torch_fn = ("carry_scaled" if not frag.carry_input else
                           "carry_fp32_rounded" if frag.carry_rounded else "carry_fp32")
        splice.fp32_children = list(frag.fp32_children)
        splice.rounded_children = list(frag.rounded_children) if splice.torch_fn == "carry_fp32" else []
        splice.fp32_outputs = list(frag.fp32_outputs)
        splice.fp32_scaled = {c: list(r) for c, r in frag.fp32_scaled.items()}
        splice.rounded_sums = dict(frag.rounded_sums)
        splice.stored_sums = dict(frag.stored_sums)
        if frag.carry_rounded:
            body += ["", "", f"# carry {frag.key}: regions {', '.join(frag.regions)}; FP32 for "
                     f"{', '.join(frag.fp32_children) or 'no child'}, rounded for the module's own ops",
                     *prelude.source(carry.ROUNDED_PARTS)]
        if splice.rounded_children:
            body += ["", "", f"# carry {frag.key}: regions {', '.join(frag.regions)}; FP32 for the module's own ops, "
                     f"the stored BF16 copy for {', '.join(splice.rounded_children)}",
                     *prelude.source(carry.HELD_PARTS)]
        for sums, what in ((frag.rounded_sums, "rounded to BF16, where the engine stores it"),
                           (frag.stored_sums, "read rounded by the layer's later adds (the engine's stored copy)")):
            if sums:
                where = "; ".join(f"{c} in layers {', '.join(map(str, ls))}" for c, ls in sums.items())
                body += ["", "", f"# carry {frag.key}: the residual sum of {where} {what} (carry_round_sums, below)"]
    elif not frag.problems:
        try:
            lines = emit_torch.emit_function(frag, f"torch_{slug}", nodes)
        except emit_torch.Unsupported as e:
            frag.problems.append(f"PyTorch emitter: {e}")
        else:
            frag.compiled = _compile(lines, f"torch_{slug}")
            splice.torch_fn = f"torch_{slug}"
            frag.problems += list(filter(None, [other_length_problem(frag, nodes, tokens)]))
            _bind(frag, splice, nodes)
            if not frag.problems:
                # named by role: a function's arguments by the HF parameters the binding found
                values = names.value_names(frag, _argument_names(frag, splice))
                lines = emit_torch.emit_function(frag, f"torch_{slug}", nodes, values)
                frag.compiled = _compile(lines, f"torch_{slug}")
                body += ["", "", f"# {frag.target} {frag.key}: regions {', '.join(frag.regions)}", *lines]
                kernel = ("its norm reads its input back rounded from the engine's store after the mean (PyTorch "
                          "only)" if emit_torch.store_readers(frag, nodes) else
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
    for r in (r for r in wanted if r.kind == "allreduce"):
        splice, lines = tp_linear.allreduce_splice(r, nodes, site_node, tp_linear.shards_of(scan.engine_config),
                                                   scan.engine_attention.get("build", ""))
        if not splice.problems and not any(s.target == "linear" and not s.problems for s in parts.splices):
            parts.body += lines  # one function serves every linear splice
        parts.splices.append(splice)
        parts.status[r.name] = "; ".join(splice.problems)


def _add_fragments(parts: _Parts, frags: list[Fragment], nodes: dict[str, Node], tokens: int) -> None:
    """The splices emitted from the trainer graph's fragments: PyTorch and Triton code, and carry hooks; `tokens`:
    the trainer capture's token count (each emitted function is also run at another)."""
    for frag in frags:
        splice, lines = _emit_splice(frag, nodes, tokens)
        parts.splices.append(splice)
        parts.body += lines
    if any((f.rounded_sums or f.stored_sums) and not f.problems for f in frags):
        parts.body += ["", "", *prelude.source(carry.SUM_PARTS)]
    if any(f.fp32_scaled and not f.problems for f in frags):
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
        replaced=sorted({s.function or s.module_class for s in splices if not s.problems}),
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
