"""What graphdiff knows about ops by name: the one place op lists live (no torch import).

None of these lists decides where a side rounds: the trainer's roundings are decided numerically
(rounding.py re-runs each op in FP32), the engine's by its kernels' stores and replay. The lists say
which ops cannot compute (so need not be re-run), where a dataflow neighbourhood stops, and what a
picture may hide.
"""

from __future__ import annotations

# Reinterpret or alias data without computing: a value and its view are the same value.
VIEWS = frozenset({
    "getitem", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "split", "split_with_sizes", "slice",
    "permute", "expand", "alias", "t", "transpose", "select", "clone", "contiguous", "detach", "as_strided",
    "_reshape_alias", "unbind", "chunk", "lift_fresh_copy",
})
# Move or select data: exact in any dtype (run in the input dtype; re-running a gather in FP32 would upcast a
# whole embedding table).
DATA_MOVEMENT = frozenset({
    "embedding", "index", "index_select", "gather", "select", "slice", "split", "split_with_sizes", "getitem",
    "view", "reshape", "_unsafe_view", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze", "cat",
    "clone", "alias", "contiguous", "as_strided", "unbind", "chunk", "narrow",
})
# Never change a value's bits whatever its dtype: data movement and sign changes. A low-precision result of one
# of these is exact, so eager storing it is not a rounding.
EXACT = DATA_MOVEMENT | {"neg", "detach", "lift_fresh_copy", "_reshape_alias"}
CASTS = frozenset({"_to_copy", "convert_element_type", "to", "type_as"})
# Return their input's value (a cast is the identity on an FP32-carried value).
IDENTITY = frozenset({"_to_copy", "convert_element_type", "alias", "clone", "contiguous"})
MATMULS = frozenset({"mm", "addmm", "bmm", "matmul", "linear"})
# Boundaries of elementwise neighbourhoods (region kinds, fragments, pictures): matmul-like ops (MoE experts run
# grouped GEMMs in transformers 5, one fused op in vLLM), lookups and attention.
HEAVY = MATMULS | {"baddbmm", "embedding", "convolution", "onednn_mm", "_grouped_mm", "grouped_mm",
                   "_scaled_grouped_mm", "cpu_fused_moe", "fused_moe"}
ROUTING = frozenset({"topk", "_softmax", "softmax"})  # an MoE router: top-k over softmax-normalized logits
ATTENTION_MARKS = ("attention", "scaled_dot_product")
ACTIVATIONS = frozenset({"silu", "gelu", "sigmoid", "tanh", "relu", "softplus", "mish", "elu", "leaky_relu",
                         "hardswish", "gelu_tanh"})
ALLOCATIONS = frozenset({"empty", "empty_like", "empty_strided", "zeros", "full", "new_empty"})
# Allocations whose contents are undefined until a kernel writes them (an extern's out= buffer).
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "new_empty"})
LOW_DTYPES = frozenset({"bfloat16", "float16"})


def op_name(target: str) -> str:
    """"aten.mul.Tensor" -> "mul"; "getitem" -> "getitem"."""
    parts = target.split(".")
    return parts[1] if len(parts) >= 2 else parts[0]


def is_attention(target: str) -> bool:
    return any(mark in op_name(target) for mark in ATTENTION_MARKS)


def is_heavy(target: str) -> bool:
    """Matmul-like, embedding or attention: where an elementwise neighbourhood ends."""
    return op_name(target) in HEAVY or is_attention(target)


def is_low(dtype: str | None) -> bool:
    return dtype in LOW_DTYPES
