"""From two captures to the scan result: where each side rounds, matched values, the rounding plan, its sites and
regions; opaque kernels, mixture-of-experts, tensor parallelism, the first departure, rounding non-uniformity."""
