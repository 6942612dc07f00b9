"""GPT-2 and OPT at the engine (issue 35, the dense tail), from the recorded 3-layer tiny OPT scan
(fixtures/scans/tiny-opt-3, recorded from a real run: fixtures/scans/README.md).

The patched trainer's first departures, in the order the fixes removed them: the embedding sum (`inputs_embeds +
pos_embeds`, two children's outputs summed by the decoder's own code) rounded by the trainer and read in FP32 by the
first layer's kernels; the last layer's norm, whose kernel stores its input (the residual re-sum) alone in BF16 and
reads every pass from that copy, the mean too; and OPT's `residual = hidden_states.reshape(...)`, a view of a stored
sum that the next add reads rounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graphdiff import runtime
from graphdiff.analysis.scan import norm_reads_stored, norm_rereads
from graphdiff.capture.hf import load_hf_model
from graphdiff.codegen import generate
from graphdiff.models.tiny import make_tiny
from graphdiff.records import Capture, ScanResult
from graphdiff.replay.sum_order import ordered_layer_norm
from tests.conftest import FIXTURES

OPT = FIXTURES / "scans" / "tiny-opt-3"
EMBED = "model.decoder#residual_norm"
FINAL_NORM = "model.decoder.layers.*.final_layer_norm#sum_order"


@pytest.fixture(scope="module")
def patch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("opt") / "patch"
    generate(OPT, out)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    return load_hf_model(make_tiny("opt", tmp_path_factory.mktemp("opt") / "model", layers=3))


def test_the_norm_kernels_that_read_their_stored_input_are_told_apart() -> None:
    """Layer 0's post-attention norm kernel sums the mean over the FP32 sum and reads the rest back from its store;
    layer 2's stores the sum alone in a loop nest of its own and reads every pass from the copy; the others
    recompute the FP32 sum in every pass."""
    train = Capture.model_validate_json((OPT / "train.capture.json").read_text()).graphs[0]
    engine = Capture.model_validate_json((OPT / "engine" / "capture.json").read_text()).graphs
    assert norm_rereads(train, engine) == ["model.decoder.layers.0.final_layer_norm"]
    assert norm_reads_stored(train, engine) == ["model.decoder.layers.2.final_layer_norm"]
    scan = ScanResult.model_validate_json((OPT / "scan.json").read_text())
    assert scan.norm_reads_stored == ["model.decoder.layers.2.final_layer_norm"]


def test_the_embedding_sum_is_handed_to_the_first_layer_in_fp32(patch: Path, model: torch.nn.Module) -> None:
    manifest = json.loads((patch / "manifest.json").read_text())
    carry = next(s for s in manifest["splices"] if s["regions"] == [EMBED])
    assert carry["fp32_outputs"] == ["embed_positions", "embed_tokens"]
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    decoder, seen, parts = model.model.decoder, [], []
    hooks = [decoder.layers[0].register_forward_pre_hook(
                 lambda m, a, kw: seen.append((a[0] if a else kw["hidden_states"]).detach()), with_kwargs=True),
             *(child.register_forward_hook(lambda m, a, out: parts.append(out.detach()))
               for child in (decoder.embed_tokens, decoder.embed_positions))]
    try:
        model(ids)
        runtime.apply(model, patch, regions=[EMBED])
        try:
            model(ids)
        finally:
            runtime.remove(model)
    finally:
        for h in hooks:
            h.remove()
    plain, patched = seen
    want = parts[0].float() + parts[1].float()  # the unpatched run's BF16 embeddings, summed in FP32
    assert plain.dtype == torch.bfloat16 and torch.equal(plain, want.bfloat16())
    assert patched.dtype == torch.float32 and torch.equal(patched, want)
    assert not torch.equal(patched, plain.float())


def test_a_norm_reading_every_pass_from_its_store_normalizes_the_rounded_input(patch: Path,
                                                                               model: torch.nn.Module) -> None:
    manifest = json.loads((patch / "manifest.json").read_text())
    groups = sorted(s["layers"] for s in manifest["splices"] if FINAL_NORM in s["regions"])
    assert groups == [[0], [1], [2]]
    source = (patch / "graphdiff_patch.py").read_text()
    assert sum("ordered_layer_norm(_round(x, torch.bfloat16)" in line for line in source.splitlines()) == 1
    x = torch.randn(64, model.config.hidden_size, generator=torch.Generator().manual_seed(1)) * 4
    runtime.apply(model, patch, regions=[FINAL_NORM])
    try:
        for ly, want_input, stored in ((0, x, torch.bfloat16), (1, x, None), (2, x.bfloat16().float(), None)):
            norm = model.model.decoder.layers[ly].final_layer_norm
            want = ordered_layer_norm(want_input, [x.shape[-1]], norm.weight.float(), norm.bias.float(), norm.eps,
                                      32, stored)[0].to(torch.bfloat16)
            assert torch.equal(norm(x), want), ly
        last = model.model.decoder.layers[2].final_layer_norm
        mean_fp32 = ordered_layer_norm(x, [x.shape[-1]], last.weight.float(), last.bias.float(), last.eps, 32,
                                       torch.bfloat16)[0].to(torch.bfloat16)
        assert not torch.equal(last(x), mean_fp32)  # the mean reads the store too
    finally:
        runtime.remove(model)
