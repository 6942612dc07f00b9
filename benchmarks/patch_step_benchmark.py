"""Training-step cost of the patch: forward+backward time and peak memory, patched / unpatched.

    python benchmarks/patch_step_benchmark.py --scan fixtures/scans/tiny-qwen3 --arch qwen3
    python benchmarks/patch_step_benchmark.py --scan SCAN_DIR --batch 1 --seq 1024 --attention engine
    python benchmarks/patch_step_benchmark.py --scan SCAN_DIR --arch qwen3_moe --batch 1 --seq 1024 --exact
    python benchmarks/patch_step_benchmark.py --scan SCAN_DIR --config Qwen/Qwen3-8B --device cuda \\
        --batch 2 --seq 4096 --variants unpatched,rope,all

The model is a seeded tiny checkpoint (--arch), a checkpoint dir (--model), or a bundled config at full
depth with random weights made on the device (--config; the scan may have cut it to fewer layers: the patch
applies to every layer). On CPU the runtime uses the generated PyTorch functions; on a GPU the Triton
kernels. A variant is `unpatched`, `all`, or region kinds joined by `+` (e.g. `rope`, `rope+gated_act`):
those regions aligned, the others spliced but rounding where HF does. Steps cycle through the variants
(remove/apply between them) so that drift in machine speed hits all alike; medians are reported. Peak memory:
on a GPU the allocator's maximum during one step (`peak_gib`, parameters included); on the CPU the most tensor
memory live at once during one step above what was live before it (`peak_mib`, from the profiler's allocation and
free events: patch_memory_benchmark.peak_of). `--cpu-time`: each step's time is this process's CPU time (at
`--threads 1` nothing of it is spinning threads), for a machine shared with other work, where wall time measures
the neighbours; the spread (min, max) is reported beside each median.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
from patch_memory_benchmark import peak_of  # beside this script

from graphdiff import runtime
from graphdiff.codegen import generate
from graphdiff.records import Manifest

AUTOGRAD = "/autograd"  # a variant's suffix: its splices' gradients by autograd, not their closed forms
BF16 = "/bf16"  # a variant's suffix: the attention's gradient by the BF16 kernel (runtime.apply(attention_gradient=))


def step(model: torch.nn.Module, ids: torch.Tensor, cpu_time: bool = False,
         faults: list[tuple[float, int]] | None = None) -> float:
    """One forward + backward: wall seconds, or with `cpu_time` this process's CPU seconds (on a machine shared with
    other work, what the step itself computed, whatever else ran beside it). `faults` gets the step's system CPU
    seconds and minor page faults (the kernel's share: fresh memory the allocator took from the OS and touched)."""
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    clock = time.process_time if cpu_time else time.perf_counter
    model.zero_grad(set_to_none=True)
    sync()
    before = resource.getrusage(resource.RUSAGE_SELF)
    t = clock()
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    sync()
    elapsed = clock() - t
    after = resource.getrusage(resource.RUSAGE_SELF)
    if faults is not None:
        faults.append((after.ru_stime - before.ru_stime, after.ru_minflt - before.ru_minflt))
    return elapsed


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """The scan and the model a patch is timed or checked on (load_model reads them)."""
    ap.add_argument("--scan", type=Path, required=True)
    ap.add_argument("--arch", default="qwen3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--model", type=Path)
    ap.add_argument("--config")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cpu")


def regions_of(variant: str, manifest: Manifest) -> list[str] | None:
    """None: unpatched; else the manifest regions the variant aligns (`/autograd`: the same, gradients by autograd;
    `/bf16`: the same, the attention's gradient by the BF16 flash kernel)."""
    variant = variant.removesuffix(BF16).removesuffix(AUTOGRAD)
    if variant == "unpatched":
        return None
    if variant == "all":
        return [r.name for r in manifest.regions if r.generated]
    kinds = set(variant.split("+"))
    unknown = kinds - {r.kind for r in manifest.regions}
    if unknown:
        raise SystemExit(f"no region of kind {', '.join(sorted(unknown))} in the patch; kinds: "
                         f"{', '.join(sorted({r.kind for r in manifest.regions}))}")
    return [r.name for r in manifest.regions if r.generated and r.kind in kinds]


def load_model(args: argparse.Namespace, work: Path) -> tuple[torch.nn.Module, str]:
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.config:  # bundled config (or a config dir), full depth, random weights made on the device
        from graphdiff.models.resolve import bundled_config

        published = bundled_config(args.config)
        cfg_dir = Path(args.config) if published is None else work / "config"
        if published is not None:
            cfg_dir.mkdir(parents=True, exist_ok=True)
            (cfg_dir / "config.json").write_text(json.dumps(published))
        config = AutoConfig.from_pretrained(cfg_dir)
        torch.manual_seed(0)
        with torch.device(args.device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
        return model.train(), args.config
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.models.tiny import make_tiny

    model_dir = args.model or make_tiny(args.arch, work / "model", layers=args.layers)
    return load_hf_model(model_dir).to(args.device).train(), str(model_dir)


def timing(times: dict[str, list[float]], kernel: dict[str, list[tuple[float, int]]], variant: str) -> dict:
    """A variant's median step (min, max), its ratio to the unpatched median, the kernel's share; {} untimed."""
    if not times[variant]:
        return {}
    med = statistics.median(times[variant])
    base = statistics.median(times["unpatched"]) if times.get("unpatched") else None
    return {"median_s": round(med, 4), "min_s": round(min(times[variant]), 4),
            "max_s": round(max(times[variant]), 4), "ratio": round(med / base, 4) if base else None,
            "system_s": round(statistics.median(k[0] for k in kernel[variant]), 4),
            "page_faults": int(statistics.median(k[1] for k in kernel[variant]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scan", type=Path, required=True, help="scan directory (scan.json + train.capture.json)")
    ap.add_argument("--arch", default="qwen3", help="tiny architecture to build when --model/--config are not given")
    ap.add_argument("--layers", type=int, default=2, help="layers of the tiny model")
    ap.add_argument("--model", type=Path, help="checkpoint dir (its config must match the scan)")
    ap.add_argument("--config", help="bundled model id or config dir: full-depth model with random weights")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per variant (0: the peak memory only)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per variant first (allocator, Triton)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variants", default="unpatched,all",
                    help="comma-separated: unpatched, all, KIND[+KIND]; a /autograd suffix: gradients by autograd "
                         "(checkpointed), not the splices' closed forms; a /bf16 suffix (last): the attention's "
                         "gradient by the BF16 flash kernel (runtime.apply(attention_gradient='bf16'))")
    ap.add_argument("--allow-version-mismatch", action="store_true",
                    help="apply although torch/transformers differ from the scan's (timing only)")
    ap.add_argument("--json", type=Path, help="also write the result here")
    ap.add_argument("--attention", default="fp32", choices=("fp32", "engine"),
                    help="the attention splice: FP32 sdpa, or the engine's own op forward (needs vLLM CPU)")
    ap.add_argument("--exact", action="store_true", help="the patch runs the engine's own ops (`patch --exact`)")
    ap.add_argument("--cpu-time", action="store_true", help="time each step by this process's CPU time")
    ap.add_argument("--threads", type=int, help="torch's intra-op threads (default: torch's)")
    ap.add_argument("--no-peak", action="store_true", help="skip the peak-memory step (the CPU's profiler is slow)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    work = Path(tempfile.mkdtemp(prefix="gd-bench-"))
    manifest = generate(args.scan, work / "patch", attention=args.attention, exact=args.exact)
    model, label = load_model(args, work)
    variants = {v: regions_of(v, manifest) for v in args.variants.split(",")}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=gen).to(args.device)

    def use(variant: str) -> None:
        regions = variants[variant]
        os.environ["GRAPHDIFF_CLOSED_FORM"] = "0" if variant.removesuffix(BF16).endswith(AUTOGRAD) else "1"
        if regions is None:
            runtime.remove(model)
        else:
            runtime.apply(model, work / "patch", regions=regions, allow_version_mismatch=args.allow_version_mismatch,
                          attention_gradient="bf16" if variant.endswith(BF16) else "fp32")

    cuda = args.device.startswith("cuda")
    peak: dict[str, float] = {}
    for v in variants:  # warm-up (allocator, Triton compile), then one step for the peak memory
        use(v)
        for _ in range(args.warmup):
            step(model, ids)
        model.zero_grad(set_to_none=True)
        if args.no_peak:
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            step(model, ids)
            peak[v] = torch.cuda.max_memory_allocated() / 2**30
        else:
            peak[v] = peak_of(lambda: step(model, ids)) / 2**20
    times: dict[str, list[float]] = {v: [] for v in variants}
    kernel: dict[str, list[tuple[float, int]]] = {v: [] for v in variants}
    for _ in range(args.steps):
        for v in variants:
            use(v)
            times[v].append(step(model, ids, args.cpu_time, kernel[v]))
    result = {
        "model": label, "architecture": manifest.architecture, "layers": model.config.num_hidden_layers,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "path": "triton" if cuda and any(s.triton_fn for s in manifest.splices) else "pytorch", "batch": args.batch,
        "seq": args.seq, "steps": args.steps, "threads": torch.get_num_threads(), "attention": args.attention,
        "exact": args.exact, "clock": "cpu" if args.cpu_time else "wall",
        "torch": torch.__version__,
        "variants": {v: {"regions": len(r) if r is not None else 0, **timing(times, kernel, v),
                         ("peak_gib" if cuda else "peak_mib"): round(peak[v], 2) if v in peak else None,
                         "peak_ratio": round(peak[v] / peak["unpatched"], 3) if peak.get("unpatched") else None}
                     for v, r in variants.items()},
    }
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
