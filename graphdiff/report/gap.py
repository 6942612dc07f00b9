"""The log-prob gap by continuation position as one table: what the terminal (`scan --kl`, `kl`) and the HTML report
both show, from the typed `KLResult`."""

from __future__ import annotations

from dataclasses import dataclass

from graphdiff.measure.kl import TARGET_OF_FLOOR, TARGET_OF_UNPATCHED, at_target, floor_ratio
from graphdiff.records import KLMeasurement, KLResult


@dataclass
class GapTable:
    """Bucket labels, then one row per measurement and per comparison of two, a cell per bucket."""

    buckets: list[str]
    rows: list[tuple[str, list[str]]]
    colored: set[int]  # rows whose "no" cells are a bucket not at the engine (the terminal shows them red)


def regions_label(m: KLMeasurement) -> str:
    """The patched regions of a measurement, short: "-", one or two names, or a count."""
    if not m.regions:
        return "-"
    return "+".join(m.regions) if len(m.regions) <= 2 else f"{len(m.regions)} regions"


def measurement_label(m: KLMeasurement, substituted: bool = False) -> str:
    if m.trainer_mode == "engine-prefill":
        return "floor"
    return f"{m.engine_mode} / {m.trainer_mode}" + (f" + {regions_label(m)}" if m.regions else "") + (
        ", engine's attention op" if substituted else "")


def floor_note(kl: KLResult) -> str | None:
    """Where the engine's decode differs from its own prefill scoring: on what share of tokens, why, and what that
    means for a patch (None where the floor is 0 or was not measured)."""
    fl = kl.floor
    if fl is None or fl.bitexact_fraction >= 1.0:
        return None
    differ = round((1 - fl.bitexact_fraction) * fl.tokens)
    return (f"the engine's own floor: its decode differs from its own prefill scoring of the same sequences on "
            f"{differ} of {fl.tokens} tokens ({1 - fl.bitexact_fraction:.1%}; RMS {fl.rms:.4f}). The engine computes "
            "a one-row decode step and a many-row prefill in different orders (batch variance), which no trainer "
            "patch removes: a trainer at the engine equals its prefill scoring "
            "(or its decode, where they differ), and its gap to the decode is at most this floor" + floor_kernels(kl))


def floor_kernels(kl: KLResult) -> str:
    """The floor note's last sentence: the engine's ops whose rows change with the rows beside them (kl.floor_ops)."""
    varying = [line for line in kl.floor_ops if not line.startswith("not probed") and " 0% of" not in line]
    if varying:
        return ". Made by the ops whose row changes with the rows computed beside it (probed at this model's " \
               "shapes): " + "; ".join(varying)
    if any(line.startswith("not probed") for line in kl.floor_ops):
        return f". The engine's ops were {kl.floor_ops[0]}"
    if kl.floor_ops:
        return (". None of the probed ops (the dense GEMMs, attention) changes a row with the rows beside it at this "
                "model's shapes on random inputs: the floor comes from an op not probed or from these inputs")
    return ""


def compared(kl: KLResult) -> tuple[KLMeasurement | None, KLMeasurement | None]:
    """The compiled engine against the eager trainer: unpatched, and patched."""
    meas = [m for m in kl.measurements if m.engine_mode == "compiled" and m.trainer_mode == "eager"]
    return next((m for m in meas if m.regions is None), None), next((m for m in meas if m.regions), None)


def gap_table(kl: KLResult | None) -> GapTable | None:
    """Each measurement's RMS (bit-identical fraction) per bucket, the engine's floor, the patched trainer with the
    engine's attention op; patched / unpatched, patched / floor, whether each bucket is at the engine; the named
    shares of the patched gap. None where no measurement has positions."""
    if kl is None:
        return None
    sub = kl.engine_attention
    measured = [*kl.measurements, *([kl.floor] if kl.floor else [])]
    shown = [(measurement_label(m, m is sub), m) for m in [*measured, *([sub] if sub else [])] if m.position]
    if not shown:
        return None
    table = GapTable([f"{b.start}-{b.stop - 1}" for b in shown[0][1].position], [], set())
    table.rows += [(label, [f"{b.rms:.4f} ({b.bitexact_fraction:.0%})" for b in m.position]) for label, m in shown]
    plain, fixed = compared(kl)
    for label, m in (("patched / unpatched rms", fixed), ("... with the engine's attention op", sub)):
        if plain and m:
            table.rows.append((label, [f"{b.rms / a.rms:.2f}" if a.rms else "-"
                                       for a, b in zip(plain.position, m.position)]))
    fl = kl.floor
    if fixed and fl:
        table.rows.append(("patched / floor rms", [floor_ratio(b, f) for b, f in zip(fixed.position, fl.position)]))
    if plain and fixed:
        floors = fl.position if fl else [None] * len(fixed.position)
        table.colored.add(len(table.rows))
        table.rows.append((f"at the engine (<= {TARGET_OF_UNPATCHED:g} x unpatched or {TARGET_OF_FLOOR:g} x floor)",
                           ["yes" if at_target(a, b, f) else "no"
                            for a, b, f in zip(plain.position, fixed.position, floors)]))
    table.rows += [(f"share of the patched ms: {src.name}", [f"{x:.0%}" for x in src.share]) for src in kl.sources]
    return table
