"""Recorded kernel buffers read back on the CPU, wherever they were recorded.

A capture made on a CUDA machine saves its tensors with CUDA storage tags (torch.save keeps the device); the scan reads
them on this machine's CPU (the replay runs there) and keeps the device they were saved from as a fact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from graphdiff.records import Buffers, Graph


def load_on_cpu(path: Path, mmap: bool = False) -> tuple[Any, str]:
    """A torch.save file's objects with every storage on the CPU, whatever device saved it (a capture made on a CUDA
    machine is read on one without), and the device its storages were saved from: the first that is not the CPU (a
    CUDA engine's capture holds some CPU tensors too), else "cpu"; "" where it holds no storage."""
    tags: list[str] = []

    def keep_on_cpu(storage: Any, location: str) -> Any:
        tags.append(location)
        return storage  # as read from the file: on the CPU

    obj = torch.load(path, weights_only=False, mmap=mmap, map_location=keep_on_cpu)
    return obj, next((t for t in tags if t != "cpu"), "cpu" if tags else "")


def buffers_device(buffers: Buffers) -> str:
    """The device a capture's recorded tensors live on (load_on_cpu's rule); "" where it holds none."""
    found = ""
    for records in buffers.values():
        for rec in records.values():
            for t in (*rec["in"].values(), *rec["out"].values()):
                if isinstance(t, torch.Tensor):
                    if t.device.type != "cpu":
                        return str(t.device)
                    found = "cpu"
    return found


def graph_device(graphs: list[Graph]) -> str:
    """The device a capture's graphs build their tensors on (their factory ops' `device` arguments), the same rule
    as load_on_cpu's; "" where no op names one (a capture without buffers: a TORCH_COMPILE_DEBUG dump)."""
    kwargs = [n.call[1] for g in graphs for n in g.nodes if len(n.call) > 1 and isinstance(n.call[1], dict)]
    devices = [v["device"] for kw in kwargs for v in kw.values()
               if isinstance(v, dict) and isinstance(v.get("device"), str)]
    return next((d for d in devices if d != "cpu"), "cpu" if devices else "")
