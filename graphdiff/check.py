"""`graphdiff check MANIFEST`: the training repo's CI gate for a checked-in patch.

It re-scans the trainer *with the patch applied* against the engine as configured now (the manifest's compile
config unless another is given), and compares what the patch was made for with what is installed and asked for
now: package versions, the model config, the engine's compilation config. The patch still holds when the scan
finds no one-sided site that a generated region should have aligned, and nothing it was made for has changed.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
from collections.abc import Callable
from pathlib import Path

from graphdiff.capture.shapes import parse_shapes
from graphdiff.capture.vllm_cpu import split_level
from graphdiff.errors import GraphdiffError
from graphdiff.records import CheckFinding, CheckResult, Manifest

Progress = Callable[[str], None]
# The parts of the effective compilation config that decide where the engine rounds.
ENGINE_KEYS = ("mode", "backend", "splitting_ops", "custom_ops", "enabled_custom_ops", "compile_sizes",
               "pass_config", "optimization_level", "tensor_parallel_size", "use_inductor_graph_partition")


def installed_versions() -> dict[str, str]:
    out = {}
    for name, dist in (("torch", "torch"), ("transformers", "transformers"), ("vllm", None)):
        if dist is None:  # vllm-cpu or vllm: whichever provides the `vllm` package
            dists = importlib.metadata.packages_distributions().get("vllm") or []
            dist = dists[0] if dists else None
        if dist is not None:
            try:
                out[name] = importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
    return out


def _base(v: str) -> str:
    return v.split("+")[0]


def version_findings(manifest: Manifest, installed: dict[str, str]) -> list[CheckFinding]:
    return [CheckFinding(kind="version", what=name, was=made, now=installed.get(name, "not installed"))
            for name, made in sorted(manifest.versions.items())
            if name in ("torch", "transformers", "vllm") and _base(made) != _base(installed.get(name, ""))]


def config_findings(manifest: Manifest, config: dict) -> list[CheckFinding]:
    """Model-config fields the patch depends on that the model has otherwise now."""
    from graphdiff.analysis.scan import scanned_config_of
    from graphdiff.models.resolve import cut_layers

    normalized = scanned_config_of(cut_layers(config, manifest.layers_scanned))
    return [CheckFinding(kind="model config", what=key, was=json.dumps(made), now=json.dumps(normalized.get(key)))
            for key, made in manifest.config.items() if normalized.get(key) != made]


def engine_findings(manifest: Manifest, effective: dict) -> list[CheckFinding]:
    return [CheckFinding(kind="compile config", what=key, was=json.dumps(manifest.engine_config.get(key)),
                         now=json.dumps(effective.get(key)))
            for key in ENGINE_KEYS if manifest.engine_config.get(key) != effective.get(key)
            and (key in manifest.engine_config or key in effective)]


def _shapes(manifest: Manifest) -> str:
    return ",".join(label.removeprefix("prefill-").replace("decode-", "decode:") for label in manifest.shapes)


def check(manifest_path: Path, *, model: str | None = None, compilation_config: dict | None = None,
          optimization_level: int | None = None, shapes: str | None = None, out: Path | None = None,
          progress: Progress = lambda m: None) -> CheckResult:
    """Re-scan the patched trainer against the engine; findings = why the patch must be regenerated."""
    from graphdiff.artifacts import ScanDir
    from graphdiff.pipeline import prepare_model, scan
    from graphdiff.runtime import load_manifest

    path = manifest_path / "manifest.json" if manifest_path.is_dir() else manifest_path
    manifest = load_manifest(path)
    spec = model or manifest.model
    asked, level = split_level(manifest.compilation_config if compilation_config is None else compilation_config)
    level = optimization_level if optimization_level is not None else level
    findings = version_findings(manifest, installed_versions())
    resolved, _ = prepare_model(spec, manifest.layers_scanned, None, progress)
    findings += config_findings(manifest, resolved.config)
    result = CheckResult(manifest=str(path), model=spec, findings=findings,
                         regenerate=manifest.scan_command or f"graphdiff scan {shlex.quote(spec)} --patch")
    if any(f.kind == "model config" for f in findings):
        result.notes.append("not re-scanned: the patch does not apply to this model config")
        result.ok = False
        return result
    wanted = parse_shapes(shapes or _shapes(manifest) or "16", 16)
    d = ScanDir(out) if out is not None else None
    outcome = scan(spec, layers=manifest.layers_scanned, shapes=wanted, out=d, progress=progress, manifest=path,
                   compilation_config=asked, optimization_level=level, allow_version_mismatch=True)
    if d is not None:  # the re-scan, kept (what the patch leaves: `graphdiff report DIR`, `graphdiff explain`)
        d.save_train(outcome.train.capture)
        d.save_scan(outcome.result)
    result.findings += engine_findings(manifest, outcome.result.engine_config)
    expected = {s for r in manifest.regions if r.generated and r.enabled for s in r.sites}
    known = {s for r in manifest.regions for s in r.sites} - expected
    for s in outcome.result.sites:
        if s.id in known:
            result.left_out.append(s.id)
        else:
            result.findings.append(CheckFinding(kind="site", what=s.id, was="aligned by the patch" if s.id in expected
                                                else "not found when the patch was made",
                                                now=f"rounded on the {s.rounded_on} side only ({s.region})"))
    result.sites_left = len(outcome.result.sites)
    result.ok = not result.findings
    return result


def markdown(result: CheckResult) -> str:
    head = "### graphdiff check: the patch still holds" if result.ok else \
        "### graphdiff check: the patch must be regenerated"
    lines = [head, "", f"`{result.manifest}` for `{result.model}`", ""]
    if result.findings:
        lines += ["| what changed | item | when patched | now |", "|---|---|---|---|"]
        lines += [f"| {f.kind} | `{f.what}` | {f.was} | {f.now} |" for f in result.findings]
        lines += ["", f"Regenerate: `{result.regenerate}`"]
    if result.left_out:
        lines += ["", f"{len(result.left_out)} site(s) the patch leaves by design (regions it does not align)."]
    lines += [f"- {n}" for n in result.notes]
    return "\n".join(lines) + "\n"


def text(result: CheckResult) -> str:
    if result.ok:
        out = [f"ok: {result.manifest} still holds for {result.model} (0 sites it should align, versions, model "
               "config and compile config unchanged)"]
    else:
        out = [f"the patch must be regenerated ({len(result.findings)} finding(s)):"]
        out += [f"  {f.kind}: {f.what}: {f.was} -> {f.now}" for f in result.findings]
        out.append(f"regenerate: {result.regenerate}")
    out += [f"note: {n}" for n in result.notes]
    return "\n".join(out)


def render(result: CheckResult, fmt: str) -> str:
    if fmt == "json":
        return result.model_dump_json(indent=1)
    if fmt == "markdown":
        return markdown(result)
    if fmt == "text":
        return text(result)
    raise GraphdiffError(f"unknown format {fmt!r}; choose text, json or markdown")
