"""The patch's MoE router returns the engine's routing in the order the model's own router returns it."""

from __future__ import annotations

import torch

from graphdiff.moe import engine_like_router


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
        out = dict(zip(order, engine_like_router(r, x)))
        own = dict(zip(order, r(x.bfloat16())))
        assert torch.equal(out["indices"], own["indices"]), order
        assert out["weights"].dtype == torch.float32 and out["weights"].shape == (5, 2)
        assert out["logits"].shape == (5, 6)
        torch.testing.assert_close(out["weights"], own["weights"].float(), atol=1e-2, rtol=1e-2)
