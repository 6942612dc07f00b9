"""The scan directory: the one owner of its layout. Everything that writes or reads a scan goes through here.

    OUT/scan.json              ScanResult: the plan, sites, regions, replay evidence (schema in schemas/)
    OUT/train.capture.json     the trainer's eager ATen graph
    OUT/engine/capture.json    the engine's compiled graph(s) with the kernel partition
    OUT/engine/buffers.pt      the engine's real kernel buffers, per recorded shape (replay, `graphdiff replay`)
    OUT/patch/                 graphdiff_patch.py + manifest.json (`scan --patch`, `graphdiff patch`)
    OUT/kl.json, OUT/engine_samples.json    the measured gap and the engine samples it used
    OUT/report.html            the report
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from graphdiff.errors import GraphdiffError
from graphdiff.records import Capture, ScanResult, load_versioned, save_json


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
        """Refuse an output directory that cannot be written, before any long step starts (it is created now)."""
        probe = self.root
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise GraphdiffError(f"--out {self.root}: {probe} is a file, not a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            test = self.root / ".graphdiff-write-test"
            test.write_text("")
            test.unlink()
        except OSError as e:
            raise GraphdiffError(f"--out {self.root}: not writable ({e.strerror})") from None

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
        from graphdiff.capture.engine_process import load_engine_capture

        return load_engine_capture(self.engine_dir, model_dir)

    def save_scan(self, result: ScanResult) -> Path:
        return save_json(result, self.scan_json)

    def save_train(self, capture: Capture) -> Path:
        return save_json(capture, self.train_capture)
