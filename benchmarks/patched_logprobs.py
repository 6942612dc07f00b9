"""The patched model's log-probs (and gradients) on fixed ids, written to compare two versions bit for bit.

    python benchmarks/patched_logprobs.py --scan SCAN_DIR --config Qwen/Qwen3-0.6B --seq 1024 --out before.pt
    (change the runtime or codegen)
    python benchmarks/patched_logprobs.py --scan SCAN_DIR --config Qwen/Qwen3-0.6B --seq 1024 --out after.pt \\
        --compare before.pt

For each patch (portable, and `--exact` where the engine's op library is installed) and the unpatched model: the
log-prob of each next token (FP32 log_softmax of the logits), the sha256 of the whole logits tensor, and the
sha256 of every parameter's gradient of the loss. `--compare` says, per patch, whether the log-probs are
torch.equal to the file's and which gradients changed; exit status 1 when a log-prob differs.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import torch
from patch_step_benchmark import load_model, model_arguments  # beside this script

from graphdiff import runtime
from graphdiff.codegen import generate


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def measure(model: torch.nn.Module, ids: torch.Tensor) -> dict:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids, use_cache=False)
    logp = torch.log_softmax(out.logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    out.loss.backward()
    grads = {n: _sha(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    return {"logprobs": logp.detach(), "logits_sha256": _sha(out.logits), "grads": grads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model_arguments(ap)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--compare", type=Path)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gd-logprobs-"))
    model, _ = load_model(args, work)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    results = {"unpatched": measure(model, ids)}
    patches = {"portable": False}
    if importlib.util.find_spec("vllm") is not None:
        patches["exact"] = True
    for name, exact in patches.items():
        generate(args.scan, work / name, exact=exact)
        runtime.apply(model, work / name)
        results[name] = measure(model, ids)
        runtime.remove(model)
    torch.save(results, args.out)
    if args.compare is None:
        return
    before = torch.load(args.compare)
    same = True
    for name, now in results.items():
        if name not in before:
            continue
        equal = torch.equal(now["logprobs"], before[name]["logprobs"])
        changed = [n for n, h in now["grads"].items() if before[name]["grads"].get(n) != h]
        same &= equal
        print(f"{name}: log-probs {'bit for bit equal' if equal else 'DIFFER'}; logits "
              f"{'equal' if now['logits_sha256'] == before[name]['logits_sha256'] else 'differ'}; "
              f"{len(changed)} of {len(now['grads'])} gradients changed" + (f" ({changed[0]}, ...)" if changed else ""))
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
