"""Is a script-mode program repeatable under one seed? Two identical runs, their losses compared (parent side).

Script mode puts every seeding call under the gate's seed (sandbox/script/hooks.py), which makes most
scripts repeatable. What escapes it: generators seeded from the OS or the clock (`random.Random()`,
`numpy.random.RandomState()`, `torch.seed()`, `os.urandom`, a seed computed from `time.time()`),
data-loader workers seeded that way, and nondeterministic kernels. `check_repeatable` runs the
workload twice with the same seed and, when the losses differ, names the likely causes from the
script's source and from the seeding calls the two runs made (a seed that differed between them
comes from the clock or the OS). The gate can then judge speed with the numerics checks that do not
need repeatable losses, and say which.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field

from trainbridge.records import Record
from trainbridge.sandbox.results import RunResult
from trainbridge.sandbox.script.launch import parse_launch
from trainbridge.sandbox.workload import Workload

SOURCE_CAUSES = (
    (re.compile(r"random\.Random\(\s*\)"), "random.Random() without a seed (seeded from the OS at every run)"),
    (re.compile(r"RandomState\(\s*\)"), "numpy.random.RandomState() without a seed"),
    (re.compile(r"torch\.seed\(\s*\)"), "torch.seed() (a fresh nondeterministic seed)"),
    (re.compile(r"os\.urandom|secrets\.|uuid\.uuid4"), "randomness from the OS (os.urandom, secrets, uuid4)"),
    (re.compile(r"seed\w*\s*=\s*[^\n]*time\.(?:time|time_ns|perf_counter)\("), "a seed computed from the clock"),
    (re.compile(r"num_workers\s*=\s*[1-9]"), "data-loader worker processes (seed them with worker_init_fn and a generator)"),
    (re.compile(r"torch\.Generator\([^)]*\)\.manual_seed"), "a torch.Generator seeded by the script itself, outside the gate's seed"),
)


class DeterminismReport(Record):
    repeatable: bool
    message: str
    first_difference_step: int | None = None
    losses: tuple[list[float], list[float]] = Field(description="the two runs' losses, warm-up included")
    likely_causes: list[str] = Field(default_factory=list)


def likely_causes(script_source: str, first: RunResult, second: RunResult) -> list[str]:
    """Causes of nondeterminism seen in the script's source and in the seeding calls of two runs."""
    causes = [cause for pattern, cause in SOURCE_CAUSES if pattern.search(script_source)]
    calls_a = (first.extra.get("script") or {}).get("seed_calls", [])
    calls_b = (second.extra.get("script") or {}).get("seed_calls", [])
    for a, b in zip(calls_a, calls_b):
        if a[0] == b[0] and a[1] != b[1]:
            causes.append(f"{a[0]} was called with {a[1]} in one run and {b[1]} in the other: that seed comes from the clock or the OS")
            break
    return causes


def check_repeatable(workload: Workload, *, backend: str = "cpu", run=None, first: RunResult | None = None) -> DeterminismReport:
    """Run the workload twice with its seed; compare the losses bit for bit. `first`: a run of it already made
    (the run's baseline measurement), so only one more is needed. `run`: the runner (tests)."""
    from trainbridge.sandbox.runner import run_workload

    run = run or run_workload
    first = first if first is not None else run(workload, backend=backend)
    second = run(workload, backend=backend)
    for result in (first, second):
        if result.failure is not None:
            raise RuntimeError(f"the repeatability check could not run the workload ({result.failure.kind}): {result.failure.message}")
    a, b = [*first.losses, *first.cooldown_losses], [*second.losses, *second.cooldown_losses]
    differing = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if differing is None and len(a) == len(b):
        return DeterminismReport(repeatable=True, message=f"two runs with seed {workload.config.seed} gave identical losses "
                                 f"over {len(a)} steps", losses=(a, b))
    spec = parse_launch(workload.config.launch) if workload.config.launch else None
    source_path = Path(workload.root) / spec.script if spec and spec.script else None
    source = source_path.read_text(encoding="utf-8", errors="replace") if source_path and source_path.is_file() else ""
    causes = likely_causes(source, first, second)
    step = differing if differing is not None else min(len(a), len(b))
    message = (f"nondeterministic: two runs with seed {workload.config.seed} differ from step {step} on "
               f"({a[step] if step < len(a) else None!r} vs {b[step] if step < len(b) else None!r}); likely cause"
               f"{'s' if len(causes) != 1 else ''}: {'; '.join(causes) if causes else 'not found in the script (nondeterministic kernels, threads, or a module it imports)'}. "
               "The losses of the timed steps cannot be compared; the gradient and parameter checks on one run's own steps still apply")
    return DeterminismReport(repeatable=False, message=message, first_difference_step=step, losses=(a, b), likely_causes=causes)
