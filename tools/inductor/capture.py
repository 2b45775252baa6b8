"""Capture Inductor's evidence of one training step. Runs inside the sandbox child process.

`capture_inductor_evidence(parts, out_dir)` compiles the workload's model with torch.compile
(Inductor) under a debug trace, runs a few training steps through the workload's own
`train_step`, and writes into `out_dir`:

- `debug/`: Inductor's debug trace (per forward/backward graph: `fx_graph_readable.py`,
  `fx_graph_transformed.py`, `ir_pre_fusion.txt`, `ir_post_fusion.txt`, `output_code.py`,
  provenance JSON);
- `kernel_stack_traces.json`: per compiled graph, every generated or library kernel call
  (`name:handle`) with the Python stacks (file:line) of the FX nodes it covers and those nodes'
  names, snapshotted while each graph is generated (Inductor resets this table per graph);
- `dynamo.json`: graph breaks and recompilations with their reasons, Dynamo's counters;
- `eager_op_counts.json`: ATen ops one eager step dispatches, per phase (for "N eager ops vs K
  compiled kernels");
- `trace.json`: a torch.profiler Chrome trace of the last compiled step (steps >= 2);
- `manifest.json`: versions, device, time, steps, what files.

Caches are off (a warm fx-graph or autograd cache generates no code and leaves the provenance
empty, silently). The first step pays the cold compile; its wall time is in the manifest.
Every torch import is inside a function: importing this module has no side effects.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import platform
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

from trainbridge.tools.eager_op_counts import count_eager_step_ops
from trainbridge.tools.inductor.parser import (
    DEBUG_DIR,
    DYNAMO_FILE,
    EAGER_COUNTS_FILE,
    EVIDENCE_FORMAT,
    KERNEL_MAP_FILE,
    MANIFEST_FILE,
    TRACE_FILE,
)

REQUIRED_PARTS = ("model", "optimizer", "batch", "train_step")
_AOT_ID = re.compile(r"^# AOT ID: \['([^']+)'\]", re.MULTILINE)
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+)")
_KEPT_TRACE_EVENTS = ("dynamo_graph_break_reason", "recompile_reasons", "compilation_metrics")
_MAX_PAYLOAD = 8000


class CaptureError(RuntimeError):
    """The workload's parts or the output folder cannot be used for a capture."""


def capture_inductor_evidence(
    parts: dict,
    out_dir: Path,
    steps: int = 2,
    *,
    chrome_trace: bool = True,
    count_eager_ops: bool = True,
    repo_root: Path | None = None,
    timed_steps: int = 0,
) -> Path:
    """Compile `parts["model"]` with Inductor, run `steps` training steps, write the evidence.

    parts: {"model", "optimizer", "batch", "loss_fn", "train_step"}; `train_step(model,
    optimizer, batch)` is the whole step, `batch(i)` the i-th batch. Returns `out_dir`.
    The model's parameters are trained by these steps (and by one more eager step when
    `count_eager_ops`): capture on a throwaway copy of the workload. `timed_steps` more compiled
    steps, outside the profiler, give the manifest's `compiled_step_s` (their median): the speed of
    the torch.compile reference on this machine.
    """
    import torch

    _check_parts(parts)
    if steps < 1:
        raise CaptureError(f"steps must be >= 1 (got {steps}): the first step compiles the graphs")
    session = EvidenceSession(out_dir)
    model, optimizer, batch, train_step = (parts[k] for k in REQUIRED_PARTS)
    step_wall_s: list[float] = []
    losses: list[float | None] = []
    trace_step = steps - 1 if chrome_trace and steps >= 2 else None
    if chrome_trace and trace_step is None:
        session.notes.append("no Chrome trace: it needs steps >= 2 (the first step compiles)")

    with session:
        compiled = torch.compile(model, backend="inductor")
        for i in range(steps):
            b = batch(i)
            profiler = _profiler(model) if i == trace_step else contextlib.nullcontext()
            t0 = time.perf_counter()
            with profiler as prof:
                loss = train_step(compiled, optimizer, b)
                losses.append(_as_float(loss))  # .item() syncs the device
            step_wall_s.append(time.perf_counter() - t0)
            if i == trace_step:
                prof.export_chrome_trace(str(session.out_dir / TRACE_FILE))
        timed_wall_s = _timed_steps(compiled, optimizer, batch, train_step, first=steps, count=timed_steps)

    if count_eager_ops:
        session.write_json(EAGER_COUNTS_FILE, count_eager_step_ops(parts, step=steps))
    return session.write(device=_describe_device(model), repo_root=repo_root, steps=steps, trace_step=trace_step,
                         step_wall_s=step_wall_s, cold_compile_step_s=step_wall_s[0], timed_wall_s=timed_wall_s, losses=losses)


class EvidenceSession:
    """Inductor's evidence capture, open from `__enter__` to `__exit__`: Dynamo reset, the graph caches off,
    the debug trace and provenance on, each graph's kernel -> stack table and Dynamo's graph-break, recompile
    and compile events recorded. Entry mode holds it around its own steps; script mode, which does not own
    the loop, from before the script runs to its closing result (sandbox/script/capture.py). `write` then
    writes the kernel map, the Dynamo summary and the manifest."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        if self.out_dir.exists() and any(self.out_dir.iterdir()):
            raise CaptureError(f"{self.out_dir} is not empty: give each capture a fresh folder, "
                               "stale debug folders would mix with the new ones")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.notes: list[str] = []
        self.recorder, self.events = _GraphRecorder(), _TraceEventRecorder()
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> "EvidenceSession":
        import torch
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        for context in (_evidence_config(self.out_dir / DEBUG_DIR), self.recorder.installed(), self.events.installed()):
            self._stack.enter_context(context)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._stack.close()

    def write_json(self, name: str, data: Any) -> None:
        """One more evidence file (before `write`, which lists the folder's files in the manifest)."""
        _write_json(self.out_dir / name, data)

    def write(self, *, device: dict[str, Any], repo_root: Path | None, steps: int, trace_step: int | None,
              step_wall_s: list[float], cold_compile_step_s: float | None, timed_wall_s: list[float],
              losses: list[float | None], **more: Any) -> Path:
        """The kernel map, the Dynamo summary and the manifest (`more`: extra manifest fields); returns the folder."""
        import torch
        from torch._dynamo.utils import counters

        out_dir, graphs = self.out_dir, self.recorder.graphs
        if not graphs:
            self.notes.append("Inductor generated no code: nothing was compiled (check graph breaks)")
        elif not any(g["kernels"] for g in graphs):
            self.notes.append("provenance tracking returned no kernels: kernel->source mapping unavailable")
        _write_json(out_dir / KERNEL_MAP_FILE, {"format": EVIDENCE_FORMAT, "graphs": graphs})
        _write_json(out_dir / DYNAMO_FILE, _dynamo_summary(counters, self.events.events))
        manifest = {
            "format": EVIDENCE_FORMAT,
            "kind": "inductor-evidence",
            "torch": torch.__version__,
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "device": device,
            "time_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "repo_root": str(Path(repo_root).resolve()) if repo_root else None,
            "steps": steps,
            "trace_step": trace_step,
            "step_wall_s": [round(s, 4) for s in step_wall_s],
            "cold_compile_step_s": round(cold_compile_step_s, 3) if cold_compile_step_s is not None else None,
            "compiled_step_wall_s": [round(x, 5) for x in timed_wall_s],
            "compiled_step_s": round(statistics.median(timed_wall_s), 5) if timed_wall_s else None,
            "losses": losses,
            "graphs": [g["aot_id"] for g in graphs],
            **more,
            "notes": self.notes,
        }
        manifest["files"] = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if p.is_file())
        manifest["files"].append(MANIFEST_FILE)
        _write_json(out_dir / MANIFEST_FILE, manifest)
        return out_dir


def _timed_steps(compiled, optimizer, batch, train_step, *, first: int, count: int) -> list[float]:
    """Wall time of `count` more compiled steps (batches first, first+1, ...), each ended by `.item()`."""
    times = []
    for i in range(first, first + count):
        data = batch(i)  # made before the clock starts, like the harness's measured steps
        t0 = time.perf_counter()
        _as_float(train_step(compiled, optimizer, data))
        times.append(time.perf_counter() - t0)
    return times


def _check_parts(parts: dict) -> None:
    if not isinstance(parts, dict):
        raise CaptureError(f"parts must be a dict with keys {REQUIRED_PARTS}, got {type(parts).__name__}")
    missing = [k for k in REQUIRED_PARTS if k not in parts]
    if missing:
        raise CaptureError(f"parts is missing {missing}: the workload entry must return "
                           f"model, optimizer, batch, loss_fn and train_step")
    for k in ("batch", "train_step"):
        if not callable(parts[k]):
            raise CaptureError(f"parts[{k!r}] must be callable")


@contextlib.contextmanager
def _evidence_config(debug_dir: Path) -> Iterator[None]:
    """Debug trace + provenance on, CPU kernels visible to the profiler, the FX-graph and AOT-autograd caches off: a
    hit there skips the lowering whose trace and kernel -> stack tables are the evidence. The compiled-kernel cache
    stays on (a kernel's binary is keyed by its generated source, so a hit changes no evidence): a side that
    captures again (the analyst after each accepted rewrite) compiles only the kernels it has not built before (the
    tiny Llama's reference: 26 s warm instead of 79 s cold here)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    patch = {
        "trace.enabled": True,
        "trace.debug_dir": str(debug_dir),
        "trace.provenance_tracking_level": 1,
        "fx_graph_cache": False,
        "fx_graph_remote_cache": False,
        "cpp.enable_kernel_profile": True,
    }
    with inductor_config.patch(patch), functorch_config.patch(enable_autograd_cache=False):
        yield


class _GraphRecorder:
    """Snapshots Inductor's kernel -> stack-trace table as each graph's code is generated.

    Hooked on `GraphLowering.save_output_code`, which Inductor calls once per graph after
    code generation, while the per-graph provenance tables are filled and before they reset.
    """

    def __init__(self) -> None:
        self.graphs: list[dict[str, Any]] = []
        self._previous: Callable[[str], None] | None = None

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from torch._inductor.graph import GraphLowering

        self._previous = GraphLowering.save_output_code
        GraphLowering.save_output_code = self
        try:
            yield
        finally:
            GraphLowering.save_output_code = self._previous

    def __call__(self, code: str) -> None:
        try:
            self.graphs.append(self._snapshot(code))
        finally:
            if self._previous is not None:
                self._previous(code)

    def _snapshot(self, code: str) -> dict[str, Any]:
        from torch._inductor import debug as inductor_debug
        from torch._inductor.virtualized import V

        stacks = dict(inductor_debug._inductor_kernel_stack_trace)
        nodes = dict(inductor_debug._inductor_triton_kernel_to_post_grad_node_info)
        handles = _HANDLE.findall(code)
        if handles:  # keep this graph's kernels only, in call order
            keys = list(dict.fromkeys(handles))
        else:
            keys = list(dict.fromkeys([*stacks, *nodes]))
        match = _AOT_ID.search(code)
        try:
            graph = V.graph
            is_backward = bool(graph.is_backward)
        except AttributeError:  # no graph handler set: unknown phase
            graph, is_backward = None, None
        original, order = _original_aten(graph)
        kernels = {}
        for k in keys:
            post = list(nodes.get(k, []))
            ops = [original[n] for n in sorted(post, key=lambda n: order.get(n, len(order))) if n in original]
            kernels[k] = {"stack_traces": list(stacks.get(k, [])), "post_grad_nodes": post,
                          "original_aten": list(dict.fromkeys(ops))}
        return {
            "aot_id": match.group(1) if match else f"graph_{len(self.graphs)}",
            "is_backward": is_backward,
            "kernels": kernels,
        }


def _original_aten(graph: Any) -> tuple[dict[str, str], dict[str, int]]:
    """Post-grad node name -> the ATen op it came from before decomposition (as Inductor's
    `Original ATen` comments print it), and each node's position in the graph."""
    import torch

    module = getattr(graph, "module", None)
    fx_graph = getattr(module, "graph", None)
    if fx_graph is None:
        return {}, {}
    original: dict[str, str] = {}
    order: dict[str, int] = {}
    for i, node in enumerate(fx_graph.nodes):
        order[node.name] = i
        op = node.meta.get("original_aten")
        if isinstance(op, torch._ops.OpOverload):
            original[node.name] = str(op._overloadpacket)
        elif isinstance(op, torch._ops.HigherOrderOperator):
            original[node.name] = str(op.name())
    return original, order


class _TraceEventRecorder(logging.Handler):
    """Keeps Dynamo's structured-trace events about graph breaks, recompiles and compile metrics."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.events: list[dict[str, Any]] = []

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        trace_log = logging.getLogger("torch.__trace")
        old_level = trace_log.level
        trace_log.addHandler(self)
        trace_log.setLevel(logging.DEBUG)
        try:
            yield
        finally:
            trace_log.removeHandler(self)
            trace_log.setLevel(old_level)

    def emit(self, record: logging.LogRecord) -> None:
        metadata = getattr(record, "metadata", None)
        if not isinstance(metadata, dict):
            return
        name = _event_name(metadata)
        if name is None:
            return
        payload = getattr(record, "payload", None)
        self.events.append({
            "event": name,
            "frame_id": metadata.get("frame_id"),
            "frame_compile_id": metadata.get("frame_compile_id"),
            "metadata": _jsonable(metadata.get("compilation_metrics")) if name == "compilation_metrics" else None,
            "payload": payload[:_MAX_PAYLOAD] if isinstance(payload, str) else None,
        })


def _event_name(metadata: dict) -> str | None:
    artifact = metadata.get("artifact")
    if isinstance(artifact, dict) and artifact.get("name") in _KEPT_TRACE_EVENTS:
        return artifact["name"]
    if "compilation_metrics" in metadata:
        return "compilation_metrics"
    return None


def _dynamo_summary(counters: Any, events: list[dict[str, Any]]) -> dict[str, Any]:
    graph_breaks = [  # Dynamo's own traceback after the user's is noise here
        {"frame_id": e["frame_id"], "frame_compile_id": e["frame_compile_id"],
         "text": (e["payload"] or "").split("\nTraceback (most recent call last):")[0].rstrip()}
        for e in events if e["event"] == "dynamo_graph_break_reason"
    ]
    recompiles = [
        {"frame_id": e["frame_id"], "frame_compile_id": e["frame_compile_id"], "reasons": e["payload"] or ""}
        for e in events if e["event"] == "recompile_reasons"
    ]
    keys = ("co_name", "co_filename", "co_firstlineno", "graph_op_count", "graph_node_count",
            "fail_type", "fail_reason", "restart_reasons", "entire_frame_compile_time_s")
    compiles = []
    for e in events:
        if e["event"] == "compilation_metrics" and isinstance(e["metadata"], dict):
            compiles.append({"frame_id": e["frame_id"], "frame_compile_id": e["frame_compile_id"],
                             **{k: e["metadata"].get(k) for k in keys}})
    return {
        "graph_break_counts": dict(counters.get("graph_break", Counter())),
        "graph_breaks": graph_breaks,
        "recompiles": recompiles,
        "compiles": compiles,
        "counters": {k: dict(v) for k, v in counters.items() if k in ("stats", "frames", "aot_autograd", "inductor")},
    }


def _profiler(model: Any):
    return step_profiler(_model_device(model))


def step_profiler(device: Any):
    """The torch.profiler of the traced compiled step: the CPU, and the device's own activity where it has one."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    extra = getattr(ProfilerActivity, device.type.upper(), None) if device is not None else None
    if extra is not None and extra not in activities:
        activities.append(extra)
    return profile(activities=activities)


def _model_device(model: Any):
    try:
        return next(model.parameters()).device
    except (StopIteration, AttributeError, TypeError):
        return None


def _describe_device(model: Any) -> dict[str, Any]:
    return describe_device(_model_device(model))


def describe_device(device: Any) -> dict[str, Any]:
    """The manifest's device record of a torch.device (None: the CPU)."""
    import torch

    if device is None or device.type == "cpu":
        return {"type": "cpu", "name": platform.processor() or platform.machine(),
                "threads": torch.get_num_threads()}
    module = torch.get_device_module(device.type)
    name = module.get_device_name(device.index or 0) if hasattr(module, "get_device_name") else None
    return {"type": device.type, "index": device.index, "name": name}


def _as_float(loss: Any) -> float | None:
    try:
        return float(loss.detach().float().item()) if hasattr(loss, "detach") else float(loss)
    except (TypeError, ValueError, RuntimeError):
        return None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str)) if value is not None else None


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
