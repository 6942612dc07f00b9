"""The bad-input sweep: every subcommand and `runtime.apply` given what a new user gets wrong.

`build_workspace` makes the files the cases refer to (a tiny model, a weightless and a truncated checkpoint, a scan
and a patch and broken copies of them); `run_cases` runs the cases in one helper process that imports graphdiff
once and forks a fresh process per case (`python -m tests.test_bad_input_cases WORKSPACE NAME...`), recording its
exit code, stderr, whether vllm was imported, and the workspace's file tree before and after.
Used by tests/test_bad_input.py and benchmarks/bad_inputs.py (docs/BAD_INPUTS.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_SCAN = ROOT / "fixtures" / "scans" / "tiny-qwen3"


@dataclass
class Case:
    name: str
    argv: list[str] = field(default_factory=list)  # after `graphdiff`; "{ws}" is the workspace
    says: str = ""  # a part of the one line it prints
    exit: int = 2
    code: str = ""  # Python run instead of the CLI (runtime.apply); "{ws}" as above
    engine: bool = False  # needs an engine start (not run by the fast suite)
    suite: bool = True  # run by tests/test_bad_input.py (False: the same check as another case, on a slower path)


NOT_WRITABLE = "not writable (cannot write in /proc"


def _cases() -> list[Case]:
    m, w = "{ws}/model", "{ws}"
    cc99 = ["-cc", '{"mode": 99}']
    return [
        # make-tiny
        Case("make-tiny without arguments", ["make-tiny"], "give ARCH and --out"),
        Case("make-tiny unknown arch", ["make-tiny", "nosuch", "--out", f"{w}/new"], "unknown tiny architecture"),
        Case("make-tiny --layers 0", ["make-tiny", "qwen3", "--out", f"{w}/new", "--layers", "0"], "--layers 0"),
        Case("make-tiny --layers -2", ["make-tiny", "qwen3", "--out", f"{w}/new", "--layers", "-2"], "--layers -2"),
        Case("make-tiny --hidden 100", ["make-tiny", "qwen3", "--out", f"{w}/new", "--hidden", "100"], "--hidden 100"),
        Case("make-tiny --head-dim 100", ["make-tiny", "qwen3", "--out", f"{w}/new", "--head-dim", "100"],
             "--head-dim 100"),
        Case("make-tiny --hidden 320 --head-dim 128", ["make-tiny", "qwen3", "--out", f"{w}/new", "--hidden", "320",
                                                        "--head-dim", "128"], "of the head size 128"),
        Case("make-tiny --vocab 10", ["make-tiny", "qwen3", "--out", f"{w}/new", "--vocab", "10"],
             "--vocab 10: give at least 64"),
        Case("make-tiny --out FILE", ["make-tiny", "qwen3", "--out", f"{w}/file.txt"], "is a file"),
        Case("make-tiny --out /proc/x/y", ["make-tiny", "qwen3", "--out", "/proc/x/y"], NOT_WRITABLE),
        Case("make-tiny --out a user's directory", ["make-tiny", "qwen3", "--out", f"{w}/userdir"],
             "not made by graphdiff"),
        # capture
        Case("capture unknown engine", ["capture", m, "--engine", "tgi", "--out", f"{w}/new"], "unknown engine"),
        Case("capture missing model dir", ["capture", f"{w}/nope", "--engine", "hf", "--out", f"{w}/new"],
             "does not exist"),
        Case("capture corrupt config.json", ["capture", f"{w}/corrupt-config", "--engine", "hf", "--out", f"{w}/new"],
             "not valid JSON"),
        Case("capture weightless dir", ["capture", f"{w}/weightless", "--engine", "hf", "--out", f"{w}/new"],
             "--random-weights", suite=False),
        Case("capture truncated safetensors", ["capture", f"{w}/truncated", "--engine", "hf", "--out", f"{w}/new"],
             "model.safetensors is truncated", suite=False),
        Case("capture --out FILE", ["capture", m, "--engine", "hf", "--out", f"{w}/file.txt"], "is a file"),
        Case("capture --out /proc/x", ["capture", m, "--engine", "hf", "--out", "/proc/x"], NOT_WRITABLE),
        Case("capture --out a scan dir", ["capture", m, "--engine", "hf", "--out", f"{w}/scan"],
             "graphdiff scan directory"),
        Case("capture --layers 0", ["capture", m, "--engine", "hf", "--layers", "0", "--out", f"{w}/new"],
             "--layers 0"),
        Case("capture --tokens 1", ["capture", m, "--engine", "hf", "--tokens", "1", "--out", f"{w}/new"],
             "at least 2 tokens", suite=False),
        Case("capture --shapes bogus", ["capture", m, "--engine", "hf", "--shapes", "x9", "--out", f"{w}/new"],
             "--shapes", suite=False),
        Case("capture -cc mode 99", ["capture", m, *cc99, "--out", f"{w}/new"], "not a CompilationMode"),
        Case("capture -cc not JSON", ["capture", m, "-cc", "{mode: 3", "--out", f"{w}/new"], "not valid JSON"),
        Case("capture -O 7", ["capture", m, "-O", "7", "--out", f"{w}/new"], "optimization levels 0 to 3"),
        Case("capture -tp 0", ["capture", m, "-tp", "0", "--out", f"{w}/new"], "at least 1"),
        Case("capture --engine dump of a non-dump", ["capture", f"{w}/emptydir", "--engine", "dump", "--out",
                                                     f"{w}/new"], "no Inductor graphs"),
        Case("capture --random-weights on a weightless dir runs", ["capture", f"{w}/weightless", "--engine", "hf",
                                                                    "--random-weights", "--out", f"{w}/cap-random"],
             exit=0),
        Case("capture --random-weights on a dir with weights runs", ["capture", m, "--engine", "hf",
                                                                      "--random-weights", "--out", f"{w}/cap-ok"],
             exit=0, suite=False),
        # scan
        Case("scan --layers 0", ["scan", "tiny:qwen3", "--layers", "0", "--out", f"{w}/new"], "--layers 0"),
        Case("scan --layers -1", ["scan", "tiny:qwen3", "--layers", "-1", "--out", f"{w}/new"], "--layers -1"),
        Case("scan tiny:qwen3:0", ["scan", "tiny:qwen3:0", "--out", f"{w}/new"], "at least 1 layer"),
        Case("scan tiny:nosuch", ["scan", "tiny:nosuch", "--out", f"{w}/new"], "unknown tiny architecture",
             suite=False),
        Case("scan --tokens 1", ["scan", "tiny:qwen3", "--tokens", "1", "--out", f"{w}/new"], "--tokens"),
        Case("scan unknown engine", ["scan", "tiny:qwen3", "--engine", "sglang", "--out", f"{w}/new"],
             "unknown engine"),
        Case("scan unknown HF id", ["scan", "nobody/NoSuchModel-1B", "--out", f"{w}/new"], "graphdiff configs"),
        Case("scan weightless dir", ["scan", f"{w}/weightless", "--out", f"{w}/new"], "--random-weights"),
        Case("scan truncated safetensors", ["scan", f"{w}/truncated", "--out", f"{w}/new"],
             "model.safetensors is truncated"),
        Case("scan -cc mode 99", ["scan", "tiny:qwen3", *cc99, "--out", f"{w}/new"], "not a CompilationMode"),
        Case("scan -cc unknown key", ["scan", "tiny:qwen3", "-cc", '{"mod": 3}', "--out", f"{w}/new"],
             "did you mean 'mode'"),
        Case("scan -cc wrong type", ["scan", "tiny:qwen3", "-cc", '{"pass_config": {"eliminate_noops": 1}}', "--out",
                                     f"{w}/new"], "pass_config.eliminate_noops"),
        Case("scan -cc mode 0", ["scan", "tiny:qwen3", "-cc", '{"mode": 0}', "--out", f"{w}/new"], "without compile"),
        Case("scan -cc a list", ["scan", "tiny:qwen3", "-cc", "[3]", "--out", f"{w}/new"], "expected a JSON object"),
        Case("scan -O 5", ["scan", "tiny:qwen3", "-O", "5", "--out", f"{w}/new"], "optimization levels"),
        Case("scan -tp 0", ["scan", "tiny:qwen3", "-tp", "0", "--out", f"{w}/new"], "at least 1"),
        Case("scan --shapes decode:0x4", ["scan", "tiny:qwen3", "--shapes", "16,decode:0x4", "--out", f"{w}/new"],
             "decode step needs"),
        Case("scan --shapes too long", ["scan", "tiny:qwen3", "--shapes", "99999", "--out", f"{w}/new"],
             "positions"),
        Case("scan --shapes unreadable", ["scan", "tiny:qwen3", "--shapes", "16;32", "--out", f"{w}/new"],
             "--shapes"),
        Case("scan --manifest corrupt", ["scan", "tiny:qwen3", "--manifest", f"{w}/corrupt.json", "--out",
                                         f"{w}/new"], "not valid JSON"),
        Case("scan --manifest missing", ["scan", "tiny:qwen3", "--manifest", f"{w}/nope.json", "--out", f"{w}/new"],
             "no such file"),
        Case("scan --manifest is a scan", ["scan", "tiny:qwen3", "--manifest", f"{w}/scan/scan.json", "--out",
                                           f"{w}/new"], "is a graphdiff scan, not a patch manifest"),
        Case("scan --manifest tampered patch", ["scan", "tiny:qwen3", "--manifest", f"{w}/tampered", "--out",
                                                f"{w}/new"], "is not the module"),
        Case("scan --out FILE", ["scan", "tiny:qwen3", "--out", f"{w}/file.txt"], "is a file"),
        Case("scan --out /proc/x", ["scan", "tiny:qwen3", "--out", "/proc/x"], NOT_WRITABLE),
        Case("scan --out a user's directory", ["scan", "tiny:qwen3", "--out", f"{w}/userdir"],
             "not made by graphdiff"),
        Case("scan --out a patch dir", ["scan", "tiny:qwen3", "--out", f"{w}/patch"], "graphdiff patch directory"),
        Case("scan --engine-dump without a capture", ["scan", "tiny:qwen3", "--engine-dump", f"{w}/emptydir",
                                                      "--out", f"{w}/new"], "holds no engine capture"),
        Case("scan --engine-dump of another model", ["scan", "tiny:llama", "--engine-dump", f"{w}/scan/engine",
                                                     "--out", f"{w}/new"], "another model config"),
        Case("scan --attention bogus", ["scan", "tiny:qwen3", "--attention", "bf16", "--out", f"{w}/new"],
             "--attention bf16"),
        # patch
        Case("patch missing scan dir", ["patch", f"{w}/nope", "--out", f"{w}/new"], "no scan.json"),
        Case("patch scan.json not JSON", ["patch", f"{w}/bad-json", "--out", f"{w}/new"], "is not valid JSON"),
        Case("patch scan.json is a manifest", ["patch", f"{w}/bad-kind", "--out", f"{w}/new"],
             "is a graphdiff patch manifest, not a scan"),
        Case("patch scan.json newer schema", ["patch", f"{w}/bad-newer", "--out", f"{w}/new"], "upgrade graphdiff"),
        Case("patch scan.json older schema", ["patch", f"{w}/bad-older", "--out", f"{w}/new"],
             "written by an older graphdiff"),
        Case("patch scan.json invalid field", ["patch", f"{w}/bad-field", "--out", f"{w}/new"], "field sites"),
        Case("patch a scan dir whose parts disagree", ["patch", f"{w}/mixed", "--out", f"{w}/new"],
             "parts disagree"),
        Case("patch --out FILE", ["patch", f"{w}/scan", "--out", f"{w}/file.txt"], "is a file"),
        Case("patch --out /proc/x", ["patch", f"{w}/scan", "--out", "/proc/x"], NOT_WRITABLE),
        Case("patch --out the scan dir", ["patch", f"{w}/scan", "--out", f"{w}/scan"], "graphdiff scan directory"),
        Case("patch --measure-tokens 0", ["patch", f"{w}/scan", "--out", f"{w}/patch", "--measure-tokens", "0"],
             "--measure-tokens 0"),
        Case("patch --regions unknown", ["patch", f"{w}/scan", "--out", f"{w}/patch", "--regions", "nosuch",
                                         "--no-measure"], "no region nosuch"),
        Case("patch --attention bogus", ["patch", f"{w}/scan", "--out", f"{w}/new", "--attention", "bf16"],
             "--attention bf16"),
        # kl
        Case("kl --random 0", ["kl", m, "--random", "0", "--out", f"{w}/new"], "--random 0"),
        Case("kl --temperature -1", ["kl", m, "--temperature", "-1", "--out", f"{w}/new"], "--temperature"),
        Case("kl --max-tokens 0", ["kl", m, "--max-tokens", "0", "--out", f"{w}/new"], "--max-tokens 0"),
        Case("kl --prompt-tokens 0", ["kl", m, "--prompt-tokens", "0", "--out", f"{w}/new"], "--prompt-tokens 0"),
        Case("kl --bootstrap 0", ["kl", m, "--bootstrap", "0", "--out", f"{w}/new"], "--bootstrap 0"),
        Case("kl --prompts and --random", ["kl", m, "--random", "2", "--prompts", f"{w}/prompts.txt", "--out",
                                           f"{w}/new"], "not both"),
        Case("kl --prompts missing", ["kl", m, "--prompts", f"{w}/nope.txt", "--out", f"{w}/new"], "no prompts file",
             suite=False),
        Case("kl --manifest corrupt", ["kl", m, "--manifest", f"{w}/corrupt.json", "--out", f"{w}/new"],
             "not valid JSON"),
        Case("kl --manifest tampered", ["kl", m, "--manifest", f"{w}/tampered", "--out", f"{w}/new"],
             "is not the module"),
        Case("kl --metric k2", ["kl", m, "--metric", "k2", "--out", f"{w}/new"], "--metric k2"),
        Case("kl unknown engine", ["kl", m, "--engine", "sglang", "--out", f"{w}/new"], "unknown engine"),
        Case("kl -cc mode 99", ["kl", m, *cc99, "--out", f"{w}/new"], "not a CompilationMode"),
        Case("kl weightless dir", ["kl", f"{w}/weightless", "--out", f"{w}/new"], "--random-weights", suite=False),
        Case("kl --out FILE", ["kl", m, "--out", f"{w}/file.txt"], "is a file"),
        Case("kl --out a scan dir", ["kl", m, "--out", f"{w}/scan"], "graphdiff scan directory"),
        Case("kl --attribute without --manifest", ["kl", m, "--attribute", "--out", f"{w}/new"],
             "--attribute needs --manifest", suite=False),
        # explain, replay, report
        Case("explain a site of a corrupt scan", ["explain", "x", f"{w}/bad-json"], "is not valid JSON"),
        Case("explain in a scan dir whose parts disagree", ["explain", "x", f"{w}/mixed"], "parts disagree"),
        Case("explain an unknown site", ["explain", "no-such-site", f"{w}/scan"], "no-such-site"),
        Case("explain without a scan dir", ["explain", "x", f"{w}/emptydir"], "no scan.json"),
        Case("replay a scan dir whose parts disagree", ["replay", f"{w}/mixed", "k:0"], "parts disagree"),
        Case("replay an unknown kernel", ["replay", f"{w}/scan", "no_such_kernel:0"], "no_such_kernel"),
        Case("replay a scan.json of a newer schema", ["replay", f"{w}/bad-newer", "k:0"], "upgrade graphdiff"),
        Case("report --out /proc/x/r.html", ["report", f"{w}/scan", "--out", "/proc/x/r.html"],
             NOT_WRITABLE),
        Case("report --out DIR", ["report", f"{w}/scan", "--out", f"{w}/emptydir"], "is a directory"),
        Case("report --format pdf", ["report", f"{w}/scan", "--format", "pdf"], "unknown format"),
        Case("report a scan dir whose parts disagree", ["report", f"{w}/mixed"], "parts disagree"),
        Case("report --region unknown", ["report", f"{w}/scan", "--region", "nosuch"], "nosuch"),
        Case("report --format dot without --region", ["report", f"{w}/scan", "--format", "dot"], "--region"),
        Case("report scan.json invalid field", ["report", f"{w}/bad-field"], "field sites"),
        # check
        Case("check a missing manifest", ["check", f"{w}/nope.json"], "cannot read the manifest"),
        Case("check a corrupt manifest", ["check", f"{w}/corrupt.json"], "not valid JSON"),
        Case("check a scan.json given as manifest", ["check", f"{w}/scan/scan.json"],
             "is a graphdiff scan, not a patch manifest"),
        Case("check a tampered patch", ["check", f"{w}/tampered"], "must be regenerated", exit=1),
        Case("check --model another config", ["check", f"{w}/patch", "--model", "tiny:llama"],
             "regenerate: graphdiff scan tiny:llama", exit=1),
        Case("check --format xml", ["check", f"{w}/patch", "--format", "xml"], "unknown format"),
        Case("check -cc mode 99", ["check", f"{w}/patch", *cc99], "not a CompilationMode"),
        Case("check -O 9", ["check", f"{w}/patch", "-O", "9"], "optimization levels"),
        Case("check unknown engine", ["check", f"{w}/patch", "--engine", "x"], "unknown engine"),
        Case("check --out FILE", ["check", f"{w}/patch", "--out", f"{w}/file.txt"], "is a file"),
        Case("check --shapes bogus", ["check", f"{w}/patch", "--shapes", "x"], "--shapes"),
        # runtime.apply in a trainer
        Case("runtime.apply a missing manifest", code=_apply("'{ws}/nope.json'"), says="cannot read the manifest",
             suite=False),
        Case("runtime.apply a corrupt manifest", code=_apply("'{ws}/corrupt.json'"), says="not valid JSON"),
        Case("runtime.apply a scan.json", code=_apply("'{ws}/scan/scan.json'"), says="not a patch manifest",
             suite=False),
        Case("runtime.apply a tampered patch", code=_apply("'{ws}/tampered'"), says="regenerate", suite=False),
        Case("runtime.apply a manifest of a newer schema", code=_apply("'{ws}/newer-manifest.json'"),
             says="upgrade graphdiff", suite=False),
        Case("runtime.apply unknown regions", code=_apply("'{ws}/patch', regions=['nosuch']"), says="nosuch",
             suite=False),
        Case("runtime.apply to another model", code=_apply("'{ws}/patch'", model="llama"),
             says="the model is LlamaForCausalLM"),
    ]


APPLY = """
import sys
import time
from graphdiff.capture.hf import load_hf_model
from graphdiff import runtime
model = load_hf_model('{{ws}}/{model}')
t0 = time.perf_counter()  # the refusal's own time, after the trainer has its model
try:
    runtime.apply(model, {manifest})
except runtime.PatchError as e:
    print(f"error: {{e}}", file=sys.stderr)
    sys.exit(2)
finally:
    print(f"apply: {{time.perf_counter() - t0:.2f}} s")
"""

def _apply(manifest: str, model: str = "model") -> str:
    return APPLY.format(manifest=manifest, model=model)


CASES = _cases()

# --- the files the cases refer to ---------------------------------------------------------------------------------


def build_workspace(root: Path) -> Path:
    """Everything the cases name, under `root` (cache/ and hub/ are the graphdiff and HF caches they run with)."""
    from graphdiff.codegen import generate
    from graphdiff.models.tiny import tiny_path

    root.mkdir(parents=True, exist_ok=True)
    (root / "hub").mkdir(exist_ok=True)
    (root / "cache").mkdir(exist_ok=True)
    # tiny:ARCH from the user's cache (made once, seeded); the rest of the cases' cache is their own
    (root / "cache" / "tiny").symlink_to(tiny_path("qwen3", 2).parent.resolve(), target_is_directory=True)
    model = shutil.copytree(tiny_path("qwen3", 2), root / "model")
    shutil.copytree(tiny_path("llama", 2), root / "llama")
    (root / "weightless").mkdir()
    shutil.copy(model / "config.json", root / "weightless" / "config.json")
    shutil.copytree(model, root / "truncated")
    weights = root / "truncated" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    (root / "corrupt-config").mkdir()
    (root / "corrupt-config" / "config.json").write_text("{not json")
    (root / "userdir").mkdir()
    (root / "userdir" / "notes.txt").write_text("a user's own file\n")
    (root / "emptydir").mkdir()
    (root / "file.txt").write_text("a file\n")
    (root / "corrupt.json").write_text('{"kind": "graphdiff.manifest", ')
    (root / "prompts.txt").write_text("[1, 2, 3]\n")
    shutil.copytree(FIXTURE_SCAN, root / "scan")
    generate(root / "scan", root / "patch", ["model.norm#norm_weight"])  # one region: quick to generate
    _broken_copies(root)
    return root


def _broken_copies(root: Path) -> None:
    scan = json.loads((root / "scan" / "scan.json").read_text())
    manifest = json.loads((root / "patch" / "manifest.json").read_text())
    shutil.copytree(root / "patch", root / "tampered")
    with open(root / "tampered" / "graphdiff_patch.py", "a") as f:
        f.write("# edited by hand\n")
    (root / "newer-manifest.json").write_text(json.dumps({**manifest, "schema_version": 99}))
    variants = {"bad-json": "{\"kind\": \"graphdiff.scan\", \"sites\": [", "bad-kind": json.dumps(manifest),
                "bad-newer": json.dumps({**scan, "schema_version": 99}),
                "bad-older": json.dumps({**scan, "schema_version": 1}),
                "bad-field": json.dumps({**scan, "sites": 5})}
    for name, text in variants.items():
        (root / name).mkdir()
        (root / name / "scan.json").write_text(text)
        shutil.copy(root / "scan" / "train.capture.json", root / name / "train.capture.json")
    shutil.copytree(root / "scan", root / "mixed")
    for part, scan_id in (("scan.json", "aaaaaaaaaaaa"), ("engine/capture.json", "bbbbbbbbbbbb")):
        data = json.loads((root / "mixed" / part).read_text())
        (root / "mixed" / part).write_text(json.dumps({**data, "scan_id": scan_id}))


def tree(root: Path) -> dict[str, str]:
    """Every file and directory under `root` (the caches left out) -> its size and modification time, and the
    content hash of a small file (a large one is only ever rewritten whole, which changes its time)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if rel.split("/")[0] in ("cache", "hub", "results"):
            continue
        st = p.lstat()
        small = p.is_file() and st.st_size < 2**16
        out[rel] = "dir" if p.is_dir() else f"{st.st_size}:{st.st_mtime_ns}:" + (
            hashlib.sha256(p.read_bytes()).hexdigest()[:16] if small else "")
    return out


# --- running them -------------------------------------------------------------------------------------------------


def run_cases(root: Path, cases: list[Case], timeout: float = 900) -> list[dict]:
    """Each case's exit code, stderr, stdout, whether vllm was imported, the changed files, its seconds (after
    graphdiff's imports, which one helper process does once)."""
    env = {**os.environ, "GRAPHDIFF_CACHE": str(root / "cache"), "HF_HUB_CACHE": str(root / "hub"),
           "COLUMNS": "240", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.test_bad_input_cases", str(root), *(c.name for c in cases)],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    return json.loads(proc.stdout.splitlines()[-1])


def _child(case: Case, root: Path, out: Path) -> None:
    """In the forked process: the case, with stdout/stderr to files; exit code and vllm's import to a file."""
    fd1, fd2 = os.open(out / "stdout", os.O_WRONLY | os.O_CREAT), os.open(out / "stderr", os.O_WRONLY | os.O_CREAT)
    os.dup2(fd1, 1)
    os.dup2(fd2, 2)
    code = 0
    try:
        if case.code:
            exec(compile(case.code.replace("{ws}", str(root)), case.name, "exec"), {"__name__": "__main__"})
        else:
            from graphdiff_cli.main import main

            sys.argv = ["graphdiff", *(a.replace("{ws}", str(root)) for a in case.argv)]
            main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    (out / "result").write_text(json.dumps({"exit": code, "vllm": "vllm" in sys.modules}))
    os._exit(0)


def _run_one(case: Case, root: Path) -> dict:
    out = root / "results" / case.name.replace(" ", "_").replace("/", "_")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    before = tree(root)
    t0 = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        _child(case, root, out)
    os.waitpid(pid, 0)
    seconds = time.perf_counter() - t0
    after = tree(root)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    result = json.loads((out / "result").read_text()) if (out / "result").is_file() else {"exit": -1, "vllm": None}
    return {"name": case.name, **result, "stderr": (out / "stderr").read_text(), "stdout": (out / "stdout").read_text(),
            "changed": changed, "seconds": round(seconds, 2)}


def _main(root: Path, names: list[str]) -> None:
    import graphdiff_cli.main  # noqa: F401
    import transformers.models.auto.modeling_auto  # noqa: F401 - imported once here, before the forks (not vllm)

    import graphdiff.analysis.scan  # noqa: F401
    import graphdiff.capture.hf  # noqa: F401
    import graphdiff.check  # noqa: F401
    import graphdiff.codegen  # noqa: F401
    import graphdiff.measure.kl  # noqa: F401
    import graphdiff.pipeline  # noqa: F401
    import graphdiff.report.html  # noqa: F401
    import graphdiff.runtime  # noqa: F401

    assert "vllm" not in sys.modules
    by_name = {c.name: c for c in CASES}
    results = [_run_one(by_name[n], root) for n in names]
    print(json.dumps(results))


if __name__ == "__main__":
    _main(Path(sys.argv[1]), sys.argv[2:])
