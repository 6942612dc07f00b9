"""An output both sides store, read by nothing after its rounding, is stored once (emit_torch._store_once): the same
values and gradients as rounding it, widening it back and narrowing it again at the return."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import torch

from graphdiff.codegen import generate

QWEN3 = Path(__file__).resolve().parent.parent / "fixtures" / "scans" / "tiny-qwen3"
ONCE = re.compile(r"^    (\w+) = \1\.to\((torch\.\w+)\)  # both sides store it \(an output.*$", re.M)


def _module(source: str, path: Path) -> ModuleType:
    path.write_text(source)  # Triton's jit reads its functions' source from their file
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _shape(splice_key: str, name: str) -> tuple[int, ...]:
    """tiny-qwen3's shapes: hidden 256, 4 query and 2 key heads of 64, intermediate 512."""
    rope = {"cos": (2, 16, 64), "sin": (2, 16, 64), "q": (2, 4, 16, 64), "k": (2, 2, 16, 64)}
    width = 64 if "_norm" in splice_key and "self_attn" in splice_key else 512 if "act_fn" in splice_key else 256
    return rope.get(name) or ((width,) if name == "weight" else (2, 16, width))


def test_an_output_stored_once_computes_as_the_rounded_one(tmp_path: Path) -> None:
    manifest = generate(QWEN3, tmp_path)
    source = (tmp_path / manifest.module_file).read_text()
    assert len(ONCE.findall(source)) >= 3  # RoPE's q and k, the norms' products
    once = _module(source, tmp_path / "once.py")
    rounded = _module(ONCE.sub(r"    \1 = _round(\1, \2)  # both sides store it", source), tmp_path / "rounded.py")
    align = frozenset(r.name for r in manifest.regions)
    gen = torch.Generator().manual_seed(0)
    for splice in manifest.splices:
        if splice.target not in ("module", "function") or not splice.torch_fn:
            continue
        inputs = [torch.randn(_shape(splice.key, s.split(":", 1)[1]), generator=gen).to(torch.bfloat16)
                  .requires_grad_() for s in splice.inputs]
        got = [getattr(m, splice.torch_fn)(*inputs, align=align) for m in (once, rounded)]
        for a, b in zip(*got):
            assert a.dtype == b.dtype and torch.equal(a, b)
        grads = [torch.autograd.grad([o.float().sum() for o in out], inputs) for out in got]
        assert all(torch.equal(a, b) for a, b in zip(*grads))
