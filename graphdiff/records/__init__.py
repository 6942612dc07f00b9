"""The data model: the contract between capture, analysis, reports and codegen.

Everything persisted is one of these pydantic models, written as versioned JSON with a JSON Schema under
graphdiff/schemas/ (regenerate with `python -m graphdiff.schemas`). One module per record family: `graph` (a captured
graph and its kernel partition, the capture), `files` (versioned JSON in and out), `buffers` (recorded kernel buffers),
`scan` (the plan, sites, regions, replay evidence), `gap` (departure, routing, the kl measurements), `manifest` (the
patch manifest and the CI gate's result). Every name is importable from `graphdiff.records`.
"""

from graphdiff.records.buffers import Buffers, ExternRecord, KernelRecord, Progress, WeightRef
from graphdiff.records.files import KIND_NAMES, REMAKE, SCHEMA_VERSION, M, load_versioned, parse_versioned, save_json
from graphdiff.records.gap import (
    Attribution,
    Departure,
    EngineMode,
    EngineSample,
    EngineSamples,
    EngineSamplesFile,
    GapName,
    GapSource,
    KLMeasurement,
    KLResult,
    PositionBin,
    RoutingAgreement,
    SampleAsk,
    SampleRequest,
    ShapleyValue,
    TrainerMode,
)
from graphdiff.records.graph import (
    MATMUL_REDUCED_FACT,
    NODE_OPS,
    BufferArg,
    Capture,
    Graph,
    Kernel,
    Node,
    NodeOp,
    PackedParam,
    Role,
    Shape,
    Side,
    Source,
    cut_layers,
    layer_of,
    load_capture,
    walk,
)
from graphdiff.records.manifest import (
    MANIFEST_VERSION,
    AttentionForm,
    AttentionSplice,
    CalledSplice,
    CarrySplice,
    CheckFinding,
    CheckResult,
    FunctionSplice,
    LinearSplice,
    Manifest,
    ManifestRegion,
    ManifestSplice,
    ModuleSplice,
    MoeSplice,
    RegionEffect,
    SpliceBase,
)
from graphdiff.records.scan import (
    REGION_KINDS,
    Decision,
    Evidence,
    KernelEvidence,
    Region,
    RegionKind,
    Rule,
    ScanResult,
    SideRef,
    SideState,
    Site,
)

__all__ = [  # every name, as `from graphdiff.records import X` has always found it
    "AttentionForm", "AttentionSplice", "Attribution", "BufferArg", "Buffers", "CalledSplice", "Capture",
    "CarrySplice", "CheckFinding", "CheckResult", "Decision", "Departure", "EngineMode", "EngineSample",
    "EngineSamples", "EngineSamplesFile", "Evidence", "ExternRecord", "FunctionSplice", "GapName", "GapSource",
    "Graph", "KIND_NAMES", "KLMeasurement", "KLResult", "Kernel", "KernelEvidence", "KernelRecord",
    "LinearSplice", "M", "MANIFEST_VERSION", "MATMUL_REDUCED_FACT", "Manifest", "ManifestRegion",
    "ManifestSplice", "ModuleSplice", "MoeSplice", "NODE_OPS", "Node", "NodeOp", "PackedParam", "PositionBin",
    "Progress", "REGION_KINDS", "REMAKE", "Region", "RegionEffect", "RegionKind", "Role", "RoutingAgreement",
    "Rule", "SCHEMA_VERSION", "SampleAsk", "SampleRequest", "ScanResult", "Shape", "ShapleyValue", "Side",
    "SideRef", "SideState", "Site", "Source", "SpliceBase", "TrainerMode", "WeightRef", "cut_layers", "layer_of",
    "load_capture", "load_versioned", "parse_versioned", "save_json", "walk",
]
