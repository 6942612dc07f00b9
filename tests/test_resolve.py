"""Offline model resolution: bundled configs are real and loadable, and each kind of spec resolves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from graphdiff.errors import GraphdiffError
from graphdiff.models.resolve import bundled_ids, find_in_hf_cache, resolve_model
from graphdiff.models.tiny import make_tiny

CONFIGS = Path(__file__).resolve().parent.parent / "graphdiff" / "models" / "configs"

REQUIRED_IDS = [
    *(f"Qwen/Qwen3-{size}" for size in ("0.6B", "1.7B", "4B", "8B", "14B", "32B")),
    *(f"Qwen/Qwen3-{size}-Base" for size in ("1.7B", "4B", "8B")),
    *(f"Qwen/Qwen2.5-{size}" for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")),
    *(f"Qwen/Qwen2.5-{size}-Instruct" for size in ("0.5B", "1.5B", "3B", "7B", "14B", "32B", "72B")),
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
    "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B",
    "meta-llama/Llama-3.1-8B",
    "meta-llama/Llama-3.1-8B-Instruct",
    "meta-llama/Llama-3.1-70B",
    "meta-llama/Llama-3.2-1B",
    "meta-llama/Llama-3.2-1B-Instruct",
    "meta-llama/Llama-3.2-3B",
    "meta-llama/Llama-3.2-3B-Instruct",
]


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No hub, an empty HF cache and a private tiny-model cache, whatever the machine has."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("GRAPHDIFF_CACHE", str(tmp_path / "graphdiff-cache"))


def load_config(cfg: dict):
    """The transformers config class built from a config.json dict (raises if the dict is invalid)."""
    kwargs = dict(cfg)
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def test_every_required_id_is_bundled():
    assert set(REQUIRED_IDS) <= set(bundled_ids())
    assert len(bundled_ids()) == len(list(CONFIGS.glob("*.json")))


@pytest.mark.parametrize("model_id", bundled_ids())
def test_bundled_config_loads_in_transformers(model_id: str, tmp_path: Path):
    cfg = json.loads((CONFIGS / (model_id.replace("/", "--") + ".json")).read_text())
    config = load_config(cfg)
    assert type(config).__name__.removesuffix("Config").lower() == cfg["model_type"].replace("_", "")
    assert config.num_hidden_layers == cfg["num_hidden_layers"] and config.vocab_size == cfg["vocab_size"]
    # The materialized directory loads the way engines load it: from_pretrained on a local path.
    resolved = resolve_model(model_id, work_dir=tmp_path)
    assert AutoConfig.from_pretrained(resolved.path).hidden_size == cfg["hidden_size"]


def shape(model_id: str) -> tuple:
    cfg = json.loads((CONFIGS / (model_id.replace("/", "--") + ".json")).read_text())
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "intermediate_size")
    return (*(cfg[k] for k in keys), cfg["vocab_size"], cfg.get("head_dim"), cfg["tie_word_embeddings"])


@pytest.mark.parametrize(
    "model_id, expected",
    [
        ("Qwen/Qwen3-8B", (4096, 36, 32, 8, 12288, 151936, 128, False)),
        ("Qwen/Qwen3-0.6B", (1024, 28, 16, 8, 3072, 151936, 128, True)),
        ("Qwen/Qwen3-32B", (5120, 64, 64, 8, 25600, 151936, 128, False)),
        ("Qwen/Qwen2.5-7B-Instruct", (3584, 28, 28, 4, 18944, 152064, None, False)),
        ("Qwen/Qwen2.5-0.5B", (896, 24, 14, 2, 4864, 151936, None, True)),
        ("Qwen/Qwen2.5-72B-Instruct", (8192, 80, 64, 8, 29568, 152064, None, False)),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", (1536, 28, 12, 2, 8960, 151936, None, False)),
        ("meta-llama/Llama-3.1-8B", (4096, 32, 32, 8, 14336, 128256, None, False)),
        ("meta-llama/Llama-3.2-1B", (2048, 16, 32, 8, 8192, 128256, 64, True)),
        ("meta-llama/Llama-3.1-70B", (8192, 80, 64, 8, 28672, 128256, None, False)),
    ],
)
def test_key_numbers(model_id: str, expected: tuple):
    assert shape(model_id) == expected


def test_family_details():
    cfg = {m: json.loads((CONFIGS / (m.replace("/", "--") + ".json")).read_text()) for m in bundled_ids()}
    llama31 = cfg["meta-llama/Llama-3.1-8B"]
    assert llama31["rope_scaling"]["rope_type"] == "llama3" and llama31["rope_scaling"]["factor"] == 8.0
    assert llama31["rope_theta"] == 500000.0 and llama31["eos_token_id"] == 128001
    assert cfg["meta-llama/Llama-3.1-8B-Instruct"]["eos_token_id"] == [128001, 128008, 128009]
    assert cfg["meta-llama/Llama-3.2-3B"]["rope_scaling"]["factor"] == 32.0
    assert cfg["Qwen/Qwen3-8B"]["eos_token_id"] == 151645 and cfg["Qwen/Qwen3-8B"]["max_position_embeddings"] == 40960
    assert cfg["Qwen/Qwen3-8B-Base"]["eos_token_id"] == 151643
    assert cfg["Qwen/Qwen3-8B-Base"]["max_position_embeddings"] == 32768
    assert cfg["deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"]["rope_theta"] == 10000
    # Qwen2 has q/k/v biases in the architecture itself (no config flag); Qwen3 and Llama say none.
    assert all(cfg[m]["attention_bias"] is False for m in cfg if cfg[m]["model_type"] in ("qwen3", "llama"))


def test_local_directory_is_used_as_is(tmp_path: Path):
    path = make_tiny("qwen3", tmp_path / "m", layers=2)
    resolved = resolve_model(str(path), layers=1)
    assert (resolved.path, resolved.origin, resolved.has_weights) == (path, "local", True)
    assert resolved.config["num_hidden_layers"] == 2


@pytest.mark.parametrize("bad", ["missing", "corrupt", "no-architectures", "file"])
def test_bad_local_directory_raises(tmp_path: Path, bad: str):
    path = tmp_path / bad
    if bad == "file":
        path.write_text("{}")
    elif bad != "missing":
        path.mkdir()
        (path / "config.json").write_text("{not json" if bad == "corrupt" else '{"model_type": "qwen3"}')
    with pytest.raises(GraphdiffError):
        resolve_model(str(path))


def test_tiny_spec():
    resolved = resolve_model("tiny:llama:1")
    assert resolved.origin == "tiny" and resolved.has_weights
    assert resolved.config["num_hidden_layers"] == 1 and resolved.config["architectures"] == ["LlamaForCausalLM"]
    assert resolve_model("tiny:llama", layers=1).path == resolved.path
    with pytest.raises(GraphdiffError):
        resolve_model("tiny:llama:x")


def test_bundled_id_with_layers_is_a_valid_config_only_checkpoint(tmp_path: Path):
    resolved = resolve_model("Qwen/Qwen3-8B", work_dir=tmp_path, layers=2)
    assert resolved.origin == "bundled" and not resolved.has_weights
    assert resolved.path.parent == tmp_path and sorted(p.name for p in resolved.path.iterdir()) == ["config.json"]
    assert resolved.config["num_hidden_layers"] == 2 and resolved.config["max_window_layers"] == 2
    config = AutoConfig.from_pretrained(resolved.path)
    assert config.num_hidden_layers == 2 and len(config.layer_types) == 2
    assert config.hidden_size == 4096 and config.head_dim == 128
    with pytest.raises(GraphdiffError):
        resolve_model("Qwen/Qwen3-8B", work_dir=tmp_path, layers=37)


def test_bundled_id_without_work_dir_uses_a_temp_dir():
    resolved = resolve_model("meta-llama/Llama-3.2-1B")
    assert resolved.path.is_dir() and resolved.config["num_hidden_layers"] == 16
    assert json.loads((resolved.path / "config.json").read_text()) == resolved.config


def test_per_layer_lists_are_cut(tmp_path: Path):
    """An HF-cache config saved by transformers 5 lists layer_types; a cut must keep it consistent."""
    snapshot = fake_snapshot(tmp_path / "hf-hub", "Qwen/Qwen3-8B", "abc")
    cfg = json.loads((snapshot / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * 36
    (snapshot / "config.json").write_text(json.dumps(cfg))
    resolved = resolve_model("Qwen/Qwen3-8B", work_dir=tmp_path / "work", layers=3)
    assert resolved.config["layer_types"] == ["full_attention"] * 3
    assert load_config(resolved.config).num_hidden_layers == 3


def fake_snapshot(hub: Path, model_id: str, rev: str, weights: bool = False, hidden: int = 4096) -> Path:
    """The HF cache layout: models--Org--Name/snapshots/<rev>/ (files) and refs/main (the revision)."""
    repo = hub / ("models--" + model_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    cfg = json.loads((CONFIGS / (model_id.replace("/", "--") + ".json")).read_text())
    (snapshot / "config.json").write_text(json.dumps({**cfg, "hidden_size": hidden}))
    if weights:
        (snapshot / "model.safetensors").write_bytes(b"")
    return snapshot


def test_hf_cache_takes_precedence_over_bundled(tmp_path: Path):
    hub = tmp_path / "hf-hub"
    fake_snapshot(hub, "Qwen/Qwen3-8B", "old", hidden=1111)
    main = fake_snapshot(hub, "Qwen/Qwen3-8B", "new", weights=True, hidden=2222)
    (hub / "models--Qwen--Qwen3-8B" / "refs").mkdir()
    (hub / "models--Qwen--Qwen3-8B" / "refs" / "main").write_text("new\n")
    assert find_in_hf_cache("Qwen/Qwen3-8B") == main
    resolved = resolve_model("Qwen/Qwen3-8B", work_dir=tmp_path / "work")
    assert (resolved.origin, resolved.path, resolved.has_weights) == ("hf-cache", main, True)
    assert resolved.config["hidden_size"] == 2222
    # A cut keeps the snapshot's weights beside the cut config, and leaves the cache untouched.
    cut = resolve_model("Qwen/Qwen3-8B", work_dir=tmp_path / "work", layers=2)
    assert cut.origin == "hf-cache" and cut.has_weights and cut.path != main
    assert cut.config["num_hidden_layers"] == 2 and cut.config["hidden_size"] == 2222
    assert json.loads((main / "config.json").read_text())["num_hidden_layers"] == 36


def test_hf_cache_without_refs_and_hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    assert find_in_hf_cache("Qwen/Qwen3-8B") is None
    snapshot = fake_snapshot(tmp_path / "hf-home" / "hub", "Qwen/Qwen3-8B", "only")
    assert find_in_hf_cache("Qwen/Qwen3-8B") == snapshot
    assert resolve_model("Qwen/Qwen3-8B").origin == "hf-cache"


def test_unknown_id_names_the_ways_forward():
    with pytest.raises(GraphdiffError) as err:
        resolve_model("nobody/no-such-model")
    message = str(err.value)
    assert "\n" not in message and "local checkpoint directory" in message and "graphdiff configs" in message
