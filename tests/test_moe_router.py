"""The patch's MoE router returns the engine's routing in the model's own order; projections that are no nn.Linear."""

from __future__ import annotations

import torch

from graphdiff.analysis.moe_engine import addmm_folded_forward, moe_experts_like_engine, moe_router_like_engine


class _Router(torch.nn.Module):
    def __init__(self, order: tuple[str, ...]) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(6, 16, generator=torch.Generator().manual_seed(0)).bfloat16())
        self.top_k, self.order = 2, order

    def forward(self, x: torch.Tensor) -> tuple:
        logits = torch.nn.functional.linear(x, self.weight).float()
        values, idx = logits.topk(self.top_k, dim=-1)
        got = {"logits": logits, "weights": values.softmax(-1).type_as(x), "indices": idx}
        return tuple(got[k] for k in self.order)


def test_qwen_and_granite_orders_with_an_fp32_input() -> None:
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(1))  # FP32: the carried residual stream's norm
    for order in [("logits", "weights", "indices"), ("indices", "weights", "logits")]:
        r = _Router(order)
        out = dict(zip(order, moe_router_like_engine(r, x)))
        own = dict(zip(order, r(x.bfloat16())))
        assert torch.equal(out["indices"], own["indices"]), order
        assert out["weights"].dtype == torch.float32 and out["weights"].shape == (5, 2)
        assert out["logits"].shape == (5, 6)
        torch.testing.assert_close(out["weights"], own["weights"].float(), atol=1e-2, rtol=1e-2)


def test_a_conv1d_projection_rounds_an_fp32_input_like_a_linear() -> None:
    """GPT-2's projections are transformers' Conv1D: the patched trainer's FP32 carry reaches them too."""
    from transformers.pytorch_utils import Conv1D

    from graphdiff.runtime.targets import is_conv1d, round_linear_input

    conv = Conv1D(8, 4).to(torch.bfloat16)
    assert is_conv1d(conv) and not is_conv1d(torch.nn.Linear(4, 8))
    x = torch.randn(2, 4)
    (rounded,) = round_linear_input(conv, (x,))
    assert rounded.dtype == torch.bfloat16 and conv(rounded).dtype == torch.bfloat16


def test_the_router_learns_its_module_s_output_order_once() -> None:
    calls = []

    class Counted(_Router):
        def forward(self, x: torch.Tensor) -> tuple:
            calls.append(1)
            return super().forward(x)

    r = Counted(("indices", "weights", "logits"))
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(2))
    first, second = moe_router_like_engine(r, x), moe_router_like_engine(r, x)
    assert len(calls) == 1 and all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_experts_round_the_activation_product_and_the_output_once() -> None:
    """moe_experts_like_engine (what an experts splice runs) against the same computation in float64, rounded only
    at the activation product and the output (small probes on a k/8 grid, so the FP32 sums it keeps round to the
    same BF16 as float64's). All-BF16 experts (the trainer's) round more and differ."""
    gen = torch.Generator().manual_seed(3)

    def probe(*shape: int) -> torch.Tensor:  # k/8, |k| <= 8: exact in BF16, small exact products
        return (torch.randint(-8, 9, shape, generator=gen).double() / 8).to(torch.bfloat16)

    class Experts:
        gate_up_proj, down_proj, act_fn = probe(4, 2 * 6, 8), probe(4, 8, 6), staticmethod(torch.relu)

    x, index = probe(10, 8), torch.randint(0, 4, (10, 2), generator=gen)
    weights = torch.tensor([0.75, 0.25]).expand(10, 2)  # routing weights exact in BF16 too
    got = moe_experts_like_engine(Experts, x, index, weights)
    want = torch.zeros(10, 8, dtype=torch.float64)
    for t in range(10):
        for slot in range(2):
            gate_up = x[t].double() @ Experts.gate_up_proj[index[t, slot]].double().T
            act = (torch.relu(gate_up[:6]) * gate_up[6:]).to(torch.bfloat16).double()  # the one inner rounding
            want[t] += weights[t, slot].double() * (act @ Experts.down_proj[index[t, slot]].double().T)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    all_bf16 = torch.zeros(10, 8, dtype=torch.bfloat16)
    for t in range(10):
        for slot in range(2):
            gate_up = x[t] @ Experts.gate_up_proj[index[t, slot]].T
            act = torch.relu(gate_up[:6]) * gate_up[6:]
            all_bf16[t] += weights[t, slot].to(torch.bfloat16) * (act @ Experts.down_proj[index[t, slot]].T)
    assert not torch.equal(got, all_bf16), "the probe must make the trainer's extra roundings visible"


def test_a_grouped_routers_agreement_compares_its_experts_not_its_groups():
    """A grouped router (GLM-4-MoE, DeepSeek) takes the top-k of its groups, then of its experts: the agreement
    compares the trainer's expert choices with the engine's, whatever width its groups' top-k has."""
    from graphdiff.analysis.moe import routing_agreement
    from graphdiff.records import Graph, Node

    mod = "model.layers.1.mlp.gate"
    graph = Graph(name="g", nodes=[Node(name="groups", op="call_function", target="aten.topk.default", module=mod),
                                   Node(name="experts", op="call_function", target="aten.topk.default", module=mod)])
    groups = torch.tensor([[0, 1]] * 16)  # 16 tokens, 2 of 4 groups
    experts = torch.tensor([[0, 2, 5]] * 16)  # 3 experts
    values = {"groups": (torch.zeros(16, 2), groups), "experts": (torch.zeros(16, 3), experts)}
    engine = experts.clone()
    engine[:4] = torch.tensor([7, 2, 5])  # 4 tokens choose another expert
    (row,) = routing_agreement(graph, values, {1: engine}, "prefill-16")
    assert (row.layer, row.tokens, row.differing) == (1, 16, 4)
    (row,) = routing_agreement(graph, values, {1: experts[:, [2, 1, 0]]}, "prefill-16")  # an order is no change
    assert row.differing == 0
    (row,) = routing_agreement(graph, values, {1: groups}, "prefill-16")  # only the groups' choice recorded
    assert row.differing == 0 and row.tokens == 16



def test_a_conv1d_multiplies_its_weight_as_the_engine_holds_it() -> None:
    """The engine holds a Conv1D's weight transposed (`[out, in]`) and runs a linear on it; where ATen's BF16 GEMM is
    its own (no oneDNN BF16 matmul: AVX2) the `[in, out]` layout sums in another order. The patched Conv1D computes
    the engine's product bit for bit, HF's shape and the weight's gradient, and the undo gives HF's forward back."""
    from transformers.pytorch_utils import Conv1D

    from graphdiff.runtime.targets import conv1d_as_linear

    g = torch.Generator().manual_seed(5)
    conv = Conv1D(768, 256).to(torch.bfloat16)
    with torch.no_grad():
        conv.weight.copy_(torch.randn(256, 768, generator=g) * 0.08)
        conv.bias.copy_(torch.randn(768, generator=g) * 0.08)
    x = torch.randn(2, 16, 256, generator=g).bfloat16()
    engine = torch.nn.functional.linear(x, conv.weight.t().contiguous(), conv.bias)
    hf = conv(x)
    undo = conv1d_as_linear(conv)
    got = conv(x)
    assert got.shape == hf.shape == (2, 16, 768) and torch.equal(got, engine)
    got.float().sum().backward()
    patched_grad, conv.weight.grad = conv.weight.grad, None
    undo()
    assert "forward" not in conv.__dict__ and torch.equal(conv(x), hf)
    conv(x).float().sum().backward()
    assert torch.allclose(patched_grad.float(), conv.weight.grad.float(), rtol=1e-2, atol=1e-3)

class _SharedBlock(torch.nn.Module):
    """An MoE block's tail as transformers writes it: the experts' sum (FP32, scaled, as the experts splice hands it)
    plus the shared expert's output."""

    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.up = torch.nn.Linear(32, 48, bias=False).bfloat16()
        self.down = torch.nn.Linear(48, 32, bias=bias).bfloat16()
        for p in self.parameters():
            p.data = (torch.randn(p.shape, generator=g) * 0.2).bfloat16()

    def forward(self, x: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        return routed + self.down(torch.nn.functional.silu(self.up(x)))


def test_the_shared_experts_down_projection_and_its_add_run_as_one_addmm() -> None:
    """The engine adds the shared expert's down GEMM to the experts' sum inside ATen's addmm (rounded once); the
    block's forward, run by addmm_folded_forward, computes exactly that addmm (bias in the weight's dtype), with
    the addmm's gradient; transformers' own forward rounds twice and differs. A linear with a bias is not folded."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 24, 32, generator=g).bfloat16()
    routed = torch.randn(2, 24, 32, generator=g) * 1.5
    block = _SharedBlock()
    down = block.down.weight
    got = addmm_folded_forward(block, block.forward, (), x, routed)
    act = torch.nn.functional.silu(block.up(x)).reshape(-1, 48)
    want = torch.addmm(routed.bfloat16().reshape(-1, 32), act, down.t()).reshape(2, 24, 32)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(block(x, routed).bfloat16(), want)  # two roundings: the GEMM, then the sum
    got.float().square().sum().backward()
    grad = down.grad.clone()
    down.grad = None
    want.float().square().sum().backward()
    assert torch.equal(grad, down.grad)
    biased = _SharedBlock(bias=True)
    assert torch.equal(addmm_folded_forward(biased, biased.forward, (), x, routed), biased(x, routed))


class _ParallelLayer(torch.nn.Module):
    """Falcon's parallel block: the MLP's output, then the attention's dense output added in place."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(6)
        self.dense = torch.nn.Linear(32, 32, bias=False).bfloat16()
        self.dense_4h_to_h = torch.nn.Linear(64, 32, bias=False).bfloat16()
        for p in self.parameters():
            p.data = (torch.randn(p.shape, generator=g) * 0.2).bfloat16()

    def forward(self, attn: torch.Tensor, act: torch.Tensor) -> torch.Tensor:
        attention_output = attn @ self.dense.weight.T  # FalconLinear's form
        mlp_output = self.dense_4h_to_h(act)
        mlp_output += attention_output
        return mlp_output


def test_an_in_place_add_of_two_linears_folds_the_second_as_inductor_does() -> None:
    """`mlp_output += attention_output` of two bias-free linears (the dense written `x @ weight.T`, as FalconLinear
    does): Inductor folds the second addend's GEMM (the attention's dense) with the first as the bias, and so does
    the patched forward given the dense's weight, writing into the first; given the MLP's weight it folds that one."""
    g = torch.Generator().manual_seed(7)
    attn, act = torch.randn(3, 8, 32, generator=g).bfloat16(), torch.randn(3, 8, 64, generator=g).bfloat16()
    layer = _ParallelLayer()
    mlp = layer.dense_4h_to_h(act)
    want = torch.addmm(mlp.reshape(-1, 32), attn.reshape(-1, 32), layer.dense.weight.t()).reshape(3, 8, 32)
    assert not torch.equal(layer(attn, act), want)
    assert torch.equal(addmm_folded_forward(layer, layer.forward, (layer.dense.weight,), attn, act), want)
    assert torch.equal(addmm_folded_forward(layer, layer.forward, (layer.dense_4h_to_h.weight,), attn, act),
                       torch.addmm(layer.dense(attn).reshape(-1, 32), act.reshape(-1, 64),
                                   layer.dense_4h_to_h.weight.t()).reshape(3, 8, 32))
