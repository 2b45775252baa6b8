"""Parse a torch_npu profiler output directory into one typed table; analyses are functions over it.

Input: what `torch_npu.profiler.tensorboard_trace_handler(dir)` leaves, i.e.
`<dir>/<host>_<pid>_<timestamp>_ascend_pt/ASCEND_PROFILER_OUTPUT/` holding kernel_details.csv,
operator_details.csv, op_statistic.csv, step_trace_time.csv and trace_view.json (formats:
shared/reference/npu/profiler_output_formats.md). Any of these paths is accepted.

Tolerance, as the formats differ across CANN / torch_npu versions:
- CSV columns are found by NAME, compared without case, spaces and underscores ("Device_id" =
  "Device ID", "Communication(Not Overlapped)" = "Communication (Not Overlapped)"), with aliases
  ("Block Num" / older "Block Dim", op_summary names such as "Task Duration(us)"). Extra columns are
  ignored; "Step Id" is optional. Number cells are stripped first (some writers append a tab).
- trace_view.json is a bare JSON array (an object with "traceEvents" is accepted too), ts may be
  a number or a decimal string; an array cut off mid-record keeps its complete records.
Garbage is rejected with `NpuProfileError` naming the file, the column and the line: a missing
required column, a non-number where a duration belongs, a directory that is not profiler output.

Call stacks ("Call Stack" column, "Call stack" trace arg) list frames innermost first as
`path(line): function`, separated by ";" (torch_npu writes ";\\r\\n"). They need with_stack=True.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from pydantic import Field

from trainbridge.records import Record

OUTPUT_DIR = "ASCEND_PROFILER_OUTPUT"
KNOWN_FILES = ("kernel_details.csv", "operator_details.csv", "op_statistic.csv", "step_trace_time.csv", "trace_view.json")
_OPTIMIZER_STEP_PREFIX = "Optimizer.step#"
_FRAME = re.compile(r"^(?P<file>.+)\((?P<line>\d+)\):\s*(?P<function>.*)$")


class NpuProfileError(ValueError):
    """The profiler output is missing or malformed; the message names the file, column and line."""

    def __init__(self, message: str, *, file: Path | str | None = None, column: str | None = None, line: int | None = None):
        where = ", ".join(part for part in (
            str(file) if file else None, f"column {column!r}" if column else None, f"line {line}" if line else None) if part)
        super().__init__(f"{where}: {message}" if where else message)
        self.file, self.column, self.line = file, column, line


# --- table rows ---------------------------------------------------------------------------------
class Frame(Record):
    file: str
    line: int
    function: str


class KernelRow(Record):
    step_id: int | None = None
    device_id: int | None = None
    name: str
    type: str
    accelerator_core: str | None = None
    start_us: float
    duration_us: float
    wait_us: float | None = None
    block_num: int | None = Field(default=None, description='"Block Num", or "Block Dim" in older CANN')
    input_shapes: str | None = None


class OperatorRow(Record):
    name: str
    input_shapes: str = ""
    call_stack: list[Frame] = Field(default_factory=list, description="innermost frame first")
    host_self_us: float
    host_total_us: float
    device_self_us: float
    device_total_us: float


class OpStatisticRow(Record):
    device_id: int | None = None
    op_type: str
    core_type: str | None = None
    count: int
    total_us: float
    avg_us: float | None = None


class StepTraceRow(Record):
    device_id: int | None = None
    step: int | None = Field(default=None, description="empty when the profile had no schedule")
    computing_us: float
    communication_not_overlapped_us: float | None = None
    free_us: float
    stage_us: float | None = None
    preparing_us: float | None = None


class TraceEvent(Record):
    ph: str
    name: str = ""
    pid: int | str | None = None
    tid: int | str | None = None
    ts_us: float | None = None
    dur_us: float | None = None
    cat: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)


class NpuProfileTable(Record):
    """Everything parsed from one profiler output directory. Absent files are None."""

    output_dir: str
    profiler_info: dict[str, Any] | None = None
    kernels: list[KernelRow] | None = None
    operators: list[OperatorRow] | None = None
    op_statistic: list[OpStatisticRow] | None = None
    step_trace: list[StepTraceRow] | None = None
    trace_events: list[TraceEvent] | None = None
    trace_truncated: bool = False


# --- CSV reading --------------------------------------------------------------------------------
# field -> (header aliases, required, kind); kinds: str, float, int, stack
_KERNEL_COLUMNS = {
    "step_id": (("Step Id",), False, "int"),
    "device_id": (("Device_id",), False, "int"),
    "name": (("Name", "Op Name"), True, "str"),
    "type": (("Type", "OP Type"), True, "str"),
    "accelerator_core": (("Accelerator Core", "Task Type"), False, "str"),
    "start_us": (("Start Time(us)", "Task Start Time(us)"), True, "float"),
    "duration_us": (("Duration(us)", "Task Duration(us)"), True, "float"),
    "wait_us": (("Wait Time(us)", "Task Wait Time(us)"), False, "float"),
    "block_num": (("Block Num", "Block Dim"), False, "int"),
    "input_shapes": (("Input Shapes",), False, "str"),
}
_OPERATOR_COLUMNS = {
    "name": (("Name",), True, "str"),
    "input_shapes": (("Input Shapes",), False, "str"),
    "call_stack": (("Call Stack",), False, "stack"),
    "host_self_us": (("Host Self Duration(us)",), True, "float"),
    "host_total_us": (("Host Total Duration(us)",), True, "float"),
    "device_self_us": (("Device Self Duration(us)",), True, "float"),
    "device_total_us": (("Device Total Duration(us)",), True, "float"),
}
_OP_STATISTIC_COLUMNS = {
    "device_id": (("Device_id",), False, "int"),
    "op_type": (("OP Type",), True, "str"),
    "core_type": (("Core Type",), False, "str"),
    "count": (("Count",), True, "int"),
    "total_us": (("Total Time(us)",), True, "float"),
    "avg_us": (("Avg Time(us)",), False, "float"),
}
_STEP_TRACE_COLUMNS = {
    "device_id": (("Device_id",), False, "int"),
    "step": (("Step",), False, "int"),
    "computing_us": (("Computing",), True, "float"),
    "communication_not_overlapped_us": (("Communication(Not Overlapped)",), False, "float"),
    "free_us": (("Free",), True, "float"),
    "stage_us": (("Stage",), False, "float"),
    "preparing_us": (("Preparing",), False, "float"),
}


def _norm(header: str) -> str:
    return re.sub(r"[\s_]+", "", header.replace("\ufeff", "")).lower()


def _number(text: str, kind: str, *, file: Path, column: str, line: int, required: bool) -> float | int | None:
    cell = text.strip()
    if cell == "" or cell.upper() in ("N/A", "NA", "NONE", "NULL"):
        if required:
            raise NpuProfileError("empty cell where a number is required", file=file, column=column, line=line)
        return None
    try:
        value = float(cell)
    except ValueError:
        raise NpuProfileError(f"{cell!r} is not a number", file=file, column=column, line=line) from None
    if not math.isfinite(value):
        raise NpuProfileError(f"{cell!r} is not a finite number", file=file, column=column, line=line)
    if kind == "int":
        if value != int(value):
            raise NpuProfileError(f"{cell!r} is not an integer", file=file, column=column, line=line)
        return int(value)
    return value


def _read_csv(path: Path, columns: dict[str, tuple[tuple[str, ...], bool, str]], row_type: type[Record]) -> list:
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 26))  # deep call stacks make long cells
    with path.open(newline="", encoding="utf-8-sig", errors="replace") as handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if not header:
            raise NpuProfileError("empty file, expected a CSV header", file=path)
        index = {_norm(name): i for i, name in enumerate(header)}
        found: dict[str, tuple[int, str]] = {}
        for field, (aliases, required, _) in columns.items():
            position = next((index[_norm(a)] for a in aliases if _norm(a) in index), None)
            if position is not None:
                found[field] = (position, header[position].strip())
            elif required:
                raise NpuProfileError(
                    f"required column missing (accepted names: {', '.join(aliases)}; header has: {', '.join(h.strip() for h in header)})",
                    file=path, column=aliases[0])
        rows = []
        for line, cells in enumerate(reader, start=2):
            if not any(cell.strip() for cell in cells):
                continue
            values: dict[str, Any] = {}
            for field, (position, column) in found.items():
                _, required, kind = columns[field]
                cell = cells[position] if position < len(cells) else ""
                if kind == "str":
                    values[field] = cell.strip()
                elif kind == "stack":
                    values[field] = parse_call_stack(cell)
                else:
                    value = _number(cell, kind, file=path, column=column, line=line, required=required)
                    if value is not None:
                        values[field] = value
            rows.append(row_type(**values))
        return rows


def parse_call_stack(cell: str) -> list[Frame]:
    """`a.py(3): f;\\r\\nb.py(9): g` -> frames, innermost first; unparsable pieces are skipped."""
    frames = []
    for piece in cell.split(";"):
        match = _FRAME.match(piece.strip())
        if match:
            frames.append(Frame(file=match["file"].strip(), line=int(match["line"]), function=match["function"].strip()))
    return frames


# --- trace_view.json ----------------------------------------------------------------------------
def read_trace_view(path: Path) -> tuple[list[TraceEvent], bool]:
    """All complete events, and whether the array was cut off (a killed parse leaves no ']')."""
    text = path.read_text(encoding="utf-8", errors="replace")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            payload = json.loads(text)
        except json.JSONDecodeError as exc:
            raise NpuProfileError(f"not valid JSON: {exc.msg} at line {exc.lineno}", file=path) from None
        if not isinstance(payload, dict) or not isinstance(payload.get("traceEvents"), list):
            raise NpuProfileError('expected a JSON array of events or an object with "traceEvents"', file=path)
        raw, truncated = payload["traceEvents"], False
    elif stripped.startswith("["):
        raw, truncated = _decode_array(text, text.index("["), path)
    else:
        raise NpuProfileError("not a trace: expected a JSON array of chrome-trace events", file=path)
    return [_trace_event(item, number, path) for number, item in enumerate(raw)], truncated


def _decode_array(text: str, start: int, path: Path) -> tuple[list[Any], bool]:
    decoder, items, pos, end = json.JSONDecoder(), [], start + 1, len(text)
    while True:
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end:
            return items, True
        if text[pos] == "]":
            if text[pos + 1:].strip():
                raise NpuProfileError(f"unexpected data after the closing ']' at character {pos}", file=path)
            return items, False
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as exc:
            if _runs_to_end(text, pos):
                return items, True  # the last record was cut off: keep the complete ones
            line = text.count("\n", 0, exc.pos) + 1
            raise NpuProfileError(f"malformed event (record {len(items)}): {exc.msg}", file=path, line=line) from None
        items.append(item)


def _runs_to_end(text: str, pos: int) -> bool:
    """True when the record starting at `pos` never closes (the file ends inside it)."""
    depth, in_string, escaped = 0, False, False
    for char in text[pos:]:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth <= 0:
                return False
    return True


def _trace_event(item: Any, number: int, path: Path) -> TraceEvent:
    if not isinstance(item, dict) or "ph" not in item:
        raise NpuProfileError(f"event {number} is not a chrome-trace event object with a 'ph' field", file=path)
    values = {"ph": str(item["ph"]), "name": str(item.get("name", "")), "pid": item.get("pid"), "tid": item.get("tid"),
              "cat": item.get("cat"), "args": item.get("args") if isinstance(item.get("args"), dict) else {}}
    for key, field in (("ts", "ts_us"), ("dur", "dur_us")):
        if key in item:
            required = item["ph"] == "X"
            value = _number(str(item[key]), "float", file=path, column=f"event {number} {key}", line=None, required=required)
            values[field] = value
        elif item["ph"] == "X":
            raise NpuProfileError(f"complete event (ph X) without '{key}'", file=path, column=f"event {number} {key}")
    return TraceEvent(**values)


# --- loading ------------------------------------------------------------------------------------
def find_output_dir(path: Path | str) -> Path:
    """Accept the ASCEND_PROFILER_OUTPUT dir, its *_ascend_pt parent, or a dir holding one of those."""
    path = Path(path)
    if not path.is_dir():
        raise NpuProfileError("not a directory: pass the torch_npu profiler output directory", file=path)
    if path.name == OUTPUT_DIR:
        candidates = [path]
    elif (path / OUTPUT_DIR).is_dir():
        candidates = [path / OUTPUT_DIR]
    else:  # a tensorboard_trace_handler dir: one <host>_<pid>_<time>_ascend_pt per rank
        candidates = sorted(p for p in path.glob(f"*/{OUTPUT_DIR}") if p.is_dir())
    if len(candidates) > 1:
        raise NpuProfileError(f"holds {len(candidates)} profiler outputs (one per rank?): pass one of "
                              + ", ".join(str(c.parent) for c in candidates), file=path)
    if not candidates:
        raw = any(path.glob("PROF_*")) or (path / "FRAMEWORK").is_dir()
        hint = (" It has FRAMEWORK/ or PROF_* data but no parsed output: run "
                "torch_npu.profiler.profiler.analyse(<dir>) on the NPU host.") if raw else ""
        raise NpuProfileError(f"not a torch_npu profiler directory: no {OUTPUT_DIR}/ found.{hint}", file=path)
    output = candidates[0]
    if not any((output / name).is_file() for name in KNOWN_FILES):
        raise NpuProfileError(f"no profiler files in it (expected some of {', '.join(KNOWN_FILES)})", file=output)
    return output


def load_npu_profile(path: Path | str) -> NpuProfileTable:
    """Parse every known file once into the table; a missing file is None, a broken one raises."""
    output = find_output_dir(path)

    def csv_or_none(name: str, columns, row_type):
        file = output / name
        return _read_csv(file, columns, row_type) if file.is_file() else None

    events, truncated = read_trace_view(output / "trace_view.json") if (output / "trace_view.json").is_file() else (None, False)
    return NpuProfileTable(
        output_dir=str(output), profiler_info=_profiler_info(output.parent), trace_events=events, trace_truncated=truncated,
        kernels=csv_or_none("kernel_details.csv", _KERNEL_COLUMNS, KernelRow),
        operators=csv_or_none("operator_details.csv", _OPERATOR_COLUMNS, OperatorRow),
        op_statistic=csv_or_none("op_statistic.csv", _OP_STATISTIC_COLUMNS, OpStatisticRow),
        step_trace=csv_or_none("step_trace_time.csv", _STEP_TRACE_COLUMNS, StepTraceRow),
    )


def _profiler_info(run_dir: Path) -> dict[str, Any] | None:
    for file in sorted(run_dir.glob("profiler_info*.json")):
        try:
            info = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise NpuProfileError(f"not valid JSON: {exc}", file=file) from None
        return info if isinstance(info, dict) else None
    return None


# --- analyses (pure functions over the table) ---------------------------------------------------
def step_times_us(table: NpuProfileTable) -> list[float]:
    """Per-step device time from step_trace_time.csv ("Stage", else Computing + comm + Free),
    else the host ProfilerStep#N slices of the trace; rows without a step number are skipped
    when numbered rows exist (no schedule: one row for the whole capture)."""
    if table.step_trace:
        rows = [r for r in table.step_trace if r.step is not None] or table.step_trace
        device = min((r.device_id for r in rows if r.device_id is not None), default=None)
        rows = [r for r in rows if r.device_id == device]
        return [r.stage_us if r.stage_us else r.computing_us + (r.communication_not_overlapped_us or 0.0) + r.free_us
                for r in rows]
    return [e.dur_us for e in _step_events(table)]


def profiled_steps(table: NpuProfileTable) -> int:
    """Steps the capture covers: numbered step_trace rows, Step Ids, ProfilerStep# slices, else 1."""
    if table.step_trace and any(r.step is not None for r in table.step_trace):
        return len({r.step for r in table.step_trace if r.step is not None})
    if table.kernels and any(k.step_id is not None for k in table.kernels):
        return len({k.step_id for k in table.kernels if k.step_id is not None})
    return max(len(_step_events(table)), 1)


def kernels_per_step(table: NpuProfileTable, steps: int | None = None) -> float:
    if table.kernels is None:
        raise NpuProfileError("kernel_details.csv is missing: collect with ProfilerActivity.NPU", file=table.output_dir)
    return len(table.kernels) / (steps or profiled_steps(table))


def device_time_by_op_type(table: NpuProfileTable) -> list[tuple[str, int, float]]:
    """(op type, kernel count, total device us), largest first: op_statistic.csv, else kernels."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    if table.op_statistic:
        for row in table.op_statistic:
            totals[row.op_type][0] += row.count
            totals[row.op_type][1] += row.total_us
    else:
        for kernel in table.kernels or []:
            totals[kernel.type][0] += 1
            totals[kernel.type][1] += kernel.duration_us
    return sorted(((name, int(c), t) for name, (c, t) in totals.items()), key=lambda item: -item[2])


def has_step_numbers(table: NpuProfileTable) -> bool:
    if table.step_trace:
        return any(r.step is not None for r in table.step_trace)
    return bool(_step_events(table))


def _step_events(table: NpuProfileTable) -> list[TraceEvent]:
    return [e for e in table.trace_events or [] if e.ph == "X" and e.name.startswith("ProfilerStep#") and e.dur_us]
