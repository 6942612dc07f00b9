"""The helpers every generated patch module starts with, and how a patch carries a function: as its source.

The runtime imports nothing of the scanner, so the generated module holds the source of every function it runs
(`source`). The functions themselves are real ones, here and in the modules named below, so the scanner, the tests
and the linters run the very code a patch carries:

- `_f32`, `_round`: what the emitted region functions call on their inputs and at each rounding point;
- `inductor_math` (replay.inductor_math): tanh, exp, sin, cos, ... as the engine's Inductor-generated kernels compute
  them;
- `truncate_to_bf16` (capture.cpu_kind) and `round_toward_zero`: an FP32 -> BF16 store by truncation, as vLLM CPU's
  `_C_AVX512` / `_C_AVX2` ops store (the attention and split-K splices' `_truncated` forms);
- `ordered_sum`, `ordered_mean`, `ordered_layer_norm` (replay.sum_order): a row sum, and a layer norm's two passes
  of them, in an engine kernel's order.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from typing import Any

import torch

from graphdiff.capture.cpu_kind import truncate_to_bf16
from graphdiff.errors import GraphdiffError
from graphdiff.replay.inductor_math import inductor_math
from graphdiff.replay.sum_order import ordered_layer_norm, ordered_mean, ordered_sum


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Store in `dtype` (round to nearest even) and go on computing in FP32."""
    return x.to(dtype).float()


def round_toward_zero(x: torch.Tensor) -> torch.Tensor:
    """Store FP32 `x` in BF16 by truncation and go on computing in FP32; the gradient passes the truncation as it
    passes a cast."""
    kept = x.detach()
    return x + (truncate_to_bf16(kept) - kept)


PARTS: tuple[Callable, ...] = (_f32, _round, inductor_math, truncate_to_bf16, round_toward_zero, ordered_sum,
                               ordered_mean, ordered_layer_norm)


def source(parts: tuple) -> list[str]:
    """The lines a generated module carries for `parts` (their source, as written, two blank lines apart)."""
    return "\n\n\n".join(_checked_source(part) for part in parts).splitlines()


def _checked_source(part: Callable) -> str:
    """`part`'s source, checked to define `part` and nothing else: inspect reads the file on disk by the line
    numbers of the code imported, so a graphdiff edited after this process imported it yields another function's
    lines, which would make a patch module that lacks the function its manifest names."""
    text = inspect.getsource(part).rstrip("\n")
    try:
        tree = ast.parse(text)
    except SyntaxError:
        tree = None
    defined = [getattr(node, "name", None) for node in tree.body] if tree is not None else []
    if defined != [part.__name__]:
        raise GraphdiffError(f"graphdiff's source of {part.__module__}.{part.__name__} changed on disk since this "
                             "process imported it; run the command again")
    return text


def text() -> str:
    """The prelude's source, as the generated module carries it."""
    return "\n".join(source(PARTS))


def namespace() -> dict[str, Any]:
    """The names emitted region code may call, bound to the real functions (and the modules it imports)."""
    from graphdiff.codegen.closed_form import PARTS as GRADIENT_PARTS

    return {"torch": torch, "F": torch.nn.functional, **{part.__name__: part for part in (*PARTS, *GRADIENT_PARTS)}}
