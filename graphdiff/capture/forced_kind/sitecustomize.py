"""On PYTHONPATH only while GRAPHDIFF_CPU_KIND is set: new processes (vLLM's spawned workers) run as that kind."""

from graphdiff.capture.cpu_kind import apply_forced_kind
from graphdiff.errors import GraphdiffError

try:
    apply_forced_kind()
except GraphdiffError:  # a bad kind: the graphdiff command in this process says so itself, in one line
    pass
