"""Models to scan: resolving a model spec offline (local dir, bundled config, `tiny:`), the seeded tiny recipes,
and the bundled configs of common model ids."""
