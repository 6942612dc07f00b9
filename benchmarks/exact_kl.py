"""Exact mean per-token KL(engine || trainer), unpatched vs patched, from full engine distributions.

    python benchmarks/exact_kl.py tiny:qwen3 SCAN_DIR/patch/manifest.json [MORE_MANIFESTS...] [--prompts 8]
        [--tokens 64] [--tensor-parallel-size N] [--split-kind allreduce]

With several manifests, each is measured against the same engine samples; `--split-kind K` also measures each
manifest with only its regions of kind K and with all but those (e.g. a TP=2 scan's `allreduce` regions).

Sampled estimators (k1, k3) need many tokens; for a small-vocabulary model the engine can return
its whole next-token distribution (logprobs = vocab size), so the KL at each sampled position is
computed exactly: sum_v p_engine(v) (log p_engine(v) - log p_train(v)). Only for small vocabularies.
"""

from __future__ import annotations

import argparse
import math
import os
import tempfile
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("manifests", nargs="+")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--split-kind", default="")
    args = ap.parse_args()
    tp = args.tensor_parallel_size

    from graphdiff import runtime
    from graphdiff.capture.hf import load_hf_model
    from graphdiff.engines.vllm.start import engine_env
    from graphdiff.models.prepare import prepare_model

    resolved, _ = prepare_model(args.model, None, None, print)
    vocab = int(resolved.config["vocab_size"])
    os.environ.update(engine_env(Path(tempfile.mkdtemp())))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    extra = {}
    if tp > 1:  # one worker process per rank (graphdiff.engines.vllm.tp), no capture
        from graphdiff.engines.vllm.tp import WORKER_ENV, tp_env, tp_kwargs

        os.environ.update({k: v for k, v in tp_env(tp).items() if k != WORKER_ENV})
        extra = tp_kwargs(tp, capture=False)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(resolved.path), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
              max_num_seqs=8, max_logprobs=vocab, seed=0, **extra)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (16,), generator=gen).tolist() for _ in range(args.prompts)]
    params = [SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=i, logprobs=vocab, ignore_eos=True)
              for i in range(args.prompts)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    model = load_hf_model(resolved.path)

    def per_token_kl() -> torch.Tensor:
        kls = []
        for prompt, out in zip(prompts, outs):
            ids = torch.tensor([prompt + list(out.outputs[0].token_ids)])
            with torch.no_grad():
                train = model(input_ids=ids).logits[0].log_softmax(-1, dtype=torch.float32).double()
            for j, dist in enumerate(out.outputs[0].logprobs):
                engine = torch.full((vocab,), -math.inf, dtype=torch.float64)
                for tok, lp in dist.items():
                    engine[tok] = lp.logprob
                kls.append(float((engine.exp() * (engine - train[len(prompt) - 1 + j])).nan_to_num().sum()))
        return torch.tensor(kls)

    base = per_token_kl()
    se = lambda x: float(x.std() / math.sqrt(len(x)))  # noqa: E731
    print(f"engine tensor_parallel_size {tp}; exact mean per-token KL(engine||train) over {len(base)} tokens: "
          f"unpatched {base.mean():.3e} ± {se(base):.1e}")
    for manifest in args.manifests:
        regions = runtime.load_manifest(manifest).regions
        variants = [("all regions", None)]
        kind = [r.name for r in regions if r.kind == args.split_kind and r.generated]
        if kind:
            rest = [r.name for r in regions if r.generated and r.name not in kind]
            variants += [(f"without {args.split_kind}", rest), (f"only {args.split_kind}", kind)]
        for label, names in variants:
            runtime.apply(model, manifest, regions=names)
            patched = per_token_kl()
            runtime.remove(model)
            print(f"  {manifest} ({label}): patched {patched.mean():.3e} ± {se(patched):.1e}, "
                  f"reduction {1 - patched.mean() / base.mean():.1%}", flush=True)


if __name__ == "__main__":
    main()
