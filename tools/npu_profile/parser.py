"""A torch_npu profile as a TargetProfile: per source span of the repository, the ops the eager NPU
step launches and their device time (`to_target_profile`), attributing backward kernels to the
forward lines that caused them and optimizer kernels to the optimizer.

Reading the profiler's output directory into one typed table (and the analyses over it) is
tools/npu_profile/table.py; its API is re-exported here.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import Any

from trainbridge.records import Phase, SourceSpan, TargetProfile, TargetSpanStats
from trainbridge.tools.npu_profile.table import (  # noqa: F401 - the table API, re-exported for importers
    KNOWN_FILES,
    OUTPUT_DIR,
    Frame,
    KernelRow,
    NpuProfileError,
    NpuProfileTable,
    OpStatisticRow,
    OperatorRow,
    StepTraceRow,
    TraceEvent,
    device_time_by_op_type,
    find_output_dir,
    has_step_numbers,
    kernels_per_step,
    load_npu_profile,
    parse_call_stack,
    profiled_steps,
    read_trace_view,
    step_times_us,
)

UNATTRIBUTED_FILE = "<unattributed>"
OPTIMIZER_PATH_MARKERS = ("/torch/optim/", "/torch_npu/optim/", "/torch/nn/utils/clip_grad", "/apex/optimizers/")
_BACKWARD_FRAMES = (("/torch/autograd/", "backward"), ("/torch/autograd/graph.py", "_engine_run_backward"), ("/torch/_tensor.py", "backward"))
_EVALUATE_PREFIX = "autograd::engine::evaluate_function: "


# --- the target profile -------------------------------------------------------------------------
def to_target_profile(
    table: NpuProfileTable,
    repo_root: str | Path | Sequence[str | Path],
    *,
    steps: int | None = None,
    step_time_us: float | None = None,
    device: str = "npu:0",
) -> TargetProfile:
    """Aggregate operator_details.csv per (source line, phase), like the eager CPU profile.

    repo_root: the repository's path ON THE PROFILED HOST (the call stacks hold that host's paths);
    several may be given. Ops: rows that launched device work (Device Self Duration > 0), timed by
    it; a capture without device data falls back to leaf rows timed by host self time. Phase and
    line: the innermost repo frame of the call stack; frames under torch/optim (and the other
    OPTIMIZER_PATH_MARKERS) make an optimizer op. Backward ops have no Python stack (NPU autograd
    runs on a device thread): they are linked through trace_view.json, where each sits under an
    `autograd::engine::evaluate_function` slice whose sequence number names the forward op that
    created the node; a row is matched to its trace slice by (name, host duration) in order.
    Without the trace, or for nodes with no forward op (AccumulateGrad), they keep the
    "<unattributed>" span. Steps and step time come from step_trace_time.csv / ProfilerStep slices
    unless given. op_names per span are its first ops_per_step rows (operator_details.csv has no
    step column).
    """
    if table.operators is None:
        raise NpuProfileError("operator_details.csv is missing: collect with ProfilerActivity.CPU and record_shapes=True",
                              file=table.output_dir)
    if not any(row.call_stack for row in table.operators):
        raise NpuProfileError("operator_details.csv has no call stacks: collect with with_stack=True",
                              file=Path(table.output_dir) / "operator_details.csv", column="Call Stack")
    mapper = _RepoMapper(repo_root)
    links = _backward_links(table.trace_events or [], mapper)
    n_steps = steps or profiled_steps(table)
    if step_time_us is None:
        times = step_times_us(table)
        if not times:
            raise NpuProfileError("no step time: step_trace_time.csv and ProfilerStep# slices are both missing; "
                                  "pass step_time_us", file=table.output_dir)
        # Without a schedule there is one row for the whole capture: share it among the steps.
        step_time_us = statistics.median(times) if has_step_numbers(table) else sum(times) / n_steps
    device_mode = any(row.device_self_us > 0 for row in table.operators)
    groups: dict[tuple, list[tuple[OperatorRow, float]]] = {}
    spans: dict[tuple, SourceSpan] = {}
    for row in table.operators:
        if row.name.startswith("ProfilerStep#"):
            continue
        if device_mode:
            if row.device_self_us <= 0:
                continue
            time_us = row.device_self_us
        else:
            if row.host_total_us - row.host_self_us > 1e-6 or not _is_op_name(row.name):
                continue  # not a leaf op (a parent, an autograd node, a user annotation)
            time_us = row.host_self_us
        phase = _phase_of(row.call_stack)
        span = mapper.span(row.call_stack)
        if phase is Phase.backward:
            queue = links.get((row.name, round(row.host_total_us, 3)))
            linked = queue.popleft() if queue else None
            span = linked or span
        span = span or SourceSpan(file=UNATTRIBUTED_FILE, line_start=1, line_end=1)
        key = (span.file, span.line_start, span.function, phase)
        spans.setdefault(key, span)
        groups.setdefault(key, []).append((row, time_us))
    stats = []
    for key, rows in groups.items():
        first = rows[: max(1, math.ceil(len(rows) / n_steps))]
        stats.append(TargetSpanStats(
            span=spans[key], phase=key[3], op_names=[row.name for row, _ in first],
            ops_per_step=len(rows) / n_steps, self_time_us_per_step=sum(t for _, t in rows) / n_steps,
            shapes=[normalise_shapes(row.input_shapes) for row, _ in first],
        ))
    return TargetProfile(
        backend="npu", device=device, steps_profiled=n_steps, step_time_us=step_time_us,
        total_ops_per_step=sum(len(rows) for rows in groups.values()) / n_steps, spans=stats,
    )


def normalise_shapes(cell: str) -> str:
    """torch_npu `16,64;\\r\\n64` -> `[[16, 64], [64]]` (the eager profile's style); else unchanged."""
    if not cell.strip():
        return "[]"
    try:
        return str([[int(d) for d in piece.split(",") if d.strip()] for piece in (p.strip() for p in cell.split(";"))])
    except ValueError:
        return cell.strip()


class _RepoMapper:
    """Maps call-stack frames (paths of the profiled host) to repo-relative spans."""

    def __init__(self, roots: str | Path | Sequence[str | Path]):
        roots = [roots] if isinstance(roots, (str, Path)) else list(roots)
        if not roots:
            raise ValueError("give the repository root as it was on the profiled host")
        self.prefixes = [str(PurePosixPath(str(r).replace("\\", "/"))).rstrip("/") + "/" for r in roots]

    def relative(self, file: str) -> str | None:
        path = file.replace("\\", "/")
        if "/site-packages/" in path or "/dist-packages/" in path or path.startswith("<"):
            return None
        for prefix in self.prefixes:
            if path.startswith(prefix):
                return path[len(prefix):]
        if not path.startswith("/") and not path.startswith("..") and not re.match(r"^[A-Za-z]:/", path):
            return path  # a relative co_filename (script run from the repo root)
        return None

    def span(self, frames: Iterable[Frame]) -> SourceSpan | None:
        for frame in frames:  # innermost first
            rel = self.relative(frame.file)
            if rel is not None:
                return SourceSpan(file=rel, line_start=frame.line, line_end=frame.line, function=frame.function or None)
        return None


def _phase_of(frames: list[Frame]) -> Phase:
    """No Python stack: the autograd engine's device thread. Else by the frames' files."""
    if not frames:
        return Phase.backward
    for frame in frames:
        path = frame.file.replace("\\", "/")
        if any(marker in path and frame.function == function for marker, function in _BACKWARD_FRAMES):
            return Phase.backward
        if any(marker in path for marker in OPTIMIZER_PATH_MARKERS):
            return Phase.optimizer
    return Phase.forward


def _backward_links(events: list[TraceEvent], mapper: _RepoMapper) -> dict[tuple[str, float], deque]:
    """(op name, host us) -> forward spans, in trace order, of ops run under evaluate_function."""
    by_thread: dict[tuple, list[TraceEvent]] = defaultdict(list)
    for event in events:
        if event.ph == "X" and "Sequence number" in event.args and event.ts_us is not None and event.dur_us is not None:
            by_thread[(event.pid, event.tid)].append(event)
    creators: dict[int, TraceEvent] = {}  # node sequence number -> last forward op seeing it
    backward_ops: list[tuple[TraceEvent, int | None]] = []
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e.ts_us, -e.dur_us))
        open_nodes: list[tuple[float, int | None]] = []  # (end, sequence number) of evaluate_function slices
        for event in thread_events:
            while open_nodes and open_nodes[-1][0] <= event.ts_us:
                open_nodes.pop()
            seq = _int_or_none(event.args.get("Sequence number"))
            if event.name.startswith(_EVALUATE_PREFIX):
                open_nodes.append((event.ts_us + event.dur_us, seq if seq is not None and seq >= 0 else None))
            elif open_nodes:
                backward_ops.append((event, open_nodes[-1][1]))
            elif seq is not None and seq >= 0 and str(event.args.get("Call stack", "")).strip():
                if seq not in creators or creators[seq].ts_us <= event.ts_us:
                    creators[seq] = event
    spans: dict[int, SourceSpan | None] = {}
    links: dict[tuple[str, float], deque] = defaultdict(deque)
    for event, seq in sorted(backward_ops, key=lambda item: item[0].ts_us):
        if seq is not None and seq not in spans and seq in creators:
            spans[seq] = mapper.span(parse_call_stack(str(creators[seq].args["Call stack"])))
        links[(event.name, round(event.dur_us, 3))].append(spans.get(seq) if seq is not None else None)
    return links


def _is_op_name(name: str) -> bool:
    return "::" in name and not name.startswith("autograd::")


def _int_or_none(value: Any) -> int | None:
    try:
        return int(str(value).strip())
    except ValueError:
        return None
