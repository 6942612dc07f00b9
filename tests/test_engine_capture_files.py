"""Weights a saved engine capture refers to are read back from the checkpoint, mapped rather than copied."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from graphdiff.engines.store import checkpoint_tensor


def testcheckpoint_tensors_are_mapped_with_their_values_and_can_be_written_privately(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": torch.randn(7, 5, generator=g).bfloat16(), "b.bias": torch.randn(3, generator=g),
               "c.idx": torch.arange(6, dtype=torch.int64).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name, t in tensors.items():
        got = checkpoint_tensor(tmp_path, name)
        assert got is not None and got.dtype == t.dtype and torch.equal(got, t), name
    got = checkpoint_tensor(tmp_path, "a.weight")
    got.zero_()  # copy-on-write: the file is untouched
    assert torch.equal(checkpoint_tensor(tmp_path, "a.weight"), tensors["a.weight"])
    assert checkpoint_tensor(tmp_path, "missing") is None
