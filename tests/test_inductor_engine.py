"""`--engine inductor`: the HF model under torch.compile behind the engine interface (engines/inductor.py), and what
its graphs needed of the capture and the replay (SymInt nodes, kernels listing nodes they do not compute)."""

from __future__ import annotations

import pytest
import torch

from graphdiff.capture.assemble import computable
from graphdiff.engines import inductor
from graphdiff.engines.base import EngineOptions
from graphdiff.errors import GraphdiffError
from graphdiff.records import BufferArg, EngineSample, Kernel, Node
from graphdiff.replay.values import numel, sym_value
from tests.conftest import PROMPT
from tests.test_cli_errors import one_error_line, run_cli


def test_sym_value_evaluates_dynamo_size_expressions():
    syms = {"s27": 16, "s0": 3}
    assert sym_value("s27", syms) == 16
    assert sym_value("s27 + 1", syms) == 17
    assert sym_value("2*s27 - s0", syms) == 29
    assert sym_value("s27 // 0", syms) is None
    assert sym_value("s99 + 1", syms) is None
    assert sym_value("sqrt(s27)", syms) is None
    assert numel([1, "s27 + 1"], syms) == 17


def _node(name: str, inputs: list[str], op: str = "call_function", sym: str | None = None) -> Node:
    return Node(name=name, op=op, target=name if op == "placeholder" else "aten.mul.Tensor", inputs=inputs,
                dtype=None if sym else "float32", sym=sym)


def test_a_kernel_does_not_compute_what_reads_a_later_value_or_an_input_it_is_not_passed():
    nodes = [_node("x", [], "placeholder"), _node("eps1", [], "placeholder"), _node("s", [], "placeholder", "s0"),
             _node("a", ["x", "s"]), _node("b", ["a", "eps1"]), _node("later", ["x"]), _node("c", ["later"])]
    first = Kernel(id="k0:1", name="k0", kind="generated", nodes=["a", "b", "c"],
                   args=[BufferArg(name="x", role="in"), BufferArg(name="buf0", role="out")])
    extern = Kernel(id="mm:2", name="mm", kind="extern", nodes=["later"], args=[])
    second = Kernel(id="k1:3", name="k1", kind="generated", nodes=["b", "c"],
                    args=[BufferArg(name="buf0", role="in"), BufferArg(name="eps1", role="in")])
    computable([first, extern, second], nodes)
    assert first.nodes == ["a"]  # b reads eps1, not passed to it; c reads the extern's later value
    assert second.nodes == ["b", "c"]


def test_a_kernel_reads_its_own_values_through_nodes_no_kernel_computes():
    # vLLM CPU's q/k norm kernel: it splits the QKV buffer itself, and its norm reads a getitem of that split
    nodes = [_node("s", [], "placeholder", "s0"), _node("qkv", ["s"]), _node("split", ["qkv"]),
             _node("getitem", ["split"]), _node("norm", ["getitem"])]
    kernel = Kernel(id="k0:1", name="k0", kind="generated", nodes=["qkv", "split", "norm"], args=[])
    computable([kernel], nodes)
    assert kernel.nodes == ["qkv", "split", "norm"]


def test_decode_shapes_and_vllm_options_are_refused():
    from graphdiff.capture.shapes import decode, prefill

    with pytest.raises(GraphdiffError, match="prefills only"):
        inductor.check_shapes([prefill(16), decode(8, 64)])
    with pytest.raises(GraphdiffError, match="vLLM's options"):
        inductor.check_options(EngineOptions(optimization_level=3))


def test_scan_refuses_decode_shapes_and_vllm_options_in_one_line(tmp_path):
    line = one_error_line(run_cli("scan", "tiny:qwen3", "--engine", "inductor", "--shapes", "16,decode:8x64",
                                  "--out", str(tmp_path / "o")))
    assert "prefills only" in line
    line = one_error_line(run_cli("scan", "tiny:qwen3", "--engine", "inductor", "-O", "3",
                                  "--out", str(tmp_path / "o")))
    assert "vLLM's options" in line
    line = one_error_line(run_cli("kl", "tiny:qwen3", "--engine", "inductor", "--modes", "--out", str(tmp_path / "k")))
    assert "one mode" in line
    line = one_error_line(run_cli("check", str(tmp_path / "none"), "--engine", "inductor", "-O", "3"))
    assert "vLLM's options" in line


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: cuda is not refused")
def test_device_cuda_without_a_gpu_is_refused_in_one_line_before_anything_starts(tmp_path):
    for args in (("scan", "tiny:qwen3"), ("capture", "tiny:qwen3"), ("kl", "tiny:qwen3")):
        res = run_cli(*args, "--engine", "inductor", "--device", "cuda", "--out", str(tmp_path / "o"))
        assert res.returncode != 0 and "--device cuda: torch sees no CUDA GPU" in one_error_line(res)
        assert not (tmp_path / "o").exists()
    res = run_cli("check", str(tmp_path / "none"), "--engine", "inductor", "--device", "cuda")
    assert res.returncode != 0 and "no CUDA GPU" in one_error_line(res)
    assert "only --engine inductor" in one_error_line(run_cli("scan", "tiny:qwen3", "--device", "cuda", "--out",
                                                              str(tmp_path / "o")))
    assert "choose cpu or cuda" in one_error_line(run_cli("scan", "tiny:qwen3", "--engine", "inductor", "--device",
                                                          "tpu", "--out", str(tmp_path / "o")))


def test_the_device_reaches_the_engine_options_and_its_record():
    inductor.check_options(EngineOptions(device="cpu"))
    with pytest.raises(GraphdiffError, match="choose cpu or cuda"):
        inductor.check_options(EngineOptions(device="mps"))


def test_teacher_forced_sequences_are_seeded_and_within_the_vocabulary():
    a = inductor.teacher_forced({"vocab_size": 50}, [[1, 2], [3, 4]], 20, seed=0)
    b = inductor.teacher_forced({"vocab_size": 50}, [[1, 2], [3, 4]], 20, seed=0)
    assert [s.tokens for s in a] == [s.tokens for s in b] and a[0].tokens != a[1].tokens
    assert all(len(s.tokens) == 20 and all(1 <= t < 50 for t in s.tokens) for s in a)
    assert a[1].prompt == [3, 4] and not a[0].logprobs


@pytest.fixture(scope="module")
def compiled(tiny_models):
    from graphdiff.capture.shapes import prefill, with_prompts
    from graphdiff.models.resolve import read_config

    model_dir = tiny_models["qwen3"]
    shapes = with_prompts([prefill(len(PROMPT)), prefill(40)], read_config(model_dir), first=PROMPT)
    engine = inductor.start(model_dir, shapes, EngineOptions(), lambda m: None)
    yield model_dir, engine
    engine.stop()


@pytest.fixture(scope="module")
def isolated(tiny_models, tmp_path_factory):
    """The compiled model captured as `scan --engine inductor` captures it: in a child process, whose Dynamo state
    no earlier test of this session touched."""
    from graphdiff.capture.shapes import prefill, with_prompts
    from graphdiff.models.resolve import read_config

    model_dir = tiny_models["qwen3"]
    shapes = with_prompts([prefill(len(PROMPT)), prefill(40)], read_config(model_dir), first=PROMPT)
    cap, buffers, _ = inductor.capture_isolated(model_dir, shapes, tmp_path_factory.mktemp("inductor-capture"),
                                                EngineOptions(engine="inductor"))
    return model_dir, cap, buffers


@pytest.mark.engine
def test_the_compiled_model_replays_at_every_shape_and_rounds_where_eager_does_not(isolated):
    from graphdiff.analysis.scan import analyze, run_train_side
    from graphdiff.models.resolve import read_config

    model_dir, cap, buffers = isolated
    assert cap.engine == "inductor" and len(cap.graphs) == 1
    assert cap.graphs[0].shapes == [s.label for s in cap.shapes] and set(buffers) == set(cap.graphs[0].shapes)
    train = run_train_side(model_dir, cap.prompt_tokens)
    result = analyze(cap, buffers, train, model="tiny:qwen3", layers_total=2, config=read_config(model_dir))
    generated = {k.id for k in cap.graphs[0].kernels if k.kind == "generated"}
    for label in cap.graphs[0].shapes:
        at = {r.kernel: r for r in result.replay if r.shape == label}
        assert set(at) == generated, label
        bad = [(k, r.error or r.predicted_bitexact) for k, r in at.items()
               if r.error or r.predicted_bitexact < 0.999]
        assert not bad, (label, bad)
    kinds = {r.kind for r in result.regions}
    assert {"norm_weight", "gated_act"} <= kinds, kinds  # eager rounds inside what Inductor fuses in FP32
    assert all(s.proven for s in result.sites)


@pytest.mark.engine
def test_score_is_the_compiled_models_teacher_forced_log_probs(compiled):
    model_dir, engine = compiled
    with pytest.raises(GraphdiffError, match="does not sample"):
        engine.sample([PROMPT], max_tokens=4)
    sample = EngineSample(prompt=PROMPT, tokens=[5, 77, 901], logprobs=[])
    engine.score([sample])
    assert len(sample.prefill_logprobs) == 3 and sample.logprobs == sample.prefill_logprobs
    with torch.no_grad():
        logits = engine.compiled(input_ids=torch.tensor([PROMPT + [5, 77, 901]]), use_cache=False).logits[0].float()
    want = torch.log_softmax(logits, -1)[torch.arange(len(PROMPT) - 1, len(PROMPT) + 2), torch.tensor([5, 77, 901])]
    assert sample.prefill_logprobs == want.tolist()


@pytest.mark.engine
def test_the_gate_and_the_gap_read_teacher_forced_scores_cached_or_scored_in_a_child(tiny_models, tmp_path):
    from graphdiff import engines
    from graphdiff.engines.samples import SAMPLES_FILE

    engine_runs = engines.kind("inductor").gap_samples
    options = EngineOptions(engine="inductor")
    model_dir = tiny_models["qwen3"]
    runs = engine_runs(model_dir, [PROMPT, PROMPT[:5]], ["compiled"], options, max_tokens=6, out_dir=tmp_path,
                       progress=lambda m: None)
    run = runs["compiled"]
    assert run.engine == "inductor" and (tmp_path / SAMPLES_FILE).is_file()
    assert [len(s.logprobs) for s in run.samples] == [6, 6]
    assert all(lp <= 0 for s in run.samples for lp in s.logprobs)
    said: list[str] = []
    again = engine_runs(model_dir, [PROMPT, PROMPT[:5]], ["compiled"], options, max_tokens=6, out_dir=tmp_path,
                        progress=said.append)["compiled"]  # from the cache: no compile
    assert again.samples == run.samples and any("cached" in m for m in said)
    with pytest.raises(GraphdiffError, match="one mode"):
        engine_runs(model_dir, [PROMPT], ["compiled", "eager"], options, max_tokens=6, out_dir=tmp_path,
                    progress=lambda m: None)
