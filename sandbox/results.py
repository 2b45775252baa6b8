"""Typed results of running a workload in the sandbox."""

from __future__ import annotations

import statistics
from enum import StrEnum

from pydantic import Field

from trainbridge.records import Record


class FailureKind(StrEnum):
    import_error = "import_error"  # the entry module or one of its imports failed to import
    bad_workload = "bad_workload"  # the entry ran but did not return the parts the contract asks for
    exception = "exception"  # the training step raised
    timeout = "timeout"  # wall-clock limit reached; the whole process group was killed
    oom = "oom"  # allocation failed under the memory cap, or the process was killed for memory
    nonfinite_loss = "nonfinite_loss"  # a step returned NaN or inf
    crashed = "crashed"  # the child died without a result (signal, interpreter abort)
    forbidden_call = "forbidden_call"  # killed by the sandbox's system-call filter (sandbox/child/signal_filter.py)


class Failure(Record):
    kind: FailureKind
    message: str
    exception_type: str | None = None
    traceback_tail: str | None = None
    step: int | None = Field(default=None, description="0-based step index where it failed, when known")


class ChildWatch(Record):
    """What the parent saw of a timed child from the kernel's side (sandbox/proc_watch.py) and of its
    conduct on the control channel. Empty lists: nothing seen; None figures: not measurable here."""

    cpu_s: float | None = Field(default=None, description="CPU time of the child and its descendants over the timed steps")
    wall_s: float | None = Field(default=None, description="wall time of the timed steps, on the parent's clock")
    cores_used: float | None = Field(default=None, description="cpu_s / wall_s")
    max_threads: int | None = None
    raised_priority: list[str] = Field(default_factory=list, description="threads or processes running above the gate's priority")
    extra_processes: list[int] = Field(default_factory=list, description="descendant processes alive during the timed steps")
    helper_cpu_s: float | None = Field(default=None, description="CPU time of those descendants over the timed steps")
    threads_in_use: int | None = Field(default=None, description="torch.get_num_threads() at the end, as the child reports it")
    survivors: list[str] = Field(default_factory=list, description="processes that escaped the child's process group and outlived it")
    protocol_violations: list[str] = Field(default_factory=list, description="messages on the control channel the harness did not send")
    replaced: list[str] = Field(default_factory=list, description="clocks, sync and harness functions the workload rebound (sandbox/guard.py)")
    idle_cpu_s: float | None = Field(default=None, description="paired runs: CPU of the child's tree while the other child was "
                                      "timed, over the other's second step in a row (the child's own spin-waits are over by then)")
    idle_wall_s: float | None = Field(default=None, description="paired runs: wall time of those steps of the other child")
    near_idle_cpu_s: float | None = Field(default=None, description="paired runs: CPU of the child's tree over the other's "
                                          "steps right after its own (its spin-waits fall there)")
    near_idle_wall_s: float | None = None
    near_idle_steps: int = 0
    interference: list[str] = Field(default_factory=list, description="paired runs: what another process did to this child "
                                    "(stopped it, lowered its priority, narrowed its cores)")


class RunResult(Record):
    """What one sandboxed run produced. `failure` is None exactly when the run succeeded."""

    failure: Failure | None = None
    mode: str = Field(description="entry or command")
    backend: str
    device: str
    seed: int
    threads: int
    warmup_steps: int
    step_times_s: list[float] = Field(default_factory=list, description="measured steps only, device-synchronised")
    warmup_times_s: list[float] = Field(default_factory=list)
    losses: list[float] = Field(default_factory=list, description="every step, warm-up included")
    timing_source: str = Field(default="child", description="parent: step times on the parent's clock (control channel); child: the harness's")
    inner_step_times_s: list[float] = Field(default_factory=list, description="parent-timed runs: the child's own clock per timed step "
                                            "(warm-up, measured, cool-down), for the cross-check")
    cooldown_times_s: list[float] = Field(default_factory=list)
    device_kernels_per_step: list[int] = Field(default_factory=list, description="parent-timed runs on the emulated NPU: the "
                                               "kernels each timed step launched on the device (sandbox/device_kernels.py), "
                                               "counted by the child; empty where nothing counts")
    clock_span_s: tuple[float, float] | None = Field(default=None, description="parent-timed runs: from the first timed step's reply to "
                                                     "the last, on the parent's clock and on the child's")
    cooldown_losses: list[float] = Field(default_factory=list)
    watch: ChildWatch | None = Field(default=None, description="parent-timed runs: the kernel's view of the child")
    interrupted: str | None = Field(default=None, description="paired runs: the other child's fault ended this run (why)")
    peak_memory_bytes: int | None = None
    versions: dict[str, str] = Field(default_factory=dict)
    network_isolated: bool = False
    confined: bool = Field(default=False, description="the child ran under bubblewrap (sandbox/confinement.py): own PID, "
                           "mount and user namespaces, writable only its scratch and compile cache")
    isolation_notes: list[str] = Field(default_factory=list)
    memory_limit_mb: int | None = None
    wall_s: float = 0.0
    stdout_tail: str = ""
    stderr_tail: str = ""
    extra: dict[str, object] = Field(default_factory=dict, description="mode-specific outputs (e.g. evidence paths)")

    @property
    def ok(self) -> bool:
        return self.failure is None

    @property
    def kernels_per_step(self) -> int | None:
        """The median of the timed steps' device kernel counts (None where the device does not count them)."""
        if not self.device_kernels_per_step:
            return None
        return int(statistics.median_low(self.device_kernels_per_step))

    def median_step_s(self) -> float | None:
        return statistics.median(self.step_times_s) if self.step_times_s else None

    def quantile_step_s(self, q: float) -> float | None:
        """Step-time quantile by linear interpolation (q in [0, 1])."""
        if not self.step_times_s:
            return None
        ordered = sorted(self.step_times_s)
        position = q * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
