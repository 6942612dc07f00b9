"""Below the floor: can the patched trainer take the engine's decode attention row by row and equal its decode?

    GRAPHDIFF_CPU_KIND=avx512 graphdiff scan tiny:qwen3 --engine vllm --out SCAN --patch --attention engine
    GRAPHDIFF_CPU_KIND=avx512 PYTHONPATH=. python benchmarks/below_floor.py SCAN [--model tiny:qwen3] [--prompts 8]
        [--tokens 1024] [--batches 8,1] [--gemms] [--threads N] [--out DIR]

(GRAPHDIFF_CPU_KIND unset: the CPU's own kind.) The engine (compiled, in its own process) samples `--prompts` seeded
random 16-token prompts x `--tokens` tokens, cached in OUT/engine_samples.json. Per 128-position bucket, RMS and
bit-identical fraction of the log-probs of:
  (a) floor: the engine's decode vs its own prefill scoring of the same sequences;
  (b) the patched trainer (SCAN/patch, `--attention engine`: vLLM CPU's prefill attention on the whole sequence) vs
      the engine's decode, and (b') vs the engine's prefill (should be bit-identical);
  (c) the same trainer with every attention row computed as the engine's decode computed it
      (graphdiff.measure.decode_split: the prompt as the batch's prefill, each later row a one-query decode step
      with the decode batch's scheduler metadata) vs the engine's decode, for each decode batch size in
      `--batches` (the first is the engine's own: all prompts decode in lockstep; 1 shows a KV split at work), and
      (c') vs the trainer of (b): the rows decode attention changes;
  (d, --gemms) (c) with every linear (fused as vLLM fuses q/k/v and gate/up) and the LM head through the engine's own
      oneDNN GEMM (`onednn_mm`), each decode row at the decode step's M (batch copies of the row), vs the decode.
Writes OUT/below_floor.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from graphdiff.capture.cpu_kind import apply_forced_kind, cpu_kind


def _metrics(ref: Sequence[torch.Tensor], other: Sequence[torch.Tensor], label: str) -> dict:
    from graphdiff.measure.kl import gap_metrics

    m = gap_metrics(ref, other, engine_mode="compiled", trainer_mode="eager", label=label)
    return {"label": label, "rms": m.rms, "bitexact": m.bitexact_fraction, "max_abs": m.max_abs,
            "buckets": [{"start": b.start, "rms": b.rms, "bitexact": b.bitexact_fraction} for b in m.position]}


def _decode_split_logprobs(model: torch.nn.Module, samples: Sequence, batch: int,
                           gemms: bool = False) -> list[torch.Tensor]:
    """The patched trainer's log-probs with decode-split attention (and with `gemms` the engine's GEMMs at the
    decode's M), each sample request i % batch of its batch."""
    from graphdiff.measure.decode_split import DecodeBatch, decode_gemms, decode_split_fn
    from graphdiff.measure.logprobs import train_logprobs
    from graphdiff.runtime.attention import use_attention

    step = DecodeBatch()
    undo = [use_attention(model, "graphdiff_decode_split", decode_split_fn(step))]
    if gemms:
        undo.append(decode_gemms(model, step))
    try:
        out = []
        for i, s in enumerate(samples):
            step.prompt_len, step.batch, step.request = len(s.prompt), batch, i % batch
            out += train_logprobs(model, [s])
        return out
    finally:
        for restore in reversed(undo):
            restore()


def _table(results: dict) -> str:
    cols = [k for k in results if isinstance(results[k], dict) and "buckets" in results[k]]
    head = "bucket     " + "".join(f"{c:>26}" for c in cols)
    lines = [head, " " * 11 + "".join(f"{'rms':>14}{'bit-id':>12}" for _ in cols)]
    for i, b in enumerate(results[cols[0]]["buckets"]):
        row = f"{b['start']:>4}-{b['start'] + 127:<6}"
        row += "".join(f"{results[c]['buckets'][i]['rms']:>14.3g}{results[c]['buckets'][i]['bitexact']:>12.5%}"
                       for c in cols)
        lines.append(row)
    lines.append("all        " + "".join(f"{results[c]['rms']:>14.3g}{results[c]['bitexact']:>12.5%}" for c in cols))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scan", type=Path)
    ap.add_argument("--model", default="tiny:qwen3")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--batches", default="", help="decode batch sizes for (c), comma-separated (default: --prompts)")
    ap.add_argument("--threads", type=int, default=0, help="the trainer's threads (the split's metadata reads them)")
    ap.add_argument("--gemms", action="store_true", help="also (d): (c) with the engine's GEMMs at the decode's M")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    kind = apply_forced_kind()  # before vLLM's op library or oneDNN's first GEMM load here, as the CLI does
    if args.threads:
        torch.set_num_threads(args.threads)

    from graphdiff.capture.hf import load_hf_model
    from graphdiff.engines.samples import random_prompts
    from graphdiff.engines.vllm.session import sample_engine
    from graphdiff.measure.kl import floor
    from graphdiff.measure.logprobs import engine_logprobs, train_logprobs, trainer
    from graphdiff.models.prepare import prepare_model

    out = args.out or Path(tempfile.mkdtemp(prefix="below-floor-"))
    out.mkdir(parents=True, exist_ok=True)
    manifest = args.scan / "patch" / "manifest.json"
    resolved, _ = prepare_model(args.model, None, None, lambda m: None)
    model_dir = Path(resolved.path)
    prompts = random_prompts(resolved.config, args.prompts, args.prompt_tokens)
    t0 = time.perf_counter()
    run = sample_engine(model_dir, prompts, ["compiled"], max_tokens=args.tokens, out_dir=out, progress=print)
    samples = run["compiled"].samples
    decode, prefill = engine_logprobs(samples), engine_logprobs(samples, prefill=True)
    t_engine = time.perf_counter()
    fl = floor(samples)
    assert fl is not None
    results: dict = {"kind": kind or cpu_kind(), "threads": torch.get_num_threads(), "prompts": len(samples),
                     "tokens": args.tokens, "versions": run["compiled"].versions,
                     "a_floor": _metrics(prefill, decode, "(a) engine decode vs engine prefill")}
    with trainer(load_hf_model(model_dir), "eager", manifest) as model:
        patched = train_logprobs(model, samples)
        results["b_patched"] = _metrics(decode, patched, "(b) patched trainer vs engine decode")
        results["b_prefill"] = _metrics(prefill, patched, "(b') patched trainer vs engine prefill")
        t_patched = time.perf_counter()
        batches = [int(b) for b in args.batches.split(",")] if args.batches else [len(samples)]
        for n in batches:
            split = _decode_split_logprobs(model, samples, n)
            results[f"c_split_b{n}"] = _metrics(decode, split, f"(c) decode-split attention (batch {n}) vs decode")
            results[f"c_vs_b_b{n}"] = _metrics(patched, split, f"(c') decode-split (batch {n}) vs (b)")
            if args.gemms:
                both = _decode_split_logprobs(model, samples, n, gemms=True)
                results[f"d_gemm_b{n}"] = _metrics(decode, both, f"(d) (c) + engine GEMMs at decode M={n} vs decode")
    results["timings"] = {"engine_s": round(t_engine - t0, 1), "patched_s": round(t_patched - t_engine, 1),
                          "decode_split_s": round(time.perf_counter() - t_patched, 1)}
    (out / "below_floor.json").write_text(json.dumps(results, indent=1))
    print(f"kind {results['kind']}, trainer threads {results['threads']}, {len(samples)} x {args.tokens} tokens; "
          f"timings {results['timings']}")
    for k, v in results.items():
        if isinstance(v, dict) and "label" in v:
            print(f"  {k}: {v['label']}")
    print(_table(results))
    print(f"wrote {out / 'below_floor.json'}")


if __name__ == "__main__":
    main()
