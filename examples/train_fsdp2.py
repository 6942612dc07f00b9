"""A plain FSDP2 training loop on the model patched by the checked-in graphdiff patch.

    torchrun --nproc-per-node 8 examples/train_fsdp2.py --model MODEL --patch patches/manifest.json
    python examples/train_fsdp2.py --model MODEL --patch patches/manifest.json   # one process, CPU, gloo

The patch is applied to the model before `fully_shard` wraps it (the runtime hooks modules and reads their weights
when they run, so FSDP2's all-gathered parameters are what the patched code sees). Each step trains on a batch of
seeded random tokens (`batches`); swap in your data loader.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from graphdiff import runtime

SEED = 1234  # of the token batches; rank r draws from SEED + r


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory or id (the model the patch was made for)")
    p.add_argument("--patch", default="patches/manifest.json", help="the checked-in manifest.json")
    p.add_argument("--no-patch", action="store_true", help="train unpatched (the baseline)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-4)
    return p.parse_args()


def batches(vocab_size: int, batch: int, seq_len: int, seed: int) -> Iterator[torch.Tensor]:
    """Seeded random token batches, from a generator of their own (the global RNG is left alone)."""
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield torch.randint(0, vocab_size, (batch, seq_len), generator=generator)


def init_distributed() -> tuple[int, int, torch.device]:
    """torchrun's process group, or (run without torchrun) a single process: world size 1, an in-memory store."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def main() -> None:
    args = parse_args()
    rank, world, device = init_distributed()
    # BF16 weights with SDPA attention: the trainer setup the scan compared with the engine.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    model.to(device)
    if not args.no_patch:
        runtime.apply(model, args.patch)  # before fully_shard
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank == 0:
        regions = runtime.active_regions(model)
        print(f"patched regions: {len(regions)}" if regions is not None else "unpatched", flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = batches(model.config.vocab_size, args.batch, args.seq_len, SEED + rank)
    model.train()
    for step in range(1, args.steps + 1):
        ids = next(data).to(device)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # summed over ranks (gloo has no average)
        mean /= world
        if rank == 0:
            print(f"step {step} loss {mean.item():.6f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
