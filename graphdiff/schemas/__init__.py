"""JSON Schemas of everything graphdiff persists; regenerate with `python -m graphdiff.schemas`."""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

HERE = Path(__file__).parent


def models() -> dict[str, type[BaseModel]]:
    from graphdiff import records

    return {"capture": records.Capture, "scan": records.ScanResult, "kl": records.KLResult,
            "manifest": records.Manifest}


def render(cls: type[BaseModel]) -> str:
    return json.dumps(cls.model_json_schema(), indent=1, sort_keys=True) + "\n"


def write() -> list[Path]:
    paths = []
    for name, cls in models().items():
        path = HERE / f"{name}.schema.json"
        path.write_text(render(cls))
        paths.append(path)
    return paths
