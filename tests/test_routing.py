"""Routing agreement on the gap's samples (graphdiff.measure.routing), on a seeded tiny HF MoE model (no engine):
the trainer's expert choices are read per decoder layer, and compared with given engine choices token by token."""

from __future__ import annotations

import pytest
import torch

from graphdiff.capture.hf import load_hf_model
from graphdiff.measure.routing import agreement, differing, trainer_topk
from graphdiff.models.tiny import make_tiny


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return load_hf_model(make_tiny("qwen3_moe", tmp_path_factory.mktemp("moe") / "model", layers=2))


def _choices(model: torch.nn.Module, ids: list[int]) -> dict[int, list]:
    with trainer_topk(model) as rec, torch.no_grad():
        model(input_ids=torch.tensor([ids]), use_cache=False)
    return rec.calls


def test_the_trainers_choices_are_read_per_layer_and_compared_token_by_token(moe: torch.nn.Module) -> None:
    ids = list(range(3, 40))
    calls = _choices(moe, ids)
    assert sorted(calls) == [0, 1]
    rows, chosen, width = calls[0][0]
    assert rows == len(ids) and chosen.shape[-1] == moe.config.num_experts_per_tok and width == moe.config.num_experts
    engine = {layer: found[0][1].reshape(len(ids), -1).tolist() for layer, found in calls.items()}
    assert differing(engine, calls) == {0: (len(ids), 0), 1: (len(ids), 0)}
    # the same experts in another order are the same choice; another expert for 3 tokens of layer 1 is not
    engine[0] = [row[::-1] for row in engine[0]]
    for t in (0, 5, 9):
        engine[1][t][0] = next(e for e in range(moe.config.num_experts) if e not in engine[1][t])
    assert differing(engine, calls) == {0: (len(ids), 0), 1: (len(ids), 3)}
    rows_ = agreement([differing(engine, calls)] * 2, "2 samples x 37 tokens", "patched")
    assert [(a.layer, a.tokens, a.differing, a.trainer) for a in rows_] == [(0, 74, 0, "patched"),
                                                                           (1, 74, 6, "patched")]


def test_the_routers_top_k_is_told_from_a_group_top_k_of_the_same_k() -> None:
    """A grouped router with one group kept at top-1 (GLM-4-MoE with `n_group` 1, `topk_group` 1) takes a top-1 over
    its one group (indices all 0) before its top-1 over the experts: the widest input's is the router's."""
    experts = torch.tensor([[2], [3], [0], [1]])
    calls = {0: [(4, torch.zeros(4, 1, dtype=torch.long), 1), (4, experts, 4)]}
    assert differing({0: experts.tolist()}, calls) == {0: (4, 0)}


def test_choices_of_another_length_are_not_compared(moe: torch.nn.Module) -> None:
    calls = _choices(moe, list(range(3, 20)))
    engine = {0: [[0, 1]] * 5}  # 5 tokens recorded: not these 17
    assert differing(engine, calls) == {}


def test_moe_configs_are_told_by_their_expert_count(tmp_path) -> None:
    """`kl` starts an MoE engine the way the capture does (to record its expert choices): every config spelling of
    the routed-expert count counts, the shared experts and the experts per token do not."""
    import json

    from graphdiff.engines.vllm.session import is_moe

    for config, moe in [({"num_experts": 8}, True), ({"num_local_experts": 8}, True), ({"n_routed_experts": 64}, True),
                        ({"moe_num_experts": 8, "moe_k": 2}, True), ({"text_config": {"num_experts": 4}}, True),
                        ({"num_experts_per_tok": 2, "n_shared_experts": 2}, False), ({"num_experts": 1}, False),
                        ({"hidden_size": 64}, False)]:
        d = tmp_path / str(len(list(tmp_path.iterdir())))
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": ["X"], **config}))
        assert is_moe(d) == moe, config
