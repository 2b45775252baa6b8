"""The gate's verdict: accepted, or the typed reason why not, with every figure behind it."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainbridge.agents.profiler.drift import GateDrift
from trainbridge.agents.profiler.integrity import Finding
from trainbridge.agents.profiler.numerics import NumericsResult
from trainbridge.agents.profiler.stats import SpeedDecision
from trainbridge.sandbox.results import Failure, FailureKind


class VerdictReason(StrEnum):
    accepted = "accepted"  # numerics match and the step is significantly faster by at least min_gain
    slower = "slower"  # numerics match, the step is significantly slower
    not_significant = "not_significant"  # numerics match, no significant gain (or below min_gain)
    numerics_mismatch = "numerics_mismatch"  # gradients or losses differ beyond tolerance, or a non-finite loss
    crashed = "crashed"  # the candidate raised or died
    timed_out = "timed_out"
    out_of_memory = "out_of_memory"
    import_error = "import_error"
    speed_unmeasured_numerics_ok = "speed_unmeasured_numerics_ok"  # NPU emulation: numerics verified, speed needs hardware
    skipped_work = "skipped_work"  # gate-gaming: skipped or cached work, parameters not updated, work done only when not timed
    tampered_inputs = "tampered_inputs"  # gate-gaming: changed batch contents, seeds or the workload configuration
    tampered_timing = "tampered_timing"  # gate-gaming: the child's own clock disagrees with the gate's (a rebound clock or sync)
    tampered_resources = "tampered_resources"  # gate-gaming: more cores, a raised priority, processes that outlive the run
    tampered_harness = "tampered_harness"  # gate-gaming: wrote into the control channel or into its worktree while judged
    region_slower = "region_slower"  # the rewritten region alone is clearly slower (agents/profiler/region_lab.py): gate skipped


FAILURE_REASONS: dict[FailureKind, VerdictReason] = {
    FailureKind.import_error: VerdictReason.import_error,
    FailureKind.bad_workload: VerdictReason.crashed,
    FailureKind.exception: VerdictReason.crashed,
    FailureKind.crashed: VerdictReason.crashed,
    FailureKind.timeout: VerdictReason.timed_out,
    FailureKind.oom: VerdictReason.out_of_memory,
    FailureKind.nonfinite_loss: VerdictReason.numerics_mismatch,
    FailureKind.forbidden_call: VerdictReason.tampered_resources,
}


class DeviceKernels(BaseModel):
    """NPU kernels per training step on each side (median of the first round's timed steps), counted on the
    emulated device (sandbox/device_kernels.py): the paper's own measure where speed cannot be measured.
    Each child reports its own count: a figure for the report, never part of the decision."""

    model_config = ConfigDict(frozen=True)

    baseline: int
    candidate: int

    @property
    def change(self) -> float | None:
        """candidate / baseline - 1 (negative: fewer kernels)."""
        return self.candidate / self.baseline - 1 if self.baseline else None

    def describe(self) -> str:
        change = self.change
        percent = f", {change * 100:+.0f}%".replace("-", "\u2212") if change is not None else ""
        return f"NPU kernels per step {self.baseline} \u2192 {self.candidate}{percent}"


class Verdict(BaseModel):
    """`accepted` is True only for a measured gain with matching numerics. A verdict with reason
    `speed_unmeasured_numerics_ok` is not accepted: its commit waits for a measurement on hardware."""

    model_config = ConfigDict(extra="forbid")

    accepted: bool
    reason: VerdictReason
    message: str = Field(description="one paragraph with the figures behind the reason")
    backend: str
    phase: Literal["config", "region", "numerics", "timing", "done"] = Field(description="how far the gate got")
    baseline_rounds: list[list[float]] = Field(default_factory=list, description="measured step times (s) per round, baseline")
    candidate_rounds: list[list[float]] = Field(default_factory=list, description="measured step times (s) per round, candidate")
    round_order: list[str] = Field(default_factory=list, description="per round: 'AB' (baseline first) or 'BA'")
    busy_rounds: list[int] = Field(default_factory=list, description="rounds left out of the decision and measured again: the "
                                   "machine was busy (agents/profiler/quiet.py)")
    pairing: Literal["paired", "sequential"] | None = Field(default=None, description="paired: both sides of a round alive at once, "
                                                             "their steps alternated; sequential: one child after the other")
    wait_policy: str | None = Field(default=None, description="when the gate's children ran under OMP_WAIT_POLICY=PASSIVE because the "
                                    "machine was contended (agents/profiler/quiet.py), and from which round; None: the default policy")
    spawn: str | None = Field(default=None, description="how the gate's children started: fork-server (forked from a warm server, "
                              "sandbox/child/fork_server.py) or exec (a new interpreter each)")
    ratio: float | None = Field(default=None, description="candidate/baseline step time; < 1 is faster")
    ratio_ci: tuple[float, float] | None = None
    speed: SpeedDecision | None = None
    numerics: NumericsResult | None = None
    precision_reference: Literal["matched_reference", "differs_from_both", "reference_failed"] | None = Field(
        default=None, description="where the candidate did not match the baseline and its recipe names a precision reference "
        "(the original region in higher precision, agents/profiler/gate.py check_against_reference): how that comparison went")
    drift: GateDrift | None = Field(default=None, description="the baseline against itself under another thread count, and the "
                                    "tolerances that allowed")
    findings: list[Finding] = Field(default_factory=list, description="gate-gaming signs")
    failure: Failure | None = Field(default=None, description="the candidate's failure, when it failed")
    numerics_seed: int | None = None
    timing_seed: int | None = Field(default=None, description="the second round's seed (every round draws its own: round_seeds)")
    round_seeds: list[int] = Field(default_factory=list, description="the seed both sides of each round were built and run with")
    baseline_versions: dict[str, str] = Field(default_factory=dict)
    candidate_versions: dict[str, str] = Field(default_factory=dict)
    wall_s: float = 0.0
    phase_seconds: dict[str, float] = Field(default_factory=dict, description="wall time of the gate's phases: numerics, timing")
    region: dict | None = Field(default=None, description="the region lab's timing of the rewritten region alone "
                                "(agents/profiler/region_lab.py RegionTiming), when it ran; never what accepts")
    device_kernels: DeviceKernels | None = Field(default=None, description="NPU kernels per step of both sides, where the "
                                                 "emulated device counts them (the NPU target without an NPU)")

    @model_validator(mode="after")
    def _accepted_matches_reason(self) -> "Verdict":
        if self.accepted != (self.reason == VerdictReason.accepted):
            raise ValueError(f"accepted={self.accepted} contradicts reason {self.reason}")
        return self

    @property
    def numerics_ok(self) -> bool:
        return self.numerics is not None and self.numerics.passed and not self.findings
