"""The scan's summary lines, claiming no more than scan.json holds (the terminal and the report print these)."""

from __future__ import annotations

from collections import defaultdict

from graphdiff.analysis.regions import module_pattern
from graphdiff.records import ScanResult, layer_of


def replay_claim(scan: ScanResult) -> str:
    """What the kernel replay proves: "on every kernel" only when every generated kernel call replayed at every
    recorded shape at or above the proof threshold."""
    ok = [r for r in scan.replay if not r.error]
    shapes = len({r.shape for r in scan.replay}) or 1
    where = f" at {shapes} shapes" if shapes > 1 else ""
    if not ok:
        return "no generated kernel could be replayed"
    worst = min(r.predicted_bitexact for r in ok)
    naive = max(r.naive_bitexact for r in ok)
    if not scan.not_replayed and not scan.unexplained:
        return (f"kernel replay{where}: predicted rounding model ≥ {worst:.2%} bit-identical on every generated "
                f"kernel (naive round-after-every-op ≤ {naive:.2%})")
    good = sum(r.predicted_bitexact >= 0.999 for r in ok)
    return (f"kernel replay{where}: predicted rounding model ≥ 99.9% bit-identical on {good} of {len(scan.replay)} "
            f"kernel calls (worst {worst:.2%}); {len(scan.not_replayed)} not replayed, {len(scan.unexplained)} "
            "unexplained (below)")


def headline(scan: ScanResult) -> list[str]:
    """The summary line, then one line per thing it does not cover (not replayed, unexplained, unregistered)."""
    unproven = sum(not s.proven for s in scan.sites)
    sites = f"{len(scan.sites)} sites in {len(scan.regions)} regions"
    if unproven:
        sites += f" ({unproven} unproven)"
    dependent = [r.name for r in scan.regions if r.shape_dependent]
    lines = [f"{sites}; {scan.matched} values matched; {replay_claim(scan)}"]
    if dependent:
        lines.append(f"shape-dependent regions (sites not the same at every shape): {', '.join(dependent)}")
    lines += [f"not replayed: {k}" for k in scan.not_replayed]
    lines += [f"unexplained (replay below 99.9%, its sites unproven): {k}" for k in scan.unexplained]
    if scan.engine_unread:
        lines.append("engine parameters it loads but never reads (it computes something else there than the "
                     "trainer; no rounding patch closes that): " + by_layers(scan.engine_unread))
    if scan.unregistered_externs:
        lines.append("opaque engine ops no registry entry describes (what they round inside is not compared): "
                     + ", ".join(scan.unregistered_externs))
    return lines


def by_layers(names: list[str]) -> str:
    """Parameter names with their layer folded: `model.layers.*.mlp.gate.e_score_correction_bias (layers 1, 2)`."""
    groups: dict[str, list[int]] = defaultdict(list)
    for name in names:
        layer = layer_of(name)
        groups[module_pattern(name)] += [] if layer is None else [layer]
    return ", ".join(f"{p} (layer{'s' if len(ls) > 1 else ''} {', '.join(map(str, sorted(ls)))})" if ls else p
                     for p, ls in groups.items())
