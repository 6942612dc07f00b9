"""Shapley attribution of a gap reduction to k patch regions; pure functions over per-sequence tables.

Subsets of regions are bitmasks (bit i set = region i aligned). The game is the reduction
v(S) = gap(∅) - gap(S), where gap(S) is the token-weighted mean of a per-token metric (k1 by
default) over all sequences, with the regions in S aligned. The input is per-sequence SUMS of that
metric per subset plus per-sequence token counts, so that the gap of any resample of sequences is
one matrix product: the bootstrap recomputes every subset's gap, then the Shapley values, per
resample, without new measurements.

Exact Shapley uses all 2^k subsets (k <= MAX_EXACT); beyond that, seeded random permutations
(each region's marginal contribution where it enters the permutation, averaged). Both are a
fixed weight matrix W with phi = W @ v(masks), so the bootstrap reuses the same subsets.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from graphdiff.records import Attribution, ShapleyValue

MAX_EXACT = 6  # 64 subsets: each one is a trainer pass over all sequences
DEFAULT_PERMUTATIONS = 256

Gaps = Callable[[int], np.ndarray]  # mask -> per-sequence sums of the metric with those regions aligned


def members(mask: int, k: int) -> list[int]:
    return [i for i in range(k) if mask >> i & 1]


def mask_of(indices: Sequence[int]) -> int:
    return sum(1 << i for i in set(indices))


def shapley_weights(k: int, permutations: int = 0, seed: int = 0) -> tuple[list[int], np.ndarray]:
    """Subsets to evaluate and W (k x len(masks)) with phi = W @ [v(m) for m in masks].

    permutations = 0: exact, phi_i = sum over S not containing i of |S|!(k-|S|-1)!/k! (v(S+i) - v(S)).
    permutations = P: the mean over P seeded random orders of each region's marginal contribution.
    """
    if k < 1:
        raise ValueError("need at least one region")
    if permutations == 0:
        masks = list(range(1 << k))
        w = np.zeros((k, len(masks)))
        fact = [math.factorial(s) for s in range(k + 1)]
        for m in masks:
            s = m.bit_count()
            for i in range(k):
                if m >> i & 1:  # m = S + i with |S| = s - 1
                    w[i, m] += fact[s - 1] * fact[k - s] / fact[k]
                else:  # m = S with |S| = s
                    w[i, m] -= fact[s] * fact[k - s - 1] / fact[k]
        return masks, w
    rng = np.random.default_rng(seed)
    index: dict[int, int] = {}
    rows: list[tuple[int, int, int]] = []  # (player, mask with, mask without)
    for _ in range(permutations):
        prefix = 0
        index.setdefault(prefix, len(index))
        for i in rng.permutation(k):
            after = prefix | 1 << int(i)
            index.setdefault(after, len(index))
            rows.append((int(i), after, prefix))
            prefix = after
    w = np.zeros((k, len(index)))
    for i, after, before in rows:
        w[i, index[after]] += 1 / permutations
        w[i, index[before]] -= 1 / permutations
    return list(index), w


def shapley_values(k: int, value: Callable[[int], float], permutations: int = 0, seed: int = 0) -> np.ndarray:
    """Shapley values of the game `value` (mask -> float) over k players."""
    masks, w = shapley_weights(k, permutations, seed)
    return w @ np.array([value(m) for m in masks], dtype=np.float64)


def minimal_set(k: int, reduction: Callable[[int], float], target: float = 0.9,
                order: Sequence[int] | None = None) -> tuple[int | None, float | None]:
    """The smallest subset whose MEASURED reduction reaches `target` x the full reduction.

    order = None: exhaustive over all subsets (smallest size first, then the largest reduction).
    Otherwise greedy: the prefixes of `order` (e.g. by Shapley value), each evaluated for real.
    Returns (mask, its reduction), or (None, None) when the full reduction is not positive.
    """
    full = reduction((1 << k) - 1)
    if not full > 0:
        return None, None
    goal = target * full - 1e-12 * abs(full)  # float noise must not push the full set below 100%
    if order is None:
        for size in range(k + 1):
            cands = [(reduction(m), m) for m in range(1 << k) if m.bit_count() == size]
            best = max(cands)
            if best[0] >= goal:
                return best[1], best[0]
        raise AssertionError("unreachable: the full set reaches any target <= 1")
    prefix = 0
    for i in order:
        prefix |= 1 << i
        r = reduction(prefix)
        if r >= goal:
            return prefix, r
    return (1 << k) - 1, full


def _memo(gaps: Gaps | np.ndarray) -> Gaps:
    if isinstance(gaps, np.ndarray):
        table = gaps
        return lambda m: table[m]
    cache: dict[int, np.ndarray] = {}

    def get(m: int) -> np.ndarray:
        if m not in cache:
            cache[m] = np.asarray(gaps(m), dtype=np.float64)
        return cache[m]

    return get


def _bootstrap_ci(table: np.ndarray, tok: np.ndarray, w: np.ndarray, masks: list[int], phi: np.ndarray,
                  bootstrap: int, confidence: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Each Shapley value's confidence interval: resample sequences with replacement (multinomial counts),
    recompute every subset's gap, take the quantiles."""
    rng = np.random.default_rng(seed)
    n = tok.size
    counts = rng.multinomial(n, np.full(n, 1 / n), size=bootstrap).T  # (n, B)
    g = (table @ counts) / (tok @ counts)  # (subsets, B)
    phis = w @ (g[masks.index(0)] - g)  # (k, B)
    alpha = (1 - confidence) / 2
    return np.quantile(phis, [alpha, 1 - alpha], axis=1) if bootstrap > 0 else (phi, phi)


def attribute(gaps: Gaps | np.ndarray, tokens: Sequence[int] | np.ndarray, regions: Sequence[str], *,
              metric: str = "k1", bootstrap: int = 1000, confidence: float = 0.95, seed: int = 0,
              permutations: int | None = None, target: float = 0.9) -> Attribution:
    """Shapley values of the gap reduction per region, bootstrap CIs over sequences, and a minimal set.

    `gaps`: a (2^k x n) table, row = mask, of per-sequence sums of the per-token metric, or a
    function mask -> that row (called once per needed subset). `tokens`: tokens per sequence.
    """
    k = len(regions)
    tok = np.asarray(tokens, dtype=np.float64)
    if k < 1 or tok.ndim != 1 or tok.size == 0 or tok.sum() <= 0:
        raise ValueError("need at least one region and at least one sequence with tokens")
    perms = (0 if k <= MAX_EXACT else DEFAULT_PERMUTATIONS) if permutations is None else permutations
    row = _memo(gaps)
    masks, w = shapley_weights(k, perms, seed)
    table = np.stack([row(m) for m in masks])  # (subsets, n)
    if table.shape[1] != tok.size:
        raise ValueError(f"{table.shape[1]} sequences in the gap table, {tok.size} token counts")

    def gap_of(sums: np.ndarray) -> float:
        return float(sums.sum() / tok.sum())

    gap = {m: gap_of(table[j]) for j, m in enumerate(masks)}
    phi = w @ (gap[0] - np.array([gap[m] for m in masks]))

    lo, hi = _bootstrap_ci(table, tok, w, masks, phi, bootstrap, confidence, seed)
    full = (1 << k) - 1
    total = gap[0] - gap[full]

    def reduction(m: int) -> float:
        if m not in gap:  # greedy verification of a subset the permutations never visited
            gap[m] = gap_of(row(m))
        return gap[0] - gap[m]

    if perms == 0:
        best, best_red = minimal_set(k, reduction, target)
        how = "exhaustive over all subsets"
    else:
        order = [int(i) for i in np.argsort(-phi, kind="stable")]
        best, best_red = minimal_set(k, reduction, target, order)
        how = "greedy by Shapley value, each prefix measured"

    def name(m: int) -> str:
        return "+".join(regions[i] for i in members(m, k))

    return Attribution(
        metric=metric, regions=list(regions), method="exact" if perms == 0 else "sampled",
        permutations=perms or None, baseline=gap[0], aligned=gap[full], reduction=total,
        values=[ShapleyValue(region=r, value=float(phi[i]), share=float(phi[i] / total) if total else None,
                             ci_low=float(lo[i]), ci_high=float(hi[i])) for i, r in enumerate(regions)],
        tokens=int(tok.sum()), sequences=tok.size, bootstrap=bootstrap, confidence=confidence, seed=seed,
        target=target, minimal_set=None if best is None else [regions[i] for i in members(best, k)],
        minimal_set_reduction=best_red, minimal_set_method=how,
        subsets={name(m): v for m, v in sorted(gap.items())},
    )
