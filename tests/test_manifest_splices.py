"""The manifest's splices: one record per target (as the runtime patches each), and a manifest of the schema before
them refused in one line naming the command that regenerates it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from graphdiff import runtime
from graphdiff.records import (
    MANIFEST_VERSION,
    AttentionSplice,
    CarrySplice,
    FunctionSplice,
    LinearSplice,
    Manifest,
    ManifestSplice,
    ModuleSplice,
    MoeSplice,
)

MANIFEST = {"kind": "graphdiff.manifest", "model": "m", "architecture": "A", "config_sha256": "", "config": {},
            "layers_scanned": 2, "module_file": "graphdiff_patch.py", "module_sha256": "", "regions": [],
            "splices": []}


RECORDS = {"module": ModuleSplice, "function": FunctionSplice, "carry": CarrySplice, "attention": AttentionSplice,
           "router": MoeSplice, "experts": MoeSplice, "linear": LinearSplice}


@pytest.mark.parametrize(("target", "record"), RECORDS.items())
def test_each_target_reads_as_its_own_record(target: str, record: type) -> None:
    fields = {"function": "f.g"} if target in ("function", "attention") else {"shards": 2} if target == "linear" else {}
    splice = TypeAdapter(ManifestSplice).validate_python({"key": "k", "target": target, "module": "m",
                                                          "regions": ["r"], **fields})
    assert type(splice) is record and splice.target == target


def test_a_manifest_round_trips_its_splices() -> None:
    manifest = Manifest.model_validate({**MANIFEST, "splices": [
        {"key": "k", "target": "carry", "module": "m", "regions": ["r"], "fp32_children": ["input_layernorm"]},
        {"key": "l", "target": "linear", "module": "m", "regions": ["r"], "shards": 2}]})
    again = Manifest.model_validate_json(manifest.model_dump_json())
    assert [type(s) for s in again.splices] == [CarrySplice, LinearSplice] and again == manifest
    assert "shards" not in manifest.model_dump()["splices"][0]  # a carry holds no field of another target


def test_an_older_manifest_is_refused_with_the_command_that_regenerates_it(tmp_path: Path) -> None:
    old = tmp_path / "manifest.json"
    old.write_text(json.dumps({**MANIFEST, "schema_version": MANIFEST_VERSION - 1}))
    with pytest.raises(runtime.PatchError) as e:
        runtime.load_manifest(old)
    message = str(e.value)
    assert "\n" not in message and f"schema {MANIFEST_VERSION - 1}" in message
    assert "regenerate it with `graphdiff patch SCAN_DIR --out DIR`" in message
