"""Coarse mode: read step times and losses from a training command's output."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from trainbridge.sandbox.workload import WorkloadConfig


@dataclass
class ParsedOutput:
    step_times_s: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    nonfinite_step: int | None = None


def parse_command_output(stdout: str, config: WorkloadConfig) -> ParsedOutput:
    """One step per line that matches the step-time pattern; its loss from the same line if present."""
    time_re, loss_re = re.compile(config.step_time_pattern), re.compile(config.loss_pattern)
    parsed = ParsedOutput()
    for line in stdout.splitlines():
        time_match = time_re.search(line)
        loss_match = loss_re.search(line)
        if loss_match:
            value = float(loss_match.group("loss"))
            if not math.isfinite(value) and parsed.nonfinite_step is None:
                parsed.nonfinite_step = len(parsed.losses)
            parsed.losses.append(value)
        if time_match:
            groups = time_match.groupdict()
            seconds = float(groups["ms"]) / 1000 if groups.get("ms") is not None else float(groups["s"])
            parsed.step_times_s.append(seconds)
    return parsed
