"""What a compiled engine model tells, whichever engine compiled it: the parameter name behind each graph input
(Dynamo's placeholder names), each node's module by its name in the model, the parameters no graph reads, the weight
its logits use, and kernel ids made unique across the graphs of one capture."""

from __future__ import annotations

import re

import torch

from graphdiff.records import Graph


def _mangle(path: str, kind: str) -> str:
    """Dynamo's placeholder name for a parameter/buffer at `path` relative to the compiled module."""
    *mods, leaf = path.split(".")
    parts = [f"modules_{m}" for m in mods] + [f"{kind}_{leaf}"]
    return "l_self_" + "_".join(parts) + "_"


def input_names(placeholders: list[str], model: torch.nn.Module) -> tuple[dict[str, str], str]:
    """Map Dynamo placeholder names to the engine model's parameter names.

    The compiled callable is some submodule (e.g. `model` inside `Qwen3ForCausalLM`);
    its path prefix is found as the root under which most placeholders resolve.
    Inputs that are not parameters keep a readable name ("input_ids", "positions"); opaque
    weight handles (CPU oneDNN linear) are named after their module with a `#handle` tail.
    """
    best: tuple[int, str, dict[str, str]] = (-1, "", {})
    for root, sub in [("", model), *((n + ".", m) for n, m in model.named_children())]:
        table = {_mangle(n, "parameters"): root + n for n, _ in sub.named_parameters()}
        table.update({_mangle(n, "buffers"): root + n for n, _ in sub.named_buffers()})
        hits = sum(p in table for p in placeholders)
        if hits > best[0]:
            mods = {
                "l_self_" + "_".join(f"modules_{m}" for m in n.split(".")) + "_": root + n
                for n, _ in sub.named_modules()
                if n
            }
            best = (hits, root, {**table, **{"#mod#" + k: v for k, v in mods.items()}})
    _, root, table = best
    prefixes = sorted(((k[5:], v) for k, v in table.items() if k.startswith("#mod#")), key=lambda kv: -len(kv[0]))
    names: dict[str, str] = {}
    for p in placeholders:
        if p in table:
            names[p] = table[p]
            continue
        prefix = next(((k, v) for k, v in prefixes if p.startswith(k)), None)
        if prefix:
            names[p] = f"{prefix[1]}#{p[len(prefix[0]):].rstrip('_')}"
        else:
            names[p] = re.sub(r"^l_|_$", "", p)
    return names, root


def canonical_modules(graph: Graph, model: torch.nn.Module) -> None:
    """Each node's module path that names no module of `model` (Dynamo spells the path it reached the module by:
    vLLM's shared experts are called through a closure, `mlp.experts._shared_experts._mk_can_overlap_shared_experts
    .__closure__.0.cell_contents._shared_experts._layer.gate_up_proj`) made the module's shortest name in the
    model (`mlp.shared_experts.gate_up_proj`), the name its checkpoint gives it, so it matches the trainer's."""
    names: dict[int, str] = {}
    for name, mod in model.named_modules(remove_duplicate=False):
        if id(mod) not in names or len(name) < len(names[id(mod)]):
            names[id(mod)] = name
    known = set(names.values()) | {n for n, _ in model.named_modules(remove_duplicate=False)}
    resolved: dict[str, str] = {}
    for node in graph.nodes:
        path = node.module
        if not path or path in known:
            continue
        if path not in resolved:
            obj: object = model
            for part in path.split("."):
                try:
                    obj = obj[int(part)] if part.isdigit() else getattr(obj, part)  # type: ignore[index]
                except (AttributeError, IndexError, KeyError, TypeError):
                    obj = None
                    break
            resolved[path] = names.get(id(obj), path) if isinstance(obj, torch.nn.Module) else path
        node.module = resolved[path]


def _squeezed(name: str) -> str:
    return re.sub("_+", "_", name)


def unread_params(model: torch.nn.Module, graphs: list[Graph]) -> list[str]:
    """The engine model's parameters that its compiled graphs never read although they hold something (not all
    zeros): the engine computes something else there than the checkpoint describes, which no rounding alignment
    can close (vLLM CPU's plain softmax top-k router ignores an `e_score_correction_bias`). Only parameters under
    the compiled module count (the LM head runs outside it). A graph input `module#handle` (a packed linear's
    closure, an attribute path) reads that module's parameters whose name ends the handle's path, and a linear's
    weight and bias."""
    read: set[str] = set()
    handles: list[tuple[str, str]] = []
    for graph in graphs:
        for name in graph.inputs.values():
            if "#" in name:
                mod, _, path = name.partition("#")
                handles.append((mod, path))
            else:
                read.add(name)
    roots = {n.split(".", 1)[0] for n in read if "." in n}
    modules = dict(model.named_modules())
    canonical = {id(p): n for n, p in model.named_parameters()}  # a parameter under its first name
    for mod, path in handles:
        owner = modules.get(mod)
        if owner is None:
            continue
        # a handle reached through submodules (`modules_shared_experts_modules_down_proj_cpu_linear...`); Dynamo's
        # names squeeze underscore runs (`_shared_experts._layer` reads `modules_shared_experts_modules_layer`)
        path = _squeezed(path)
        subs = sorted(((n, _squeezed(f"modules_{'_modules_'.join(n.split('.'))}_")) for n, _ in owner.named_modules()
                       if n), key=lambda kv: -len(kv[1]))
        sub, rest = next(((n, path[len(m):]) for n, m in subs if path.startswith(m)), ("", path))
        for local, param in (owner.get_submodule(sub) if sub else owner).named_parameters():
            if rest.endswith(_squeezed(local.replace(".", "_"))) or ("linear" in rest and local in ("weight", "bias")):
                read.add(canonical.get(id(param), local))
        # an attribute the module holds without registering it (an MoE layer's `router`), read through its own
        # parameter name (`router_e_score_correction_bias`): a parameter of the enclosing block by that name
        block = modules.get(mod.rpartition(".")[0], model)
        for local, param in block.named_parameters():
            leaf = local.rpartition(".")[2]
            if leaf not in ("weight", "bias") and rest.endswith("_" + leaf):
                read.add(canonical.get(id(param), local))
    unread = []
    for name, param in model.named_parameters():
        if name.split(".", 1)[0] not in roots or name in read or param.numel() < 2 or not param.is_floating_point():
            continue
        if bool(param.detach().abs().amax() > 0):
            unread.append(name)
    return unread


def is_model_graph(names: dict[str, str]) -> bool:
    # The model's graph takes its weights as inputs; other compiled helpers (the sampler) don't.
    return any("." in n for n in names.values())


def unique_kernel_ids(graph: Graph, index: int) -> dict[str, str]:
    """Inductor restarts its provenance handles at every compile (torch/_inductor/debug.py), so in a piecewise
    compile `<name>:<handle>` repeats across pieces. Graph `index` > 0 gets `<name>:g<index>.<handle>` (in its
    kernels and nodes); returns old -> new. The first graph, and so every single-graph capture, is unchanged."""
    return tag_kernel_ids(graph, f"g{index}") if index else {}


def tag_kernel_ids(graph: Graph, tag: str) -> dict[str, str]:
    """Every kernel id `<name>:<handle>` of `graph` made `<name>:<tag>.<handle>`, in its kernels and nodes; returns
    old -> new."""
    renamed = {}
    for k in graph.kernels:
        name, _, handle = k.id.rpartition(":")
        renamed[k.id] = k.id = f"{name}:{tag}.{handle}"
    for n in graph.nodes:
        if n.kernel in renamed:
            n.kernel = renamed[n.kernel]
    return renamed


def logits_weight(model: torch.nn.Module) -> str:
    """The weight the engine's logits use: its LM head's own, or the input embedding (a tied model, or one whose
    vLLM class has no LM head and skips the checkpoint's lm_head.weight, as vLLM's Cohere)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    get_embeddings = getattr(model, "get_input_embeddings", None)
    embedding = get_embeddings() if callable(get_embeddings) else None
    if isinstance(weight, torch.Tensor) and weight is not getattr(embedding, "weight", None):
        return "lm_head.weight"
    return "input embedding"
