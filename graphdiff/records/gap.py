"""The gap between the two sides: where the trainer's values first depart from the engine's, how often their
experts differ, and the log-prob gap `graphdiff kl` measures on the engine's samples."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, Field

from graphdiff.records.files import SCHEMA_VERSION


class RoutingAgreement(BaseModel):
    """MoE: how often the engine and the trainer choose different experts for the same token, in one layer."""

    layer: int
    shape: str  # the recorded shape (Shape.label) it was measured at
    tokens: int
    differing: int  # tokens whose set of top-k experts differs
    fraction: float
    trainer: str = "unpatched"  # the trainer compared: unpatched, or patched (kl: the manifest's regions)


class Departure(BaseModel):
    """The first matched trainer value (graph order) that is not bit-identical to its engine value, both in one
    dtype, on the scan's tokens: everything upstream of it is equal (graphdiff.analysis.departure)."""

    node: str
    op: str
    module: str | None = None
    layer: int | None = None
    dtype: str = ""
    engine_node: str
    engine_graph: str = ""
    kernel: str = ""  # the engine kernel (or extern) computing it
    differing: float  # fraction of its elements that differ
    # first differing row (token) of the trainer's value; None: compared in the engine's layout (its dims permuted)
    first_row: int | None = None
    equal_before: int  # matched values before it that are bit-identical
    source: str = ""  # the trainer's source line
    # the compared (bit-identical) values it reads through uncompared ops, and those ops with it, in graph order:
    # where the difference arises; `cause` names the first of them that computes (not a view)
    inputs_agree: list[str] = Field(default_factory=list)
    cause_ops: list[str] = Field(default_factory=list)
    cause: str = ""
    # the engine's ops from the values paired with those inputs to its value, named as `cause` is
    engine_cause: str = ""


# --- the log-prob gap (`graphdiff kl`) ------------------------------------------------------------------

EngineMode = Literal["compiled", "eager"]
TrainerMode = Literal["eager", "compiled", "engine-prefill"]  # engine-prefill: the engine scoring its own samples


class SampleAsk(BaseModel):
    """Seeded prompts the scan's engine samples after its capture (for the patch's gate and the gap): how many,
    how long, how many tokens each continues for."""

    count: int
    prompt_tokens: int
    max_tokens: int
    seed: int = 0
    temperature: float = 1.0


class SampleRequest(BaseModel):
    """What the engine's child process samples after its capture: the prompts themselves, and where the samples go
    (out_dir/engine_samples.json)."""

    prompts: list[list[int]]
    max_tokens: int
    seed: int
    temperature: float
    out_dir: str


class EngineSample(BaseModel):
    """One sampled continuation and the engine's own log-prob of each sampled token."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]  # FP32 values as the engine returned them (exact in JSON: Python floats round-trip)
    # the engine scoring the same prompt + tokens in one prefill (prompt_logprobs): its own decode/prefill floor
    prefill_logprobs: list[float] = Field(default_factory=list)
    # MoE: per layer, the top-k experts the engine chose for each token of prompt + tokens, scored in one prefill
    routing: dict[int, list[list[int]]] = Field(default_factory=dict)


class EngineSamples(BaseModel):
    """One engine configuration's samples, with everything that decides them (the cache key)."""

    engine: str = "vllm"
    mode: EngineMode
    model: str
    weights: str  # fingerprint of the checkpoint files (names, sizes, mtimes)
    seed: int
    temperature: float
    max_tokens: int
    versions: dict[str, str] = Field(default_factory=dict)
    compilation_config: dict[str, object] = Field(default_factory=dict)  # as given (compiled mode)
    tensor_parallel_size: int = 1  # the engine's ranks (their partial products are rounded before the all-reduce)
    samples: list[EngineSample]

    def key(self) -> tuple:
        """What decides the samples, the engine's version aside (compared separately: it may be absent)."""
        return (self.engine, self.mode, self.model, self.weights, self.seed, self.temperature, self.max_tokens,
                json.dumps(self.compilation_config, sort_keys=True), self.tensor_parallel_size,
                tuple(tuple(s.prompt) for s in self.samples))


class EngineSamplesFile(BaseModel):
    """DIR/engine_samples.json: the engine samples once; the trainer side can be re-run at will."""

    schema_version: int = SCHEMA_VERSION
    kind: Literal["graphdiff.engine_samples"] = "graphdiff.engine_samples"
    runs: list[EngineSamples] = Field(default_factory=list)


class PositionBin(BaseModel):
    """The gap over continuation positions [start, stop) (0 = the first sampled token)."""

    start: int
    stop: int
    tokens: int
    k1: float
    rms: float
    k3: float = 0.0
    bitexact_fraction: float = 0.0


class KLMeasurement(BaseModel):
    """The engine-vs-trainer gap of one configuration; diff = logp_engine - logp_train per sampled token."""

    engine_mode: EngineMode
    trainer_mode: TrainerMode
    regions: list[str] | None = None  # patched regions (None: unpatched trainer; [] never written)
    k1: float  # mean diff: the paper's per-token KL estimate
    k1_se: float | None = None  # its standard error, sequences as the independent units
    k3: float  # mean of exp(r) - 1 - r, r = -diff: unbiased, never negative per token
    k3_se: float | None = None  # its standard error, sequences as the independent units
    rms: float
    max_abs: float
    bitexact_fraction: float  # tokens whose FP32 log-probs agree bit for bit
    tokens: int
    sequences: int
    position: list[PositionBin] = Field(default_factory=list)
    label: str = ""  # what is compared, where it is not engine decode vs trainer (the floor)


GapName = Literal["attention order", "engine floor", "rest"]


class GapSource(BaseModel):
    """One named part of the patched gap, per position bucket: the mean square of diff it accounts for (the
    buckets of KLResult's measurements). Measured by substitution, not fitted."""

    name: GapName
    what: str  # how it is measured
    ms: list[float]  # per bucket, in diff^2 (rms^2 of the bucket); the parts add up to the patched ms
    share: list[float]  # ms / patched ms per bucket (0 where the patched ms is 0)


class ShapleyValue(BaseModel):
    region: str
    value: float  # gap reduction attributed to the region (same units as the metric)
    share: float | None = None  # value / full reduction (None when the full reduction is 0)
    ci_low: float
    ci_high: float


class Attribution(BaseModel):
    """Shapley attribution of the gap reduction to patched regions, with bootstrap CIs over sequences."""

    metric: str  # "k1" or "k3"
    regions: list[str]
    method: str  # "exact" (all 2^k subsets) or "sampled" (random permutations)
    permutations: int | None = None
    baseline: float  # gap with no region aligned
    aligned: float  # gap with every region aligned
    reduction: float  # baseline - aligned (= sum of the Shapley values)
    values: list[ShapleyValue]
    tokens: int
    sequences: int
    bootstrap: int
    confidence: float
    seed: int
    target: float  # fraction of `reduction` the minimal set must reach
    minimal_set: list[str] | None = None  # None when the full reduction is not positive
    minimal_set_reduction: float | None = None  # measured, not predicted
    minimal_set_method: str = ""
    subsets: dict[str, float] = Field(default_factory=dict)  # gap of every evaluated subset ("" = none)


class KLResult(BaseModel):
    """What `graphdiff kl` writes to DIR/kl.json."""

    schema_version: int = SCHEMA_VERSION
    kind: Literal["graphdiff.kl"] = "graphdiff.kl"
    model: str
    architecture: str
    fingerprint: str = ""  # the checkpoint measured (artifacts.model_fingerprint)
    scan_id: str = ""  # the scan it was measured for (`scan --kl`); "" for `graphdiff kl`
    engine: str = "vllm"
    versions: dict[str, str] = Field(default_factory=dict)
    seed: int
    temperature: float
    max_tokens: int
    prompts: int
    method: str  # exactly how each side's log-probs are computed
    measurements: list[KLMeasurement]
    # the engine's own floor: its decode log-probs vs its prefill scoring of the same sequences (compiled engine)
    floor: KLMeasurement | None = None
    # where the floor is not 0: the engine's ops probed for batch variance (measure.floor_ops), varying ones first
    floor_ops: list[str] = Field(default_factory=list)
    bucket: int = 128  # width of the position buckets (`position`) in tokens
    compilation_config: dict[str, object] = Field(default_factory=dict)  # the compiled engine's, as asked
    attribution: Attribution | None = None
    manifest: str | None = None  # the patch measured; `scan --kl`: relative to the scan directory
    # The patched trainer with the engine's own attention op (graphdiff.measure.engine_attention) and the patched
    # gap split into named sources by it; sources_note says why not, where they could not be measured
    engine_attention: KLMeasurement | None = None
    sources: list[GapSource] = Field(default_factory=list)
    sources_note: str = ""
    # regions the scan found that the patch does not apply ("name: why"): part of the patched gap, by name
    left_out: list[str] = Field(default_factory=list)
    # where the rest is over REST_LIMIT of the patched gap in some bucket: the patched trainer's first departure from
    # the engine on the scan's tokens (`scan --manifest` against the scan's engine capture), or why it is not known
    departure: Departure | None = None
    departure_note: str = ""
    # MoE: per layer, how often the eager trainer (unpatched, patched) chooses other experts than the compiled
    # engine on the samples' tokens (the engine's choices recorded while it scores each sample in one prefill)
    routing: list[RoutingAgreement] = Field(default_factory=list)
    timings: dict[str, float] = Field(default_factory=dict)
    reproduce: str = ""
    notes: list[str] = Field(default_factory=list)
