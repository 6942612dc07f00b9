"""What a patch installed on a model keeps (`State`: its manifest, regions and undo list; on the model as `ATTR`)
and what patching one splice's modules reads (`Patching`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import torch

from graphdiff.records import SpliceBase


@dataclass
class State:
    manifest: Path
    regions: list[str]
    undo: list[Callable[[], None]] = field(default_factory=list)


ATTR = "_graphdiff_patch"
ATTENTION_GRADIENTS = ("fp32", "bf16")


@dataclass
class Patching:
    """What patching a splice's modules reads: the generated module, the aligned regions, the model, the undo list."""
    gen: ModuleType
    align: frozenset[str]
    model: torch.nn.Module
    state: State
    attention_gradient: str = "fp32"  # runtime.apply's: the attention splice's backward

    def aligned(self, splice: SpliceBase) -> bool:
        return bool(self.align & set(splice.regions))


Targets = list[tuple[str, torch.nn.Module]]
