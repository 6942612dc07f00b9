"""The two sides' logits weights: an engine whose model has no LM head of its own (vLLM's Cohere) scores with the input
embedding, so an untied checkpoint is two models, which the scan says before any rounding finding."""

from __future__ import annotations

import torch

from graphdiff.analysis.scan import logits_notes
from graphdiff.capture.engine_model import logits_weight
from graphdiff.records import Capture, Graph


class _Model(torch.nn.Module):
    def __init__(self, head: str) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        if head == "own":
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
        elif head == "tied":
            self.lm_head = torch.nn.Linear(4, 8, bias=False)
            self.lm_head.weight = self.embed_tokens.weight

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed_tokens


def test_the_engine_models_logits_weight_is_read_from_its_modules() -> None:
    assert logits_weight(_Model("own")) == "lm_head.weight"
    assert logits_weight(_Model("tied")) == "input embedding"
    assert logits_weight(_Model("none")) == "input embedding"


def _captures(engine_weight: str) -> tuple[Capture, Capture]:
    engine = Capture(side="engine", engine="vllm", model="m", architecture="CohereForCausalLM", graphs=[],
                     logits_weight=engine_weight)
    train = Capture(side="train", engine="hf", model="m", architecture="CohereForCausalLM",
                    graphs=[Graph(name="g", nodes=[], inputs={"p0": "model.embed_tokens.weight",
                                                              "p1": "lm_head.weight"})])
    return engine, train


def test_an_untied_checkpoint_scored_with_the_embedding_is_named_as_two_models() -> None:
    engine, train = _captures("input embedding")
    notes = logits_notes(engine, train, {"tie_word_embeddings": False})
    assert len(notes) == 1 and "lm_head.weight" in notes[0] and "CohereForCausalLM" in notes[0]
    assert logits_notes(engine, train, {"tie_word_embeddings": True}) == []  # tied: one weight on both sides
    assert logits_notes(*_captures("lm_head.weight"), {"tie_word_embeddings": False}) == []
    assert logits_notes(*_captures(""), {"tie_word_embeddings": False}) == []  # not recorded: no claim
