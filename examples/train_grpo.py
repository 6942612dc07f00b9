"""TRL's GRPOTrainer on the model patched by the checked-in graphdiff patch.

    python examples/train_grpo.py --model MODEL --patch patches/manifest.json

The patch is applied to the model object before it is handed to the trainer; the trainer's generation, its
log-prob passes and its backward all run the patched forward. The prompts come in a `datasets.IterableDataset`,
which `datasets` does not fingerprint: its fingerprinting cannot hash a patched model (the runtime's ContextVar does
not pickle), so a map-style `Dataset` transform that captures the model gets a random fingerprint, with a warning,
and is never cached. The reward is a toy (short completions score higher); use yours.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from datasets import IterableDataset
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from graphdiff import runtime

# TRL warns about the installed vLLM at import; this example generates with transformers, not vLLM.
warnings.filterwarnings("ignore", message="TRL currently supports vLLM")
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

PROMPTS = ["The engine rounds", "A trainer computes", "Log-probs differ when", "Patch the model so"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory or id (the model the patch was made for)")
    p.add_argument("--patch", default="patches/manifest.json", help="the checked-in manifest.json")
    p.add_argument("--out", default="runs/grpo", help="the trainer's output_dir")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--completion-len", type=int, default=8)
    return p.parse_args()


def byte_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """For a test checkpoint that ships no tokenizer: byte-level, with a placeholder token for each other id of the
    model's vocabulary (so that every sampled id decodes) and the last id as end of text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    names = alphabet + [f"<|{i}|>" for i in range(len(alphabet), vocab_size - 1)] + ["<|endoftext|>"]
    tok = Tokenizer(models.BPE(vocab={name: i for i, name in enumerate(names)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


def load_tokenizer(model: str, vocab_size: int) -> PreTrainedTokenizerFast:
    if Path(model).is_dir() and not any(Path(model).glob("tokenizer*")):
        return byte_tokenizer(vocab_size)
    tokenizer = AutoTokenizer.from_pretrained(model)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def prompts() -> Iterator[dict]:
    while True:  # the trainer stops at max_steps
        yield from ({"prompt": p} for p in PROMPTS)


def shorter_is_better(completions: list[str], **kwargs) -> list[float]:
    return [-float(len(c)) for c in completions]


def main() -> None:
    args = parse_args()
    # BF16 weights with SDPA attention: the trainer setup the scan compared with the engine.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, attn_implementation="sdpa")
    runtime.apply(model, args.patch)
    tokenizer = load_tokenizer(args.model, model.config.vocab_size)
    config = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=args.completion_len,
        learning_rate=1e-5,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        bf16=False,  # the weights are BF16 already; autocast would recast the patch's FP32 arithmetic
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=shorter_is_better, args=config,
                          train_dataset=IterableDataset.from_generator(prompts), processing_class=tokenizer)
    trainer.train()
    regions = runtime.active_regions(trainer.model)
    norms = [round(h["grad_norm"], 4) for h in trainer.state.log_history if "grad_norm" in h]
    print(f"trained {trainer.state.global_step} steps; patched regions: {len(regions or [])}; grad norms: {norms}")


if __name__ == "__main__":
    main()
