"""A Chrome trace (torch.profiler's) -> kernel times attached to the FusionGroups whose names match,
window by window of each compiled graph's call."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainbridge.records import FusionGroup
from trainbridge.tools.inductor.format import EvidenceFormatError
from trainbridge.tools.inductor.output_code import KernelCall


@dataclass(frozen=True)
class TraceEvent:
    name: str
    cat: str
    ts: float
    dur: float
    pid: Any
    tid: Any
    correlation: int | None = None


def parse_chrome_trace(source: Path | str | dict | list) -> list[TraceEvent]:
    """Complete ('X') events of a torch.profiler Chrome trace (CPU or CUDA), sorted by start time."""
    data = source
    if isinstance(source, (str, Path)):
        try:
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EvidenceFormatError(f"{source}: not a Chrome trace JSON ({exc})") from exc
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise EvidenceFormatError("not a Chrome trace: expected a list of events or {'traceEvents': [...]}")
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "name" not in e:
            continue
        args = e.get("args") or {}
        corr = args.get("correlation")
        out.append(TraceEvent(str(e["name"]), str(e.get("cat", "")), float(e.get("ts", 0)), float(e.get("dur", 0)),
                              e.get("pid"), e.get("tid"), int(corr) if isinstance(corr, (int, float)) else None))
    return sorted(out, key=lambda ev: ev.ts)


@dataclass
class GraphCalls:
    """A graph's kernel calls with the groups they produced (same order)."""

    label: str
    calls: list[KernelCall]
    groups: list[FusionGroup]


def per_graph_calls(per_graph: list[tuple[Any, list[FusionGroup]]]) -> list[GraphCalls]:
    return [GraphCalls(g.label, g.code.calls, groups) for g, groups in per_graph]


CALL_WINDOW = "## Call CompiledFxGraph"
_PROFILE_PREFIX = re.compile(r"^graph_\d+_")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace_key(call: KernelCall) -> str:
    if call.extern:
        return "aten::" + call.name.split(".")[-1] if call.name.startswith("extern_kernels.") \
            else "aten::" + call.name.split(".", 1)[1]
    return call.name


@dataclass
class TraceMatch:
    timed_groups: int = 0
    windows: int = 0
    unmatched_windows: int = 0
    ambiguous_windows: int = 0  # matched several graphs equally well: given to the latest compiled


def attach_trace_times(graphs: list[GraphCalls], events: list[TraceEvent]) -> TraceMatch:
    """Set `time_us` (per execution of the graph) on groups whose kernels the trace shows.

    Each `## Call CompiledFxGraph` window of the trace is matched to the graph whose kernel
    sequence it shows; inside it, the i-th event of a kernel name is that kernel's i-th call.
    CPU kernels appear as `graph_N_<kernel>` (Inductor's cpp kernel profile); device kernels
    (cat 'kernel') are placed in the window of their launch by correlation id; library calls are
    the window's outermost `aten::<op>` events, timed on the device when they launched kernels.
    Windows that match several graphs equally well (recompiled variants with the same kernels)
    go to the graph compiled last (graphs are ordered by compile order).
    """
    result = TraceMatch()
    windows = [e for e in events if e.name.startswith(CALL_WINDOW)]
    result.windows = len(windows)
    if not windows:
        return result
    launches = {e.correlation: e for e in events if e.correlation is not None and e.cat not in _DEVICE_CATS}
    device = [e for e in events if e.cat in _DEVICE_CATS]
    wanted = {_trace_key(c) for g in graphs for c in g.calls}
    totals: dict[tuple[int, int], float] = defaultdict(float)
    executions: Counter = Counter()
    for w in windows:
        seq = _window_sequence(w, events, device, launches, wanted)
        if not seq:
            continue
        gi, ambiguous = _best_graph(graphs, [name for name, _ in seq])
        if gi is None:
            result.unmatched_windows += 1
            continue
        result.ambiguous_windows += ambiguous
        executions[gi] += 1
        positions: dict[str, list[int]] = defaultdict(list)
        for ci, c in enumerate(graphs[gi].calls):
            positions[_trace_key(c)].append(ci)
        seen: Counter = Counter()
        for name, dur in seq:
            slots = positions.get(name, [])
            if seen[name] < len(slots):
                totals[(gi, slots[seen[name]])] += dur
            seen[name] += 1
    for (gi, ci), total in totals.items():
        graphs[gi].groups[ci].time_us = round(total / executions[gi], 3)
    result.timed_groups = len(totals)
    return result


def _inside(e: TraceEvent, w: TraceEvent) -> bool:
    return w.ts <= e.ts and e.ts + e.dur <= w.ts + w.dur and e is not w


def _window_sequence(w: TraceEvent, events: list[TraceEvent], device: list[TraceEvent],
                     launches: dict[int, TraceEvent], wanted: set[str]) -> list[tuple[str, float]]:
    host = [e for e in events if e.cat not in _DEVICE_CATS and _inside(e, w)]
    seq: list[tuple[float, str, float]] = []
    externs = [e for e in host if e.name.startswith("aten::") and e.name in wanted]
    outer = [e for e in externs if not any(o is not e and _inside(e, o) and o.name.startswith("aten::") for o in externs)]
    dev_by_launch: dict[int, list[TraceEvent]] = defaultdict(list)
    for d in device:
        launch = launches.get(d.correlation) if d.correlation is not None else None
        if launch is not None and _inside(launch, w):
            dev_by_launch[id(launch)].append(d)
            name = _PROFILE_PREFIX.sub("", d.name)
            if name in wanted:
                seq.append((launch.ts, name, d.dur))
    on_device = {name for _, name, _ in seq}  # a Triton launch also shows on the host: time it on the device
    for e in host:
        name = _PROFILE_PREFIX.sub("", e.name)
        if name in wanted and not name.startswith("aten::") and name not in on_device:
            seq.append((e.ts, name, e.dur))
    for e in outer:
        launched = [d for h in host if h.ts >= e.ts and h.ts + h.dur <= e.ts + e.dur for d in dev_by_launch.get(id(h), [])]
        seq.append((e.ts, e.name, sum(d.dur for d in launched) if launched else e.dur))
    return [(name, dur) for _, name, dur in sorted(seq, key=lambda t: t[0])]


def _best_graph(graphs: list[GraphCalls], names: list[str]) -> tuple[int | None, bool]:
    """The graph whose kernel multiset is closest to the window's; ties go to the later graph."""
    best, best_score, tied = None, 0.0, False
    have = Counter(names)
    for gi, g in enumerate(graphs):
        expect = Counter(_trace_key(c) for c in g.calls)
        common = sum((have & expect).values())
        score = common / max(sum(have.values()), sum(expect.values()), 1)
        if score > 0 and score >= best_score:
            tied = score == best_score
            best, best_score = gi, score
    return (best, tied) if best_score >= 0.5 else (None, False)
