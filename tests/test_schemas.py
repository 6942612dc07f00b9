"""The checked-in JSON Schemas are the ones the data model produces (regenerate: python -m graphdiff.schemas)."""

from graphdiff.schemas import HERE, models, render


def test_schema_files_are_current():
    for name, cls in models().items():
        path = HERE / f"{name}.schema.json"
        assert path.exists(), f"missing {path}; run python -m graphdiff.schemas"
        assert path.read_text() == render(cls), f"{path} is stale; run python -m graphdiff.schemas"


def test_fixture_dump_capture_validates(tmp_path):
    import jsonschema

    from graphdiff.engines.dump import import_dump
    from tests.conftest import FIXTURES

    cap = import_dump(FIXTURES / "dumps" / "vllm-cpu-tiny-qwen3")
    schema = __import__("json").loads((HERE / "capture.schema.json").read_text())
    jsonschema.validate(__import__("json").loads(cap.model_dump_json()), schema)
