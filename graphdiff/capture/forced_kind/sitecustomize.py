"""On PYTHONPATH only while GRAPHDIFF_CPU_KIND is set: new processes (vLLM's spawned workers) run as that kind."""

from graphdiff.capture.cpu_kind import apply_forced_kind

apply_forced_kind()
