"""An engine capture as files, whichever engine made it: DIR/capture.json and DIR/buffers.pt, written by the engine's
child process and read back by the scan, `scan --engine-dump` and `graphdiff replay`.

Recorded weights are kept by reference in memory; on disk a large one is a reference to the checkpoint
tensor of the same name (an embedding table is gigabytes), resolved again when the buffers are loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch

from graphdiff.capture.inductor_hooks import weight_inputs
from graphdiff.engines.saved import buffers_device, load_on_cpu
from graphdiff.errors import GraphdiffError
from graphdiff.records import Buffers, Capture, WeightRef, load_capture, save_json

BUFFERS_FILE = "buffers.pt"
INLINE_WEIGHT_BYTES = 256 * 2**10  # larger recorded weights are saved as references to the checkpoint


def _in_checkpoint(model_dir: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, for every tensor of the checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for f in sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []:
        with safe_open(str(f), framework="pt") as st:
            shapes.update({k: list(st.get_slice(k).get_shape()) for k in st.keys()})  # noqa: SIM118
    return shapes


def save_engine_capture(cap: Capture, buffers: Buffers, directory: Path) -> Path:
    """DIR/capture.json and DIR/buffers.pt. A large recorded weight that the checkpoint holds under the same name is
    saved as {"weight": name, "shape": ..., "dtype": ...}; anything else (the engine's own tables) inline."""
    directory.mkdir(parents=True, exist_ok=True)
    stored = _in_checkpoint(Path(cap.model))
    # Buffer names are per graph (a piecewise engine's graphs each have their own arg7_1): a kernel's weights are
    # those of the graph that runs it.
    weights = {g.name: {buf: g.inputs[buf] for buf in weight_inputs(g) if g.inputs[buf] in stored} for g in cap.graphs}
    graph_of = {k.id: g.name for g in cap.graphs for k in g.kernels}
    slim: dict[str, dict[str, dict[str, object]]] = {}  # Buffers, with a WeightRef for each large weight
    for label, records in buffers.items():
        slim[label] = {}
        for kid, rec in records.items():
            ins: dict[str, torch.Tensor | WeightRef] = {}
            mine = weights.get(graph_of.get(kid, ""), {})
            for buf, t in rec["in"].items():
                big = isinstance(t, torch.Tensor) and t.numel() * t.element_size() > INLINE_WEIGHT_BYTES
                # a tensor-parallel rank's shard is smaller than the checkpoint tensor: kept inline
                if buf in mine and big and _fits(stored[mine[buf]], list(t.shape)):
                    ins[buf] = {"weight": mine[buf], "shape": list(t.shape), "dtype": str(t.dtype)}
                else:
                    ins[buf] = t
            slim[label][kid] = {**rec, "in": ins}
    torch.save(slim, directory / BUFFERS_FILE)
    cap.buffers_file = BUFFERS_FILE
    cap.device = cap.device or buffers_device(buffers)  # kept once the buffers are read back on the CPU
    return save_json(cap, directory / "capture.json")


def _fits(stored: list[int], recorded: list[int]) -> bool:
    """Can the checkpoint tensor stand for the recorded one (same rank, no larger; the engine pads some tables)?"""
    return len(stored) == len(recorded) and all(a <= b for a, b in zip(stored, recorded))


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def checkpoint_tensor(model_dir: Path, name: str) -> torch.Tensor | None:
    """A checkpoint tensor mapped from its safetensors file, copy-on-write: a replay reads a few rows of an
    embedding table, and a read copy would hold the whole table in memory (1.2 GB at Qwen3-8B's vocabulary)."""
    import json
    import mmap

    for f in sorted(model_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            entry = json.loads(fh.read(size)).get(name)
            if entry is None:
                continue
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                return None
            begin, end = entry["data_offsets"]
            if end == begin:
                return torch.empty(entry["shape"], dtype=dtype)
            mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)  # stays open while the tensor lives
            flat = torch.frombuffer(mapped, dtype=dtype, count=(end - begin) // dtype.itemsize, offset=8 + size + begin)
            return flat.reshape(entry["shape"])
    return None


def _resolve(ref: WeightRef, model_dir: Path) -> torch.Tensor | None:
    t = checkpoint_tensor(model_dir, ref["weight"])
    shape = torch.Size(ref["shape"])
    if t is None or t.dim() != len(shape) or any(a > b for a, b in zip(t.shape, shape)):
        return None
    if t.shape != shape:  # the engine pads some tables (vocabulary to a multiple of 64): rows never read
        padded = torch.zeros(shape, dtype=t.dtype)
        padded[tuple(slice(0, n) for n in t.shape)] = t
        t = padded
    return t.to(getattr(torch, ref["dtype"].removeprefix("torch.")))


def load_engine_capture(directory: Path, model_dir: Path | None = None) -> tuple[Capture, Buffers]:
    """An engine capture with real kernel buffers (weight references resolved from `model_dir`, default the
    checkpoint the capture ran); one clear error when the directory holds something else."""
    if not (directory / "capture.json").exists():
        if directory.exists() and any(directory.rglob("output_code.py")):
            raise GraphdiffError(
                f"{directory} is a TORCH_COMPILE_DEBUG dump without recorded kernel buffers, which the scan "
                "replays; on the engine machine run `graphdiff capture MODEL --engine vllm --out DIR` and pass DIR")
        raise GraphdiffError(f"{directory} holds no engine capture (capture.json from `graphdiff capture`)")
    cap = load_capture(directory / "capture.json")
    if cap.side != "engine" or not cap.buffers_file or not (directory / cap.buffers_file).exists():
        raise GraphdiffError(f"{directory / 'capture.json'} is not an engine capture with recorded buffers")
    try:
        # as saved: Buffers, with a WeightRef for each large weight
        stored, saved_on = load_on_cpu(directory / cap.buffers_file, mmap=True)
    except Exception as e:
        raise GraphdiffError(f"cannot read {directory / cap.buffers_file}: {type(e).__name__}") from None
    cap.device = cap.device or saved_on  # a capture older than the field: where its storages were saved from
    source = model_dir or Path(cap.model)
    cache: dict[str, torch.Tensor | None] = {}
    for records in stored.values():
        for rec in records.values():
            for buf, t in list(rec["in"].items()):
                if isinstance(t, dict) and "weight" in t:
                    if t["weight"] not in cache:
                        cache[t["weight"]] = _resolve(cast(WeightRef, t), source) if source.is_dir() else None
                    if cache[t["weight"]] is None:
                        del rec["in"][buf]  # the kernel's replay says its inputs could not be resolved
                    else:
                        rec["in"][buf] = cache[t["weight"]]
    return cap, cast(Buffers, stored)  # every WeightRef resolved, or its input dropped
