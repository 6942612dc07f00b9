"""The scan's summary lines, claiming no more than scan.json holds (the terminal and the report print these)."""

from __future__ import annotations

import math
from collections import defaultdict

from graphdiff.analysis.regions import module_pattern
from graphdiff.records import ScanResult, layer_of


def bound_percent(fraction: float, lower: bool = True) -> str:
    """`fraction` as a percentage with two decimals, rounded so that it stays a true bound: down for a lower bound
    (99.9977% is "99.99%", never "100.00%"), up for an upper one."""
    hundredths = fraction * 10000
    return f"{(math.floor(hundredths) if lower else math.ceil(hundredths)) / 100:.2f}%"


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
        return (f"kernel replay{where}: predicted rounding model ≥ {bound_percent(worst)} bit-identical on every "
                f"generated kernel (naive round-after-every-op ≤ {bound_percent(naive, lower=False)})")
    good = sum(r.predicted_bitexact >= 0.999 for r in ok)
    return (f"kernel replay{where}: predicted rounding model ≥ 99.9% bit-identical on {good} of {len(scan.replay)} "
            f"kernel calls (worst {bound_percent(worst)}); {len(scan.not_replayed)} not replayed, "
            f"{len(scan.unexplained)} unexplained (below)")


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
