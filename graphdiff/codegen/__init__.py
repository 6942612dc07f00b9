"""Region -> generated FP32-preserving code (PyTorch + Triton) and the manifest the runtime loads."""

from graphdiff.codegen.generate import MODULE_FILE, generate

__all__ = ["MODULE_FILE", "generate"]
