"""Profile the eager training step and attribute every ATen op to the user's source line.

Runs INSIDE the sandbox child, next to the workload's parts (model, optimizer, batch, train_step).

How an op gets its source line and phase:

- A `TorchDispatchMode` sees every op that reaches the dispatcher below autograd (composite ops
  such as `linear` arrive already decomposed into `t` + `addmm`). At each op it walks the Python
  frames to the innermost one inside the repository: that gives the exact line, which
  torch.profiler's function-level frames cannot.
- Library code (tools/library_code.py: transformers, timm, ... under site-packages; PyTorch's own
  files stay transparent) met on the way is kept too: every library frame between the op and its
  repository frame, innermost first (`EagerOp.library_stack`, indexes into the table's
  `library_frames`, each the line and its whole function). So a model built from a library is
  located where its regions are (`LlamaRMSNorm.forward`), beside the user's call site (`model(x)`).
- Forward op -> autograd node: the autograd kernel creates an op's node (and bumps the thread's
  sequence counter) before it redispatches to the mode, so the counter value seen by the mode
  rises exactly at the ops that created nodes: nodes numbered [previous value, current value)
  belong to the current op.
- Backward op -> forward line: during backward `torch._C._current_autograd_node()` is the node
  being evaluated; its `_sequence_nr()` finds the forward op that created it, hence its line.
  Script mode records from one `backward()` to the next (sandbox/script/hooks.py), so a window's
  backward ran nodes of a forward before it: a static program creates the same nodes every step, so
  they are linked to the recorded forward's nodes one step later (`_window_shift`, checked; else
  they stay unlinked).
  AccumulateGrad nodes (and nodes created before profiling) have no forward op: those ops keep the
  line the frame walk gives (the `loss.backward()` call; on a device's autograd thread, the line
  where the main thread waits in backward).
- The gradient seed that `backward()` makes before the engine starts is backward, on that line.
- Optimizer: ops inside `optimizer.step()` (step pre/post hooks), plus ops run with grad mode off
  after the step's backward (gradient clipping, unscaling). Their line is the innermost repo
  frame: the `optimizer.step()` call for torch optimizers, the exact line for one in the repo.
- Everything else is forward.

Per-op time. On the CPU (default `cpu_timer="clock"`) the mode reads a monotonic clock around
the op's call: the op with everything it calls, none of the mode's own work (frame walk,
bookkeeping). With `cpu_timer="profiler"`, or with a device activity (CUDA, ...), each op instead
runs inside a `_RecordFunctionFast` marker named by its launch index under torch.profiler, and the
join is by that index (exact: no order or timestamp matching); the time is the marker's CPU time,
or the device time of the kernels launched inside it. Measured here (torch 2.13, CPU, a 6-op
RMSNorm): plain 14 us, clock 20 us, profiler markers 31 us: the profiler's per-event cost inflates
small ops about 2x, which would bias ranking toward the many-small-op regions fusion targets, so
the clock is the CPU default. Shapes are read from the op's arguments in the mode.

The step time in the result is the median of unprofiled steps timed between `sync()` calls in the
same process, just before recording: recording adds ~20 us per op on this CPU (1.1-1.3x on a
1300-op llama step, ~4x on a 120-op toy step).

Known limits: a node created after its op's kernel returns (CopySlices, when an in-place op
rewrites a view's history) is credited to the next op; ops recomputed in backward by activation
checkpointing are attributed to the checkpoint node's first forward op.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from itertools import count
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field
from torch._C._profiler import _RecordFunctionFast
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from trainbridge.records import LibrarySpan, Phase, Record, SourceSpan, TargetProfile, TargetSpanStats
from trainbridge.tools.library_code import library_path, library_span

MARKER_PREFIX = "trainbridge::op#"
UNATTRIBUTED_FILE = "<unattributed>"  # an op with no frame inside the repository
REQUIRED_PARTS = ("model", "optimizer", "batch", "train_step")
_SKIPPED_NAMESPACES = ("profiler::",)  # record_function bookkeeping ops (optimizers emit them)
_NO_NODE = 2**64 - 1  # sequence number of nodes without a forward op (AccumulateGrad)
CpuTimer = Literal["clock", "profiler"]


class LibraryFrame(Record):
    """One library frame an op ran under: its whole function (`function`, def line to last line) and the line."""

    function: LibrarySpan
    line: int = Field(ge=1)


class EagerOp(Record):
    """One ATen op of one profiled step."""

    step: int = Field(ge=0, description="index among the profiled steps")
    index: int = Field(ge=0, description="launch index within the whole recording")
    name: str = Field(description="ATen op name without overload, e.g. aten::mul")
    phase: Phase
    span: SourceSpan
    time_us: float = Field(ge=0, description="host time (clock) or profiler time, see module doc")
    host_time_us: float = Field(ge=0, description="host wall time of the op call, always measured")
    shapes: str = Field(description="input shapes, profiler style: [[8, 64], [64], []]")
    node: str | None = Field(default=None, description="autograd node evaluated (backward ops)")
    library_stack: list[int] = Field(default_factory=list, description="library frames between the op and `span` "
                                     "(its repository frame), innermost first: indexes into EagerOpTable.library_frames; "
                                     "a backward op has its forward op's")


class EagerOpTable(Record):
    """Every op of the profiled steps, in launch order: the one table analyses run over."""

    backend: str
    device: str
    steps: int = Field(ge=1)
    ops: list[EagerOp]
    step_times_us: list[float] = Field(description="unprofiled steps timed between syncs")
    profiled_step_times_us: list[float] = Field(description="wall time of the recorded steps, recording overhead included")
    profile_wall_s: float = Field(ge=0, description="wall time of the recording, profiler teardown included")
    unlinked_backward_ops: int = Field(ge=0, description="backward ops with no forward op (AccumulateGrad, ...)")
    library_frames: list[LibraryFrame] = Field(default_factory=list, description="the library frames ops ran under")

    def library_of(self, op: EagerOp) -> list[LibraryFrame]:
        """The op's library frames, innermost first (empty for an op of user code only)."""
        return [self.library_frames[i] for i in op.library_stack]


def profile_eager_step(
    parts: dict[str, Any],
    repo_root: Path,
    steps: int = 2,
    warmup: int = 1,
    *,
    sync: Callable[[], None] = lambda: None,
    device_activity: ProfilerActivity | None = None,
    cpu_timer: CpuTimer = "clock",
    backend: str | None = None,
) -> TargetProfile:
    """Profile `steps` training steps after `warmup` and aggregate per (source line, phase)."""
    table = record_eager_ops(parts, repo_root, steps=steps, warmup=warmup, sync=sync,
                             device_activity=device_activity, cpu_timer=cpu_timer, backend=backend)
    return to_target_profile(table)


def record_eager_ops(
    parts: dict[str, Any],
    repo_root: Path,
    steps: int = 2,
    warmup: int = 1,
    *,
    sync: Callable[[], None] = lambda: None,
    device_activity: ProfilerActivity | None = None,
    cpu_timer: CpuTimer = "clock",
    backend: str | None = None,
) -> EagerOpTable:
    """Run `warmup` steps, max(steps, 3) timed unprofiled steps, then `steps` recorded steps (each
    batch drawn fresh from `batch(step)`); return every recorded op with its line, phase and time."""
    missing = [key for key in REQUIRED_PARTS if key not in parts]
    if missing:
        raise ValueError(f"workload parts lack {', '.join(missing)}; the entry must return {', '.join(REQUIRED_PARTS)}")
    if cpu_timer not in ("clock", "profiler"):
        raise ValueError(f"cpu_timer must be 'clock' or 'profiler', not {cpu_timer!r}")
    if steps < 1 or warmup < 0:
        raise ValueError(f"need steps >= 1 and warmup >= 0 (got steps={steps}, warmup={warmup})")
    root = Path(repo_root).resolve()
    if not root.is_dir():
        raise ValueError(f"repo_root {root} is not a directory: pass the root of the repository under test")
    model, optimizer, batch, train_step = parts["model"], parts["optimizer"], parts["batch"], parts["train_step"]
    device = _device_of(model)
    step_number = count()

    def run_step() -> float:
        data = batch(next(step_number))
        sync()
        started = time.perf_counter()
        train_step(model, optimizer, data)
        sync()
        return (time.perf_counter() - started) * 1e6

    for _ in range(warmup):
        run_step()
    step_times = [run_step() for _ in range(max(steps, 3))]

    use_profiler = device_activity is not None or cpu_timer == "profiler"
    recorder = _OpRecorder(_Locator(root), optimizer, markers=use_profiler)
    activities = [ProfilerActivity.CPU] + ([device_activity] if device_activity is not None else [])
    profiled_times: list[float] = []
    started = time.perf_counter()
    with recorder.optimizer_hooks(), (profile(activities=activities) if use_profiler else nullcontext()) as prof:
        for profiled_step in range(steps):
            data = batch(next(step_number))
            sync()
            step_started = time.perf_counter()
            recorder.begin_step(profiled_step)
            with recorder:
                train_step(model, optimizer, data)
            sync()
            profiled_times.append((time.perf_counter() - step_started) * 1e6)
    times = _marker_times(prof, use_device=device_activity is not None) if use_profiler else None
    wall = time.perf_counter() - started
    ops = recorder.finish(times)
    return EagerOpTable(
        backend=backend or device.type, device=str(device), steps=steps, ops=ops,
        step_times_us=step_times, profiled_step_times_us=profiled_times, profile_wall_s=wall,
        unlinked_backward_ops=recorder.unlinked_backward, library_frames=recorder.locator.library_frames,
    )


class BoundaryRecorder:
    """Records the eager ops of steps whose boundaries the caller decides, for programs that run their own
    loop (script mode: sandbox/script/hooks.py starts and stops it at optimizer-step boundaries). Every
    optimizer's step counts as the optimizer phase (PyTorch's global optimizer-step hooks)."""

    def __init__(self, repo_root: Path):
        root = Path(repo_root).resolve()
        if not root.is_dir():
            raise ValueError(f"repo_root {root} is not a directory: pass the root of the repository under test")
        self._recorder = _OpRecorder(_Locator(root), None, markers=False)
        self._handles: list[Any] = []
        self._started_at: float | None = None
        self._wall_started: float | None = None
        self.profiled_step_times_us: list[float] = []
        self.steps = 0

    @property
    def started(self) -> bool:
        """Whether a step was recorded (`start` ran)."""
        return self._wall_started is not None

    def hook(self) -> None:
        """Register the global optimizer-step hooks that mark the optimizer phase (once; `start` does it when not done):
        a caller whose boundaries fall inside an optimizer-step hook registers them before, since PyTorch iterates the
        hooks while it calls them."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        if not self._handles:
            self._handles = [register_optimizer_step_pre_hook(self._recorder._enter_step),
                             register_optimizer_step_post_hook(self._recorder._leave_step)]

    def start(self) -> None:
        """At a step boundary: record from here (a step already being recorded ends first)."""
        if self._started_at is not None:
            self.stop()
        self.hook()
        if self._wall_started is None:
            self._wall_started = time.perf_counter()
        self._recorder.begin_step(self.steps)
        self._recorder.__enter__()
        self._started_at = time.perf_counter()

    def stop(self) -> None:
        """At the next step boundary: the step recorded since `start` ends here."""
        if self._started_at is None:
            return
        self._recorder.__exit__(None, None, None)
        self.profiled_step_times_us.append((time.perf_counter() - self._started_at) * 1e6)
        self._started_at = None
        self.steps += 1

    def table(self, *, backend: str, device: str, step_times_us: list[float]) -> EagerOpTable:
        """The recorded steps as an EagerOpTable (`step_times_us`: unprofiled steps the caller timed)."""
        self.stop()
        for handle in self._handles:
            handle.remove()
        wall = time.perf_counter() - self._wall_started if self._wall_started is not None else 0.0
        ops = self._recorder.finish(None)
        return EagerOpTable(backend=backend, device=device, steps=max(self.steps, 1), ops=ops, step_times_us=step_times_us,
                            profiled_step_times_us=self.profiled_step_times_us, profile_wall_s=wall,
                            unlinked_backward_ops=self._recorder.unlinked_backward,
                            library_frames=self._recorder.locator.library_frames)


def to_target_profile(table: EagerOpTable) -> TargetProfile:
    """Aggregate the op table per (span, phase), in order of first launch."""
    groups: dict[tuple[tuple, Phase], list[EagerOp]] = {}
    for op in table.ops:  # SourceSpan is not hashable: group on its fields
        groups.setdefault((_span_tuple(op.span), op.phase), []).append(op)
    stats = []
    for (_, phase), ops in groups.items():
        span = ops[0].span
        first_step = min(op.step for op in ops)
        first = [op for op in ops if op.step == first_step]
        stats.append(TargetSpanStats(
            span=span, phase=phase,
            op_names=[op.name for op in first],
            ops_per_step=len(ops) / table.steps,
            self_time_us_per_step=sum(op.time_us for op in ops) / table.steps,
            shapes=[op.shapes for op in first],
        ))
    return TargetProfile(
        backend=table.backend, device=table.device, steps_profiled=table.steps,
        step_time_us=statistics.median(table.step_times_us),
        total_ops_per_step=len(table.ops) / table.steps, spans=stats,
    )


def ops_per_step_by_step(table: EagerOpTable) -> list[int]:
    """How many ops each profiled step launched (equal across steps for a static program)."""
    counts = [0] * table.steps
    for op in table.ops:
        counts[op.step] += 1
    return counts


def _span_tuple(span: SourceSpan) -> tuple[str, int, int, str | None]:
    return (span.file, span.line_start, span.line_end, span.function)


def _device_of(model: Any) -> torch.device:
    for tensor in list(model.parameters()) + list(model.buffers()):
        return tensor.device
    return torch.device("cpu")


class _Locator:
    """Finds the innermost Python frame inside the repository, and the library frames on the way (both cached per
    code object and line)."""

    def __init__(self, root: Path):
        self.root = root
        self._prefix = str(root) + os.sep
        excluded = {Path(torch.__file__).resolve().parent, Path(__file__).resolve()}
        self._excluded = tuple(str(path) for path in excluded)
        self._cache: dict[Any, tuple[str, str] | LibrarySpan | None] = {}
        self._spans: dict[tuple[Any, int], SourceSpan] = {}  # one shared span per (code, line)
        self._frames: dict[tuple[Any, int], int] = {}  # (code, line) -> index into library_frames
        self.library_frames: list[LibraryFrame] = []
        self._backward_entries = {torch.autograd.backward.__code__, torch.autograd.grad.__code__}

    def _classify(self, code: Any) -> tuple[str, str] | LibrarySpan | None:
        """(repo-relative path, qualname) for repository code, the function's LibrarySpan for library code, None
        for code ops pass through (PyTorch, TrainBridge, the standard library)."""
        filename = code.co_filename
        if filename.startswith("<"):
            return None
        path = os.path.realpath(filename)
        if path.startswith(self._excluded):
            return None
        qualname = getattr(code, "co_qualname", code.co_name)
        rel = library_path(path)
        if rel is not None:  # a library, also when installed in a virtualenv inside the repository
            last = max((line for _, _, line in code.co_lines() if line is not None), default=code.co_firstlineno)
            return library_span(rel, code.co_firstlineno, last, qualname)
        if not path.startswith(self._prefix):
            return None
        rel_path = Path(path).relative_to(self.root)
        if {"site-packages", "dist-packages"} & set(rel_path.parts):
            return None  # a transparent package (torch) in a virtualenv inside the repository
        return rel_path.as_posix(), qualname

    def locate(self, frame: Any) -> SourceSpan | None:
        return self.locate_with_entry(frame)[0]

    def locate_with_entry(self, frame: Any) -> tuple[SourceSpan | None, bool, tuple[int, ...]]:
        """The innermost repo span, whether the walk crossed `torch.autograd.backward`/`grad` (the gradient
        seed is made there, before the engine runs any node), and the library frames met before the repo frame
        (indexes into `library_frames`, innermost first)."""
        cache, entries, in_backward_call = self._cache, self._backward_entries, False
        library: list[int] = []
        while frame is not None:
            code = frame.f_code
            in_backward_call = in_backward_call or code in entries
            if code in cache:
                found = cache[code]
            else:
                found = cache[code] = self._classify(code)
            if found is not None:
                key = (code, frame.f_lineno)
                if isinstance(found, LibrarySpan):
                    index = self._frames.get(key)
                    if index is None:
                        index = self._frames[key] = len(self.library_frames)
                        self.library_frames.append(LibraryFrame(function=found, line=frame.f_lineno))
                    library.append(index)
                else:
                    span = self._spans.get(key)
                    if span is None:
                        line = frame.f_lineno
                        span = self._spans[key] = SourceSpan(file=found[0], line_start=line, line_end=line, function=found[1])
                    return span, in_backward_call, tuple(library)
            frame = frame.f_back
        return None, in_backward_call, tuple(library)


class _PendingOp:
    __slots__ = ("step", "index", "name", "phase", "span", "shapes", "node", "node_seq", "host_ns", "library")

    def __init__(self, step, index, name, phase, span, shapes, node, node_seq, library):
        self.step, self.index, self.name, self.phase = step, index, name, phase
        self.span, self.shapes, self.node, self.node_seq = span, shapes, node, node_seq
        self.host_ns, self.library = 0, library


class _OpRecorder(TorchDispatchMode):
    """Records each op's name, shapes, phase, source line and autograd link; wraps it in a marker."""

    def __init__(self, locator: _Locator, optimizer: Any, markers: bool):
        super().__init__()
        self.locator = locator
        self.markers = markers
        self.optimizer = optimizer
        self.pending: list[_PendingOp] = []
        self.node_owner: dict[int, int] = {}  # autograd sequence number -> index of the forward op
        self.unlinked_backward = 0
        self._counter = count()
        self._step = 0
        self._seq_seen: dict[int, int] = {}  # thread -> sequence counter at its last forward op
        self._in_step = False
        self._backward_seen = False
        self._main_thread = threading.get_ident()
        self._unattributed = SourceSpan(file=UNATTRIBUTED_FILE, line_start=1, line_end=1)

    # --- phases ------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self._step = step
        self._backward_seen = False
        self._seq_seen = {threading.get_ident(): torch._C._autograd._get_sequence_nr()}

    def optimizer_hooks(self):
        recorder = self

        class _Hooks:
            def __enter__(self):
                self.handles = []
                if hasattr(recorder.optimizer, "register_step_pre_hook"):
                    self.handles.append(recorder.optimizer.register_step_pre_hook(recorder._enter_step))
                    self.handles.append(recorder.optimizer.register_step_post_hook(recorder._leave_step))
                return self

            def __exit__(self, *exc):
                for handle in self.handles:
                    handle.remove()
                return False

        return _Hooks()

    def _enter_step(self, *args: Any) -> None:
        self._in_step = True

    def _leave_step(self, *args: Any) -> None:
        self._in_step = False

    # --- the mode ----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name.startswith(_SKIPPED_NAMESPACES):
            return func(*args, **kwargs)
        index = next(self._counter)
        node = torch._C._current_autograd_node()
        span, in_backward_call, library = self.locator.locate_with_entry(sys._getframe(1))
        node_name = node_seq = None
        if node is not None:
            phase = Phase.backward
            self._backward_seen = True
            node_name, node_seq = node.name(), node._sequence_nr()
            if span is None and threading.get_ident() != self._main_thread:
                span = self._main_thread_span()
        else:
            thread = threading.get_ident()
            seq = torch._C._autograd._get_sequence_nr()
            for created in range(self._seq_seen.get(thread, seq), seq):
                self.node_owner[created] = index
            self._seq_seen[thread] = seq
            if in_backward_call:
                phase = Phase.backward  # the gradient seed (ones_like) made by backward() itself
            elif self._in_step or (self._backward_seen and not torch.is_grad_enabled()):
                phase = Phase.optimizer
            else:
                phase = Phase.forward
        pending = _PendingOp(self._step, index, name, phase, span, _shapes(args), node_name, node_seq, library)
        self.pending.append(pending)
        if self.markers:
            with _RecordFunctionFast(MARKER_PREFIX + str(index)):
                started = time.perf_counter_ns()
                out = func(*args, **kwargs)
                pending.host_ns = time.perf_counter_ns() - started
        else:
            started = time.perf_counter_ns()
            out = func(*args, **kwargs)
            pending.host_ns = time.perf_counter_ns() - started
        return out

    def _main_thread_span(self) -> SourceSpan | None:
        frame = sys._current_frames().get(self._main_thread)
        return self.locator.locate(frame)

    # --- results -----------------------------------------------------------------------------
    def finish(self, times: dict[int, float] | None) -> list[EagerOp]:
        """Resolve backward links; `times` (marker index -> us) replaces the clock when given."""
        by_index = {op.index: op for op in self.pending}
        shift = self._window_shift(by_index)
        ops = []
        for op in sorted(self.pending, key=lambda o: o.index):
            span, library = op.span, op.library
            if op.phase is Phase.backward:
                owner = self.node_owner.get(op.node_seq) if op.node_seq not in (None, _NO_NODE) else None
                if owner is None and shift and op.node_seq not in (None, _NO_NODE):
                    owner = self.node_owner.get(op.node_seq + shift[1]) if op.step == shift[0] else None
                if owner is not None and (by_index[owner].span is not None or by_index[owner].library):
                    span, library = by_index[owner].span or span, by_index[owner].library
                elif op.node is not None:
                    self.unlinked_backward += 1
            ops.append(EagerOp(
                step=op.step, index=op.index, name=op.name, phase=op.phase,
                span=span or self._unattributed,
                time_us=op.host_ns / 1e3 if times is None else times.get(op.index, 0.0),
                host_time_us=op.host_ns / 1e3, shapes=_format_shapes(op.shapes), node=op.node,
                library_stack=list(library),
            ))
        return ops


    def _window_shift(self, by_index: dict[int, _PendingOp]) -> tuple[int, int] | None:
        """(step, D) when a step's backward ran nodes whose forward was not recorded and the same step's recorded
        forward repeats them D sequence numbers later, else None.

        Script mode records from one `backward()` to the next: the window holds backward(k), the optimizer step
        and forward(k+1). A static program creates the same nodes in the same order every step, so node i of
        forward(k+1) is node i of forward(k) plus D. D is accepted only when the first and the last node agree on
        it and it links at least 90% of those backward ops: the ops then get the lines (and library frames) of
        the same code one step later."""
        unlinked = [op for op in self.pending if op.phase is Phase.backward and op.node_seq not in (None, _NO_NODE)
                    and op.node_seq not in self.node_owner]
        if not unlinked:
            return None
        step = unlinked[0].step
        seqs = {op.node_seq for op in unlinked if op.step == step}
        created = [seq for seq, owner in self.node_owner.items() if by_index[owner].step == step and seq > max(seqs)]
        if not created:
            return None
        shift = max(created) - max(seqs)
        if min(created) - min(seqs) != shift:
            return None
        linked = sum(1 for seq in seqs if seq + shift in self.node_owner)
        return (step, shift) if linked >= 0.9 * len(seqs) else None


def _shapes(args: Sequence[Any]) -> tuple:
    """Input shapes, kept as tuples in the hot path; `_format_shapes` renders them later."""
    shapes: list[Any] = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            shapes.append(arg.shape)
        elif isinstance(arg, (list, tuple)) and arg and all(isinstance(a, torch.Tensor) for a in arg):
            shapes.append([a.shape for a in arg])
        else:
            shapes.append(())
    return tuple(shapes)


def _format_shapes(shapes: tuple) -> str:
    """Profiler style: `[[16, 64], [64], []]`; a tensor-list argument becomes a list of shapes."""
    return str([[list(s) for s in arg] if isinstance(arg, list) else list(arg) for arg in shapes])


def _marker_times(prof: profile, use_device: bool) -> dict[int, float]:
    """Marker index -> microseconds (CPU time of the op, or device time of its kernels)."""
    times: dict[int, float] = {}
    start = len(MARKER_PREFIX)
    for event in prof.events():
        name = event.name
        if name.startswith(MARKER_PREFIX):
            times[int(name[start:])] = event.device_time_total if use_device else event.cpu_time_total
    return times
