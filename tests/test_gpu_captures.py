"""A capture recorded on a CUDA machine, analysed on this CPU-only one (issue 46, item 1).

No GPU is needed to make one: the recorded tiny-Qwen3 CPU capture is re-tagged as CUDA (every device in its graphs
`cuda:0`, every storage of buffers.pt saved with the tag `cuda:0`), which a plain torch.load here refuses. The scan
reads it with its buffers mapped to the CPU, keeps the recorded device as a fact, replays every C++ kernel on the CPU
and proves every one of them, as it does the original."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.serialization

from graphdiff.records import Graph, Kernel, KernelRecord, Node
from tests.conftest import FIXTURES

RECORDED = FIXTURES / "captures" / "tiny-qwen3-avx512_bf16"
CUDA = "cuda:0"


def _on_cuda(value: Any) -> Any:
    """A capture.json graph value with every recorded device (`{"device": "cpu"}` args, `device=cpu` text) CUDA's."""
    if isinstance(value, dict):
        return {k: CUDA if k == "device" and v == "cpu" else _on_cuda(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_on_cuda(v) for v in value]
    if isinstance(value, str):
        return value.replace("device=cpu", f"device={CUDA}")
    return value


def save_tagged(obj: Any, path: Path, tag: str) -> None:
    """torch.save with every CPU storage tagged `tag`, as a machine with that device saves its tensors."""
    entry = (-1000, lambda s: tag if s.device.type == "cpu" else None, lambda s, location: None)
    registry = torch.serialization._package_registry  # noqa: SLF001 - the only way to tag storages without a GPU
    registry.insert(0, entry)  # before every other tagger (register_package sorts; lowest priority value first)
    try:
        torch.save(obj, path)
    finally:
        registry.remove(entry)


def retag_as_cuda(src: Path, dst: Path) -> Path:
    """A copy of the engine capture `src` in `dst` as a CUDA machine would have written it."""
    dst.mkdir(parents=True, exist_ok=True)
    data = json.loads((src / "capture.json").read_text())
    data["graphs"] = _on_cuda(data["graphs"])
    (dst / "capture.json").write_text(json.dumps(data))
    save_tagged(torch.load(src / "buffers.pt", weights_only=False), dst / "buffers.pt", CUDA)
    return dst


@pytest.fixture(scope="module")
def retagged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return retag_as_cuda(RECORDED, tmp_path_factory.mktemp("cuda-capture"))


@pytest.fixture(scope="module")
def scans(retagged: Path, tiny_models: dict[str, Path]) -> Iterator[tuple[Any, Any]]:
    """(the original capture's scan, the re-tagged one's)."""
    from graphdiff.pipeline import scan

    yield (scan(str(tiny_models["qwen3"]), engine_dump=RECORDED),
           scan(str(tiny_models["qwen3"]), engine_dump=retagged))


def test_the_retagged_capture_is_a_cuda_one(retagged: Path) -> None:
    """What the issue reports: without a map, torch.load refuses it on a machine with no GPU."""
    text = (retagged / "capture.json").read_text()
    assert '"device": "cuda:0"' in text and '"device": "cpu"}' not in text.split('"attention"')[0]
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: torch.load maps CUDA storages itself")
    with pytest.raises(RuntimeError, match="CUDA"):
        torch.load(retagged / "buffers.pt", weights_only=False)


def test_it_loads_on_the_cpu_and_keeps_the_recorded_device(retagged: Path, tiny_models: dict[str, Path]) -> None:
    from graphdiff.engines.store import load_engine_capture

    cap, buffers = load_engine_capture(retagged, tiny_models["qwen3"])
    assert cap.device == CUDA
    tensors = [t for records in buffers.values() for rec in records.values()
               for t in (*rec["in"].values(), *rec["out"].values()) if isinstance(t, torch.Tensor)]
    assert tensors and all(t.device.type == "cpu" for t in tensors)
    assert load_engine_capture(RECORDED, tiny_models["qwen3"])[0].device == "cpu"


def test_every_kernel_is_proven_as_in_the_original(scans: tuple[Any, Any]) -> None:
    original, cuda = scans
    result = cuda.result
    generated = [r for r in result.replay if not r.kernel.startswith("torch.ops")]
    assert generated and all(r.predicted_bitexact >= 0.999 for r in generated), \
        [(r.kernel, r.predicted_bitexact) for r in generated if r.predicted_bitexact < 0.999]
    assert not result.not_replayed and not result.unexplained and not result.unregistered_externs
    assert [(r.name, r.kind, r.layers, r.proven) for r in result.regions] == \
        [(r.name, r.kind, r.layers, r.proven) for r in original.result.regions]
    assert [(r.kernel, r.shape, r.predicted_bitexact) for r in result.replay] == \
        [(r.kernel, r.shape, r.predicted_bitexact) for r in original.result.replay]
    assert (result.engine_device, original.result.engine_device) == (CUDA, "cpu")
    assert any(f"on {CUDA}" in n for n in result.notes), result.notes


def test_replay_explain_patch_and_report_read_its_scan_directory(scans: tuple[Any, Any], tmp_path: Path) -> None:
    """The scan directory as `scan --engine-dump --out` writes it: its capture, saved with the buffers now on the
    CPU, still says where they were recorded; `replay`, `explain`, `patch` and `report` read it."""
    from graphdiff.artifacts import ScanDir
    from graphdiff.codegen.generate import make_patch, write_patch
    from graphdiff.engines.store import save_engine_capture
    from graphdiff.report.explain import explain_lines, find_site, replay_one
    from graphdiff.report.html import write_report

    _, cuda = scans
    d = ScanDir(tmp_path / "scan")
    save_engine_capture(cuda.engine.model_copy(deep=True), cuda.buffers, d.engine_dir)
    d.save_train(cuda.train.capture)
    d.save_scan(cuda.result)
    assert d.load_engine(cuda.model_dir)[0].device == CUDA
    kernel = next(r for r in cuda.result.replay if r.kernel.startswith("cpp_"))
    one = replay_one(d.root, kernel.kernel, kernel.shape)
    assert not one.evidence.error and one.evidence.predicted_bitexact == pytest.approx(kernel.predicted_bitexact)
    site = cuda.result.sites[0]
    assert any("proven" in line for line in explain_lines(d.root, d.check_parts(), find_site(cuda.result, site.id)))
    assert write_patch(make_patch(cuda.result, cuda.train.capture), d.patch_dir).regions
    (html,) = write_report(d.root)
    assert f"engine recorded on <b>{CUDA}</b>" in html.read_text()


def test_factory_ops_recorded_on_cuda_build_on_the_cpu() -> None:
    from graphdiff.replay.interpreter import run_fragment

    node = Node(name="full", op="call_function", target="aten.full.default", dtype="float32", shape=[2, 3],
                call=[[[2, 3], 1.5], {"dtype": {"dtype": "float32"}, "device": {"device": CUDA}}])
    run = run_fragment([node], {}, {"full": "float32"}, "fp32", {})
    assert run.ok, run.error
    assert run.values["full"].device.type == "cpu" and run.values["full"].sum().item() == 9.0


def test_a_looped_triton_reduction_replays_on_cuda_only_and_a_pointwise_one_on_the_cpu() -> None:
    """The kernel's code decides its replay: a Triton kernel whose order is known (pointwise) is replayed on the CPU;
    a looped reduction (blocks chosen at launch) is named, never proven, whatever device it ran on."""
    from graphdiff.replay.kernels import CUDA_ONLY, cpu_replayable, kernel_language, replay_kernel

    add = Node(name="add", op="call_function", target="aten.add.Tensor", dtype="bfloat16", shape=[4],
               call=[[{"node": "x"}, {"node": "x"}], {}])
    code = "import triton\n@triton.jit\ndef triton_poi_fused_add_0(in_ptr0, out_ptr0, xnumel, XBLOCK):\n    pass\n"
    k = Kernel(id="triton_poi_fused_add_0:1", name="triton_poi_fused_add_0", kind="generated", nodes=["add"],
               code=code)
    graph = Graph(name="g", nodes=[Node(name="x", op="placeholder", target="x", dtype="bfloat16", shape=[4]), add],
                  kernels=[k])
    x = torch.arange(4, dtype=torch.bfloat16)
    record: KernelRecord = {"in": {"in_ptr0": x}, "out": {"out_ptr0": x + x}, "scalars": {}}
    assert kernel_language(k) == "triton" and cpu_replayable(k, record) == ""
    looped = k.model_copy(update={"code": code.replace("    pass", "    for r0_offset in range(0, 4, R0_BLOCK):\n"
                                                                   "        acc = tl.sum(x, 1)")})
    evidence, _, _ = replay_kernel(graph, looped, record, {}, set())
    assert evidence.error.startswith(CUDA_ONLY) and evidence.predicted_bitexact == 0.0
    assert cpu_replayable(looped, {**record, "launch": {"XBLOCK": 1, "R0_BLOCK": 4}}) == ""  # its blocks recorded


def test_check_rescans_the_patch_against_the_cuda_capture(scans: tuple[Any, Any], retagged: Path,
                                                           tmp_path: Path) -> None:
    """`check --engine-dump`: the patch made from the CUDA capture's scan still holds against that capture."""
    from graphdiff.check import check
    from graphdiff.codegen.generate import make_patch, write_patch

    _, cuda = scans
    write_patch(make_patch(cuda.result, cuda.train.capture), tmp_path / "patch")
    result = check(tmp_path / "patch", engine_dump=retagged, out=tmp_path / "rescan")
    assert not [f for f in result.findings if f.kind != "version"], result.findings  # versions: this machine's
    rescan = json.loads((tmp_path / "rescan" / "scan.json").read_text())
    assert rescan["engine_device"] == CUDA and not rescan["not_replayed"] and not rescan["unexplained"]


def test_a_dump_records_its_device_and_its_kernels_code_decides_their_replay() -> None:
    """The real H200 Triton dump: device `cuda` from its graph, every generated kernel Triton, the one looped
    reduction among them replaying on CUDA only; the vLLM CPU dump: `cpu`, C++ kernels."""
    from graphdiff.engines.dump import import_dump
    from graphdiff.replay.kernels import cpu_replayable, kernel_language

    for name, device, language in (("inductor-triton-h200-tiny-qwen3-hf", "cuda", "triton"),
                                   ("vllm-cpu-tiny-qwen3", "cpu", "cpp")):
        cap = import_dump(FIXTURES / "dumps" / name)
        kernels = [k for g in cap.graphs for k in g.kernels if k.kind == "generated"]
        assert cap.device == device and kernels and {kernel_language(k) for k in kernels} == {language}, name
        looped = {k.name for k in kernels if "r0_offset in" in (k.code or "") and "tl.sum(" in (k.code or "")}
        assert all(bool(cpu_replayable(k)) == (k.name in looped) for k in kernels), name
        assert (len(looped) == 1) == (language == "triton"), looped  # the H200 dump's one looped reduction
