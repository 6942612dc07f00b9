"""The forward shapes a scan records in one engine start: prefills of several lengths, batched decode steps.

RL rollouts are long prompts prefilled in chunks and many sequences decoded together with a KV cache; a
rounding claim made on one 16-token prompt says nothing about those. `--shapes` takes a comma-separated list:
`N` (or `prefill:N`) is one prompt of N tokens, `decode:BxC` one decode step of B sequences whose KV caches
hold C tokens each. The first shape is a prefill: the trainer is traced on its prompt.
"""

from __future__ import annotations

import re

import torch

from graphdiff.errors import GraphdiffError
from graphdiff.records import Shape

LONG_PREFILLS = (512, 2048)
DECODE = (8, 64)  # sequences, context
_ITEM = re.compile(r"(?:prefill:)?(\d+)|decode:(\d+)x(\d+)")


def max_positions(config: dict) -> int:
    """The longest sequence the model takes (its position embeddings), from the config."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        if isinstance(config.get(key), int):
            return int(config[key])
    text = config.get("text_config")
    return max_positions(text) if isinstance(text, dict) else 2048


def prefill(tokens: int) -> Shape:
    return Shape(label=f"prefill-{tokens}", phase="prefill", tokens=tokens)


def decode(sequences: int, context: int) -> Shape:
    return Shape(label=f"decode-{sequences}x{context}", phase="decode", tokens=sequences, sequences=sequences,
                 context=context)


def default_shapes(tokens: int, config: dict) -> list[Shape]:
    """The scan's default: the --tokens prompt, long prefills up to 2048 tokens, one batched decode step; capped
    at what the model's positions allow."""
    limit = max_positions(config) - 1  # room for the one token the engine generates
    shapes = [prefill(tokens)] + [prefill(n) for n in LONG_PREFILLS if tokens < n <= limit]
    if DECODE[1] + 1 <= limit:
        shapes.append(decode(*DECODE))
    return shapes


def parse_shapes(spec: str, tokens: int) -> list[Shape]:
    """`--shapes` text -> shapes; a list that does not start with a prefill gets the --tokens prompt first."""
    shapes: list[Shape] = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        m = _ITEM.fullmatch(item)
        if not m:
            raise GraphdiffError(f"--shapes: cannot read {item!r}; use N, prefill:N or decode:BxC (e.g. 16,2048,"
                                 "decode:8x64)")
        shape = prefill(int(m.group(1))) if m.group(1) else decode(int(m.group(2)), int(m.group(3)))
        if shape.label not in {s.label for s in shapes}:
            shapes.append(shape)
    if not shapes:
        raise GraphdiffError("--shapes names no shape")
    if shapes[0].phase != "prefill":
        shapes.insert(0, prefill(tokens))
    return shapes


def check_shapes(shapes: list[Shape], config: dict) -> None:
    """Refuse, before any engine starts, a shape the model cannot run."""
    limit = max_positions(config)
    for s in shapes:
        longest = s.tokens if s.phase == "prefill" else s.context + 1
        if s.phase == "prefill" and s.tokens < 2:
            raise GraphdiffError(f"shape {s.label}: a prefill needs at least 2 tokens")
        if s.phase == "decode" and (s.sequences < 1 or s.context < 1):
            raise GraphdiffError(f"shape {s.label}: a decode step needs at least 1 sequence with 1 token of context")
        if longest + 1 > limit:
            raise GraphdiffError(f"shape {s.label} needs {longest + 1} positions (with the generated token); the "
                                 f"model has {limit} (max_position_embeddings)")


def with_prompts(shapes: list[Shape], config: dict, first: list[int] | None = None) -> list[Shape]:
    """Each shape with seeded prompts within the vocabulary (`first`: the first shape's own prompt)."""
    vocab = int(config.get("vocab_size", 1000))
    out = []
    for i, s in enumerate(shapes):
        gen = torch.Generator().manual_seed(i)
        n, length = (1, s.tokens) if s.phase == "prefill" else (s.sequences, s.context)
        prompts = torch.randint(1, min(vocab, 32000), (n, length), generator=gen).tolist()
        out.append(s.model_copy(update={"prompts": [first] if i == 0 and first else prompts}))
    return out


def engine_limits(shapes: list[Shape]) -> dict[str, int]:
    """vLLM sizes that let every shape run as one forward (no chunking of the longest prefill)."""
    longest = max(s.tokens if s.phase == "prefill" else s.context + 2 for s in shapes)
    batch = max(s.tokens if s.phase == "prefill" else s.sequences * s.context for s in shapes)
    return dict(max_model_len=-(-(longest + 2) // 64) * 64, max_num_batched_tokens=max(batch, longest, 2048),
                max_num_seqs=max(4, *(s.sequences for s in shapes)))
