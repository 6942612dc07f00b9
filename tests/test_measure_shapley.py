"""Shapley attribution: the axioms, known games, bootstrap intervals, and the minimal set."""

from __future__ import annotations

import numpy as np
import pytest

from graphdiff.measure.shapley import (
    attribute,
    mask_of,
    members,
    minimal_set,
    shapley_values,
    shapley_weights,
)


def _random_game(k: int, seed: int) -> np.ndarray:
    v = np.random.default_rng(seed).normal(size=1 << k)
    v[0] = 0.0
    return v


def test_masks_round_trip():
    assert mask_of([0, 2]) == 5 and members(5, 3) == [0, 2]


@pytest.mark.parametrize("k", [1, 2, 4, 6])
def test_efficiency_exact(k):
    v = _random_game(k, k)
    phi = shapley_values(k, lambda m: v[m])
    assert phi.sum() == pytest.approx(v[-1] - v[0], abs=1e-12)


def test_efficiency_holds_for_sampled_permutations_too():
    k = 8
    v = _random_game(k, 0)
    phi = shapley_values(k, lambda m: v[m], permutations=50, seed=3)
    assert phi.sum() == pytest.approx(v[-1] - v[0], abs=1e-9)  # every permutation telescopes


def test_symmetric_players_get_equal_values():
    # Players 0 and 1 are interchangeable: v depends on how many of them are in S, plus player 2.
    k = 3
    v = {m: [0.0, 1.0, 3.0][bin(m & 3).count("1")] + (0.7 if m & 4 else 0.0) * (1 + (m & 3 == 3)) for m in range(8)}
    phi = shapley_values(k, v.__getitem__)
    assert phi[0] == pytest.approx(phi[1], abs=1e-12)


def test_a_null_player_gets_zero_and_an_additive_dummy_its_own_value():
    base = _random_game(2, 5)
    null = shapley_values(3, lambda m: base[m & 3])  # player 2 never changes anything
    assert null[2] == pytest.approx(0.0, abs=1e-12)
    dummy = shapley_values(3, lambda m: base[m & 3] + (0.25 if m & 4 else 0.0))
    assert dummy[2] == pytest.approx(0.25, abs=1e-12)
    assert dummy[:2] == pytest.approx(null[:2], abs=1e-12)


def test_glove_game():
    # One left glove (player 0), two right gloves (1, 2); a pair is worth 1: phi = (2/3, 1/6, 1/6).
    phi = shapley_values(3, lambda m: float(min(m & 1, bin(m & 6).count("1"))))
    assert phi == pytest.approx([2 / 3, 1 / 6, 1 / 6], abs=1e-12)


def test_unanimity_and_majority_games():
    unanimity = shapley_values(4, lambda m: float(m & 0b0110 == 0b0110))
    assert unanimity == pytest.approx([0, 0.5, 0.5, 0], abs=1e-12)
    majority = shapley_values(3, lambda m: float(bin(m).count("1") >= 2))
    assert majority == pytest.approx([1 / 3] * 3, abs=1e-12)


def test_sampled_permutations_approach_exact_values():
    k = 8
    v = _random_game(k, 11)
    exact = shapley_values(k, lambda m: v[m])
    sampled = shapley_values(k, lambda m: v[m], permutations=4000, seed=0)
    assert np.abs(sampled - exact).max() < 0.1
    additive = np.array([0.1 * i for i in range(k)])  # marginals never depend on the order: sampled is exact
    phi = shapley_values(k, lambda m: additive[members(m, k)].sum(), permutations=3, seed=1)
    assert phi == pytest.approx(additive, abs=1e-12)


def test_weights_are_reproducible_per_seed():
    m1, w1 = shapley_weights(7, permutations=20, seed=4)
    m2, w2 = shapley_weights(7, permutations=20, seed=4)
    assert m1 == m2 and np.array_equal(w1, w2)
    assert shapley_weights(3)[0] == list(range(8))


def _table(effects: list[float], tokens: np.ndarray, baseline: float = 1.0, noise: float = 0.0,
           seed: int = 0) -> np.ndarray:
    """Per-sequence sums: each token's gap is baseline - sum of the aligned regions' effects (+ noise)."""
    k = len(effects)
    rng = np.random.default_rng(seed)
    per_seq_noise = rng.normal(size=tokens.size) * noise
    return np.stack([(baseline - sum(effects[i] for i in members(m, k)) + per_seq_noise) * tokens
                     for m in range(1 << k)])


def test_attribute_recovers_additive_effects_with_collapsed_intervals():
    tokens = np.array([16, 32, 8, 64])
    a = attribute(_table([0.6, 0.25, 0.05], tokens), tokens, ["rope", "swiglu", "residual"], bootstrap=200)
    assert [v.value for v in a.values] == pytest.approx([0.6, 0.25, 0.05], abs=1e-12)
    assert a.reduction == pytest.approx(0.9) and a.baseline == pytest.approx(1.0)
    assert a.tokens == 120 and a.sequences == 4 and a.method == "exact"
    assert all(v.ci_low == pytest.approx(v.value) and v.ci_high == pytest.approx(v.value) for v in a.values)
    assert [v.share for v in a.values] == pytest.approx([6 / 9, 2.5 / 9, 0.5 / 9])
    assert a.minimal_set == ["rope", "swiglu"]  # 0.85 >= 90% of 0.9; rope alone (0.6) is not
    assert a.minimal_set_reduction == pytest.approx(0.85)
    assert a.subsets[""] == pytest.approx(1.0) and a.subsets["rope+swiglu+residual"] == pytest.approx(0.1)


def test_a_region_that_widens_the_gap_is_negative_and_left_out_of_the_minimal_set():
    tokens = np.full(6, 10)
    a = attribute(_table([0.8, -0.2, 0.4], tokens), tokens, ["rope", "swiglu", "residual"], bootstrap=50)
    assert a.values[1].value == pytest.approx(-0.2)
    assert a.minimal_set == ["rope", "residual"] and a.minimal_set_reduction == pytest.approx(1.2)


def test_bootstrap_interval_covers_the_point_and_widens_with_noise():
    tokens = np.full(40, 32)
    quiet = attribute(_table([0.5, 0.2], tokens, noise=0.01), tokens, ["a", "b"], bootstrap=500, seed=1)
    loud = attribute(_table([0.5, 0.2], tokens, noise=0.3, seed=1), tokens, ["a", "b"], bootstrap=500, seed=1)
    for a in (quiet, loud):
        assert all(v.ci_low <= v.value <= v.ci_high for v in a.values)
    # Additive noise per sequence moves every subset's gap alike: it cancels in the reductions.
    assert quiet.values[0].ci_high - quiet.values[0].ci_low < 1e-9
    interacting = _table([0.5, 0.2], tokens)
    interacting[3] += np.random.default_rng(2).normal(size=40) * 0.2 * tokens  # noise only with both aligned
    wide = attribute(interacting, tokens, ["a", "b"], bootstrap=500, seed=1)
    assert wide.values[0].ci_high - wide.values[0].ci_low > 0.01


def test_many_regions_use_sampled_permutations_and_a_verified_greedy_set():
    k = 8
    tokens = np.full(5, 20)
    effects = [0.6, 0.25, 0.07, 0.03, 0.02, 0.015, 0.01, 0.005]
    calls = []

    def gaps(m: int) -> np.ndarray:
        calls.append(m)
        return _table(effects, tokens)[m]

    a = attribute(gaps, tokens, [f"r{i}" for i in range(k)], bootstrap=20, seed=0)
    assert a.method == "sampled" and a.permutations == 256
    assert [v.value for v in a.values] == pytest.approx(effects, abs=1e-12)
    assert a.minimal_set == ["r0", "r1", "r2"]  # 0.92 of 1.0
    assert len(calls) == len(set(calls))  # each subset measured once


def test_no_reduction_means_no_minimal_set():
    tokens = np.full(3, 4)
    a = attribute(_table([0.0, -0.1], tokens), tokens, ["a", "b"], bootstrap=10)
    assert a.minimal_set is None and a.minimal_set_reduction is None
    assert minimal_set(2, lambda m: 0.0) == (None, None)


def test_bad_inputs():
    with pytest.raises(ValueError):
        attribute(np.zeros((2, 3)), [1, 2], ["a"])
    with pytest.raises(ValueError):
        attribute(np.zeros((2, 3)), [0, 0, 0], ["a"])
