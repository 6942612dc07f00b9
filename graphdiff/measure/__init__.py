"""Measuring the engine-vs-trainer mismatch: the log-prob gap (kl), its attribution to patch regions
(shapley), and how clustered rounding positions are (uniformity). Import the submodules directly."""
