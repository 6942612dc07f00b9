"""Record the kernel-replay fixtures of the architecture sweep (fixtures/replay/ARCH.pt) from real scans.

    python benchmarks/record_replay_fixtures.py [ARCH ...] --out fixtures/replay

Per architecture (default: every `graphdiff make-tiny --list` one): `graphdiff make-tiny ARCH --layers 3`, then a
real `graphdiff scan MODEL --tokens 4 --shapes 4` (one 4-token prefill: small buffers), then the fixture. It keeps
what re-running the engine's kernels needs, pruned: the engine capture (its kernel code kept for one call per
kernel name), the buffers of one call per kernel name at the first recorded shape (identical layers run the same
kernel), the other kernels' buffer placements as the scan found them, and the scan's replay result for those calls.
A large table (an embedding, the RoPE cos/sin cache) keeps only the rows the call's integer inputs (token ids,
positions) can index, as a sparse tensor; the recorder checks that every kept call replays on the pruned buffers
exactly as on the full ones, and keeps a table whole where it does not.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zlib
from pathlib import Path

import torch

from graphdiff.artifacts import ScanDir
from graphdiff.report.explain import replay_one

TABLE_BYTES = 32 * 2**10  # inputs larger than this are pruned to the rows the call can index


def _indexable_rows(record: dict, rows: int) -> torch.Tensor:
    ints = [t.reshape(-1) for t in record["in"].values() if isinstance(t, torch.Tensor) and not t.is_floating_point()
            and t.dtype != torch.bool and t.numel()]
    idx = torch.cat(ints).long() if ints else torch.zeros(0, dtype=torch.long)
    return torch.unique(idx[(idx >= 0) & (idx < rows)])


def prune_record(record: dict) -> dict:
    """Large floating inputs as sparse tensors of the rows the call's integer inputs can index."""
    ins = {}
    for buf, t in record["in"].items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 1 \
                and t.numel() * t.element_size() > TABLE_BYTES:
            rows = _indexable_rows(record, t.shape[0])
            dense = torch.zeros_like(t)
            dense[rows] = t[rows]
            ins[buf] = dense.to_sparse(sparse_dim=1).coalesce()
        else:
            ins[buf] = t
    return {**record, "in": ins}


def densify(record: dict) -> dict:
    return {**record, "in": {b: t.to_dense() if isinstance(t, torch.Tensor) and t.is_sparse else t
                             for b, t in record["in"].items()}}


def _pack(text: str) -> bytes:
    return zlib.compress(text.encode(), 9)


def unpack(fixture: dict, directory: Path) -> ScanDir:
    """A fixture as a scan directory `graphdiff replay` and `explain.replay_one` read."""
    d = ScanDir(directory)
    d.engine_dir.mkdir(parents=True, exist_ok=True)
    d.scan_json.write_bytes(zlib.decompress(fixture["scan"]))
    d.engine_capture.write_bytes(zlib.decompress(fixture["capture"]))
    torch.save({label: {k: densify(r) for k, r in recs.items()} for label, recs in fixture["buffers"].items()},
               d.engine_dir / "buffers.pt")
    return d


def record(arch: str, scan_dir: Path, tmp: Path) -> dict:
    d = ScanDir(scan_dir)
    scan = d.load_scan()
    cap, buffers = d.load_engine(None)  # weights from the checkpoint the scan ran
    shape = cap.shapes[0].label
    kept: dict[str, dict] = {}
    for g in cap.graphs:
        seen: set[str] = set()
        for k in g.kernels:
            if k.kind == "generated" and k.id in buffers.get(shape, {}) and k.name not in seen:
                seen.add(k.name)
                kept[k.id] = buffers[shape][k.id]
        for k in g.kernels:
            if k.id not in kept:
                k.code = ""  # only the kept calls are replayed
    slim = scan.model_copy(update=dict(plan=[], sites=[], regions=[], routing=[], nonuniformity={}, kl=None,
                                       replay=[r for r in scan.replay if r.shape == shape]))
    slim.shapes = [s for s in slim.shapes if s.label == shape]
    fixture = dict(arch=arch, shape=shape, scan=_pack(slim.model_dump_json()),
                   capture=_pack(cap.model_dump_json()), buffers={shape: {}})
    # Each kept call on its pruned buffers must replay as on the full ones; a call that does not stays whole.
    fixture["buffers"][shape] = {k: prune_record(r) for k, r in kept.items()}
    pruned = unpack(fixture, tmp / "pruned")
    fixture["buffers"][shape] = dict(kept)
    full = unpack(fixture, tmp / "full")
    final = {}
    for kid, rec in kept.items():
        a, b = replay_one(full.root, kid, shape), replay_one(pruned.root, kid, shape)
        same = (a.predicted, a.naive, a.error) == (b.predicted, b.naive, b.error)
        final[kid] = prune_record(rec) if same else rec
    fixture["buffers"][shape] = final
    return fixture


def scan(arch: str, work: Path, layers: int) -> Path | None:
    """A real scan of the tiny `arch` at one 4-token prefill; None (and its last line) when it does not scan."""
    cli = [sys.executable, "-m", "graphdiff_cli.main"]
    model, out = work / "model", work / "scan"
    for step in (["make-tiny", arch, "--out", str(model), "--layers", str(layers)],
                 ["scan", str(model), "--tokens", "4", "--shapes", "4", "--out", str(out)]):
        proc = subprocess.run(["timeout", "1500", *cli, *step], capture_output=True, text=True)
        if proc.returncode:
            print(f"{arch}: `graphdiff {step[0]}` exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
            return None
    return out


def main() -> None:
    from graphdiff.models.tiny import ARCHS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("archs", nargs="*")
    p.add_argument("--out", type=Path, default=Path("fixtures/replay"))
    p.add_argument("--work", type=Path, default=Path("/tmp/replay-fixtures"))
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--scan-dir", type=Path, help="record from this existing scan (one ARCH) instead of scanning")
    args = p.parse_args()
    archs = args.archs or list(ARCHS)
    args.out.mkdir(parents=True, exist_ok=True)
    for arch in archs:
        scan_dir = args.scan_dir or scan(arch, args.work / arch, args.layers)
        if scan_dir is None:
            continue
        fixture = record(arch, scan_dir, args.work / arch / "check")
        path = args.out / f"{arch}.pt"
        torch.save(fixture, path)
        print(f"{arch}: {len(fixture['buffers'][fixture['shape']])} kernel calls, {path.stat().st_size / 1024:.0f} KiB "
              f"-> {path}")
    print(json.dumps({"recorded": archs}))


if __name__ == "__main__":
    main()
