"""Model directory checks shared by both capture sides (one clear error per bad input)."""

from __future__ import annotations

import json
from pathlib import Path

from graphdiff.errors import GraphdiffError


def read_config(model_dir: Path) -> dict:
    """config.json of a local HF checkpoint, or a GraphdiffError saying what is wrong."""
    if not model_dir.exists():
        raise GraphdiffError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise GraphdiffError(f"{model_dir} is not a directory (expected an HF checkpoint directory)")
    cfg = model_dir / "config.json"
    if not cfg.exists():
        raise GraphdiffError(f"{model_dir} has no config.json; is it an HF checkpoint?")
    try:
        config = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GraphdiffError(f"{cfg} is not valid JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(config, dict) or not config.get("architectures"):
        raise GraphdiffError(f"{cfg} names no architectures; cannot tell which model class to build")
    return config


def has_weights(model_dir: Path) -> bool:
    return any(model_dir.glob("*.safetensors")) or any(model_dir.glob("*.bin"))


def architecture(config: dict) -> str:
    return str(config["architectures"][0])
