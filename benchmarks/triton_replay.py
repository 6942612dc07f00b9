"""The recorded H200 Triton dump's kernels run in Triton's interpreter on the CPU, each replayed bit for bit.

    TRITON_INTERPRET=1 python benchmarks/triton_replay.py [--json OUT]

The dump (fixtures/dumps/inductor-triton-h200-tiny-qwen3-hf) is the seeded tiny Qwen3 in HF code under
torch.compile; the same checkpoint is made here (`make_tiny`), so its weights and the dump's prompt are the graph's
real inputs. The dump's wrapper runs on the CPU with every Triton kernel in the interpreter
(`replay.triton_kernels.run_dump`: CPU `mm`, math SDPA in place of cuDNN's), which records each call's buffers;
then every kernel is replayed as a scan replays it (`analysis.rounding.engine_rounding`) and the replay's stores
are compared bit for bit with the interpreter's. Run three ways: the GPU's numerics as modelled (BF16 stores
rounded to nearest even, `tl.sum` a halving tree), and each of the two left as the interpreter has it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DUMP = ROOT / "fixtures" / "dumps" / "inductor-triton-h200-tiny-qwen3-hf"
OUTPUT_CODE = DUMP / "torchinductor" / "model__0_inference_0.0" / "output_code.py"
PROMPT = [17, 912, 33, 1500, 7, 256, 1024, 3, 88, 640, 1999, 5, 42, 9, 77, 1200]  # benchmarks/record_triton_dump.py
# The graph's parameters in the order Dynamo lifted them (first use in the forward); the rotary inv_freq comes
# second (arg2_1, an FP32 buffer the checkpoint does not hold).
LAYER = ("input_layernorm", "self_attn.q_proj", "self_attn.q_norm", "self_attn.k_proj", "self_attn.k_norm",
         "self_attn.v_proj", "self_attn.o_proj", "post_attention_layernorm", "mlp.gate_proj", "mlp.up_proj",
         "mlp.down_proj")
VARIANTS = {"gpu": (True, True), "truncating-bf16": (False, True), "numpy-sum": (True, False)}


def graph_inputs(model_dir: Path, graph) -> list:  # type: ignore[no-untyped-def]
    """The dump graph's inputs: the prompt, then the tiny model's parameters in placeholder order (shapes and
    dtypes checked against the graph's placeholders)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    layers = model.config.num_hidden_layers
    names = [f"model.layers.{i}.{p}.weight" for i in range(layers) for p in LAYER]
    values = [torch.tensor([PROMPT]), params["model.embed_tokens.weight"], model.model.rotary_emb.inv_freq.float(),
              *(params[n] for n in names), params["model.norm.weight"], params["lm_head.weight"]]
    holders = [n for n in graph.nodes if n.op == "placeholder"]
    for node, value in zip(holders, values, strict=True):
        if list(value.shape) != node.shape or str(value.dtype).removeprefix("torch.") != node.dtype:
            raise SystemExit(f"{node.name}: graph says {node.dtype}{node.shape}, got {value.dtype}{list(value.shape)}")
    return [v.detach() for v in values]


def kind(name: str) -> str:
    return {"poi": "pointwise", "per": "persistent reduction", "red": "reduction"}.get(name.split("_")[1], "?")


def measure() -> dict:
    """Per variant, per kernel call: the replay's bit-identical fraction against the interpreter's stores."""
    from graphdiff.analysis.rounding import engine_rounding
    from graphdiff.engines.dump import import_dump
    from graphdiff.models.tiny import make_tiny
    from graphdiff.replay.triton_kernels import run_dump

    graph = import_dump(DUMP).graphs[0]  # its `device=cuda` arguments: the replay builds on the CPU
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        inputs = graph_inputs(make_tiny("qwen3", Path(tmp) / "model"), graph)
        for variant, (rtne, tree) in VARIANTS.items():
            records = run_dump(OUTPUT_CODE.read_text(), inputs, Path(tmp), rtne=rtne, tree_sum=tree)
            replays = engine_rounding(graph, records).replays
            out[variant] = [{"kernel": r.kernel, "kind": kind(r.kernel), "bitexact": r.predicted_bitexact,
                             "naive": r.naive_bitexact, "elements": r.elements, "lanes": r.reduction_lanes,
                             "aten_order_bitexact": r.aten_order_bitexact,
                             "aten_order_fp32_error": r.aten_order_fp32_error, "fp32_error": r.fp32_max_rel_error,
                             "error": r.error, "note": r.note} for r in replays]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| kernel call | kind | BF16 elements | bit-identical | ATen-order replay | note |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        aten = "" if r["aten_order_bitexact"] is None else f"{r['aten_order_bitexact']:.4%}" if r["elements"] \
            else f"FP32 rel. error {r['aten_order_fp32_error']:.1e}"
        what = r["error"] or (f"FP32 stores: max rel. error {r['fp32_error']:.1e}" if not r["elements"] else "")
        lines.append(f"| `{r['kernel']}` | {r['kind']} | {r['elements']} | {r['bitexact']:.4%} | {aten} | {what} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the measurements here")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run with TRITON_INTERPRET=1 (Triton reads it when it is imported)")
    sys.path.insert(0, str(ROOT))
    result = measure()
    for variant, rows in result.items():
        print(f"\n## {variant}\n\n{table(rows)}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
