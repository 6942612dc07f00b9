"""The scan directory: the one owner of its layout. Everything that writes or reads a scan goes through here.

    OUT/scan.json              ScanResult: the plan, sites, regions, replay evidence (schema in schemas/)
    OUT/train.capture.json     the trainer's eager ATen graph
    OUT/engine/capture.json    the engine's compiled graph(s) with the kernel partition
    OUT/engine/buffers.pt      the engine's real kernel buffers, per recorded shape (replay, `graphdiff replay`)
    OUT/patch/                 graphdiff_patch.py + manifest.json (`scan --patch`, `graphdiff patch`)
    OUT/kl.json, OUT/engine_samples.json    the measured gap and the engine samples it used
    OUT/report.html            the report

Every file records the scan id and the model fingerprint it belongs to (`check_parts` refuses a directory whose
parts disagree). Every command that writes a directory builds it with `staged`: nothing half-written is ever seen.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from graphdiff.errors import GraphdiffError
from graphdiff.records import Capture, Manifest, ScanResult, load_versioned, save_json

# The file that says which command made a directory: `staged` replaces only a directory that command made.
MARKERS = {"scan": "scan.json", "patch": "manifest.json", "kl": "kl.json", "capture": "capture.json",
           "model": "config.json"}


def new_scan_id() -> str:
    return uuid.uuid4().hex[:12]


def check_out(path: Path, *, file: bool = False, option: str = "--out") -> None:
    """The one writability check of an output (a directory, or with `file` a file): one GraphdiffError before any
    work starts. Nothing is created."""
    path = Path(path)
    if file and path.is_dir():
        raise GraphdiffError(f"{option} {path} is a directory; give a file name (e.g. {path / 'report.html'})")
    if not file and path.exists() and not path.is_dir():
        raise GraphdiffError(f"{option} {path} is a file, not a directory: give a new or graphdiff-made directory")
    probe = Path(os.path.abspath(path)).parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise GraphdiffError(f"{option} {path}: {probe} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".graphdiff-write-test-", dir=probe))
    except OSError as e:
        raise GraphdiffError(f"{option} {path}: not writable (cannot write in {probe}: {e.strerror}); choose another "
                             f"{option}") from None


PART_OF = {"scan": {"kl"}}  # a scan directory holds kl.json too (`scan --kl`)


def check_replaceable(target: Path, made_by: str, option: str = "--out") -> None:
    """Refuse to replace a non-empty directory that `made_by` did not make (a user's own files, another kind of
    graphdiff output), or one holding the current directory (the new one replaces it whole)."""
    if not target.is_dir() or not any(target.iterdir()):
        return
    if Path.cwd().resolve().is_relative_to(target.resolve()):
        raise GraphdiffError(f"{option} {target} holds the current directory, which the new output would replace: "
                             "run from another directory or choose another")
    kinds = {k for k, f in MARKERS.items() if (target / f).is_file()}
    if made_by in kinds and not kinds - {made_by} - PART_OF.get(made_by, set()):
        return
    other = [k for k in MARKERS if k in kinds and k != made_by]  # the scan first: it holds the others
    what = f"a graphdiff {other[0]} directory" if other else "not empty and not made by graphdiff"
    raise GraphdiffError(f"{option} {target} is {what}; `graphdiff {made_by}` replaces only its own output: "
                         "choose a new directory")


def check_patch(path: Path) -> Manifest:
    """A patch directory's manifest, once its module is the one it was generated with and, inside a scan directory,
    it belongs to that scan; else one error naming the file and the fix."""
    from graphdiff.runtime import load_manifest

    manifest = load_manifest(path)
    path = path / "manifest.json" if path.is_dir() else path
    problem = module_problem(path, manifest)
    if problem:
        raise GraphdiffError(problem)
    if path.parent.name == "patch" and (path.parent.parent / "scan.json").is_file():
        ScanDir(path.parent.parent).check_parts()
    return manifest


def module_problem(path: Path, manifest: Manifest) -> str | None:
    """Why the generated module beside manifest `path` is not the one it was generated with (None: it is)."""
    import hashlib

    module = path.parent / manifest.module_file
    if not module.is_file():
        return f"{module} is missing (named by {path}): regenerate the patch with `graphdiff patch`"
    if hashlib.sha256(module.read_bytes()).hexdigest() != manifest.module_sha256:
        return (f"{module} is not the module {path} was generated with (edited or from another patch): regenerate "
                "the patch with `graphdiff patch`")
    return None


def _staging(target: Path) -> Path:
    return target.parent / f".{target.name}.graphdiff-staging-{os.getpid()}"


@contextlib.contextmanager
def staged(target: Path, made_by: str, carry: Sequence[str] = ()) -> Iterator[Path]:
    """Build a directory beside `target` (same filesystem) and swap it into place on success; a failure or Ctrl-C
    removes it and leaves `target` as it was. `carry`: files of the old `target` copied in first (caches)."""
    target = Path(os.path.abspath(target))
    check_out(target)
    check_replaceable(target, made_by)
    created = [p for p in [target.parent, *target.parent.parents] if not p.exists()]
    staging = _staging(target)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for name in carry:
            if (target / name).is_file():
                shutil.copy2(target / name, staging / name)
        yield staging
        _swap(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for p in created:  # innermost first: parents made only for this output
            with contextlib.suppress(OSError):
                p.rmdir()
        raise


@contextlib.contextmanager
def _no_interrupt() -> Iterator[None]:
    """SIGINT held back for the two renames (main thread only: signals are delivered there)."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _swap(staging: Path, target: Path) -> None:
    old = target.parent / f".{target.name}.graphdiff-old-{os.getpid()}"
    with _no_interrupt():
        if target.exists() or target.is_symlink():
            target.rename(old)
        try:
            staging.rename(target)
        except OSError:
            if old.exists():
                old.rename(target)
            raise
        shutil.rmtree(old, ignore_errors=True)


def write_file(path: Path, text: str) -> Path:
    """Write a file all at once (a temporary beside it, renamed): a failure leaves the old one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.graphdiff-{os.getpid()}.tmp"
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def _identity(path: Path) -> dict | None:
    """The scan id, fingerprint and architecture a JSON part records (None: not there or not readable)."""
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    return {k: data.get(k, "") for k in ("scan_id", "fingerprint", "architecture")} if isinstance(data, dict) \
        else None


def _disagree(a: dict, b: dict) -> str | None:
    for key in ("scan_id", "fingerprint", "architecture"):
        if a[key] and b[key] and a[key] != b[key]:
            return key
    return None


@dataclass(frozen=True)
class ScanDir:
    root: Path

    @property
    def scan_json(self) -> Path:
        return self.root / "scan.json"

    @property
    def train_capture(self) -> Path:
        return self.root / "train.capture.json"

    @property
    def engine_dir(self) -> Path:
        return self.root / "engine"

    @property
    def engine_capture(self) -> Path:
        return self.engine_dir / "capture.json"

    @property
    def patch_dir(self) -> Path:
        return self.root / "patch"

    @property
    def kl_json(self) -> Path:
        return self.root / "kl.json"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    def check_writable(self) -> None:
        """Refuse an output directory that cannot be written, before any long step starts (nothing is created)."""
        check_out(self.root)

    @property
    def parts(self) -> dict[str, Path]:
        return {"train.capture.json": self.train_capture, "engine/capture.json": self.engine_capture,
                "patch/manifest.json": self.patch_dir / "manifest.json", "kl.json": self.kl_json}

    def check_parts(self, scan: ScanResult | None = None) -> ScanResult:
        """The scan, once every other file of the directory is known to belong to it (same scan id, model
        fingerprint, architecture, where both record one); else one error naming both."""
        scan = scan or self.load_scan()
        mine = {"scan_id": scan.scan_id, "fingerprint": scan.fingerprint, "architecture": scan.architecture}
        for name, path in self.parts.items():
            other = _identity(path) if path.is_file() else None
            key = _disagree(mine, other) if other else None
            if key and other:
                raise GraphdiffError(
                    f"{self.root}: its parts disagree: scan.json has {key} {mine[key]} but {name} has {other[key]}; "
                    f"rescan with `graphdiff scan {shlex.quote(scan.model)} --out {shlex.quote(str(self.root))}`")
        return scan

    def require_scan(self) -> None:
        if not self.scan_json.is_file():
            raise GraphdiffError(f"no scan.json in {self.root}; run `graphdiff scan MODEL --out {self.root}` first")

    def load_scan(self) -> ScanResult:
        self.require_scan()
        return load_versioned(ScanResult, self.scan_json, "scan")

    def load_train(self) -> Capture:
        if not self.train_capture.is_file():
            raise GraphdiffError(f"{self.train_capture} is missing: `graphdiff scan MODEL --out {self.root}` "
                                 "writes it")
        return load_versioned(Capture, self.train_capture, "capture")

    def load_engine_graphs(self) -> Capture | None:
        """The engine capture without its buffers (what the report draws); None when absent."""
        return load_versioned(Capture, self.engine_capture, "capture") if self.engine_capture.is_file() else None

    def load_engine(self, model_dir: Path | None = None) -> tuple[Capture, dict]:
        from graphdiff.engines.store import load_engine_capture

        return load_engine_capture(self.engine_dir, model_dir)

    def save_scan(self, result: ScanResult) -> Path:
        return save_json(result, self.scan_json)

    def save_train(self, capture: Capture) -> Path:
        return save_json(capture, self.train_capture)
