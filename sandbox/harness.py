"""The step harness: runs inside the sandbox child (`python -m trainbridge.sandbox.harness REQUEST`).

It lives outside the repository under test. Two ways in:

- ``--channel R,W`` (timed runs: modes "measure" and "gate"): the request and then one command at a
  time arrive over a pipe from the parent, which times every step with its own clock
  (sandbox/child/step_server.py, sandbox/child/step_driver.py); the child's own clock is only a cross-check.
  Nothing on the command line, in the environment or in files tells a gate child which round it
  is in.
- ``REQUEST.json [MODE]`` (analysis modes: profile, capture, numerics, npu_profile): reads a JSON
  request file, runs the mode, writes a JSON result atomically; progress (one line per finished
  step) goes to a side file so the parent knows how far a killed run got.

Both seed everything and import the workload's entry first.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import random
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

CHANNEL_MODES = ("measure", "gate")  # timed runs: the parent drives and times them (execute_channel)
REQUIRED_PARTS = ("model", "optimizer", "batch", "loss_fn", "train_step")
_OOM_MARKERS = ("out of memory", "not enough memory", "can't allocate memory", "cannot allocate memory")
TRACEBACK_TAIL_CHARS = 4000


class HarnessFailure(Exception):
    def __init__(self, kind: str, message: str, *, step: int | None = None, exc: BaseException | None = None):
        super().__init__(message)
        self.kind, self.message, self.step, self.exc = kind, message, step, exc


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def load_parts(root: Path, entry: str, device: str, seed: int) -> dict[str, Any]:
    """Import `module:function` from the repo and call it; validate the parts it returns."""
    module_name, function_name = entry.split(":")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # SyntaxError, ImportError, or anything the module raises on import
        raise HarnessFailure("import_error", f"importing {module_name!r} failed: {type(exc).__name__}: {exc}", exc=exc) from exc
    function = getattr(module, function_name, None)
    if not callable(function):
        raise HarnessFailure("bad_workload", f"{module_name}.{function_name} is not defined or not callable")
    parts = function(device=device, seed=seed)
    if not isinstance(parts, dict):
        raise HarnessFailure("bad_workload", f"{entry} returned {type(parts).__name__}, expected a dict with keys {', '.join(REQUIRED_PARTS)}")
    missing = [key for key in REQUIRED_PARTS if key not in parts]
    if missing:
        raise HarnessFailure("bad_workload", f"{entry} returned no {', '.join(missing)} (needs {', '.join(REQUIRED_PARTS)})")
    not_callable = [key for key in ("batch", "loss_fn", "train_step") if not callable(parts[key])]
    if not_callable:
        raise HarnessFailure("bad_workload", f"{entry}: {', '.join(not_callable)} must be callable")
    return parts


def loss_value(loss: Any) -> float:
    if hasattr(loss, "detach"):
        return float(loss.detach().float().cpu().item())
    return float(loss)


def run_steps(parts: dict[str, Any], backend, warmup: int, steps: int, progress: Callable[[dict], None], record: dict[str, list[float]]) -> None:
    """Warm-up then measured steps timed on this process's own clock (benchmarks/bench_worker.py's trusted programs;
    the gate and `trainbridge measure` are timed by the parent instead), each between device synchronisations, appended to `record`
    as they finish (so a failure part-way keeps what was measured)."""
    model, optimizer, batch, train_step = parts["model"], parts["optimizer"], parts["batch"], parts["train_step"]
    warmup_times, step_times, losses = record["warmup_times_s"], record["step_times_s"], record["losses"]
    for step in range(warmup + steps):
        data = batch(step)
        backend.sync()
        started = time.perf_counter()
        loss = train_step(model, optimizer, data)
        backend.sync()
        elapsed = time.perf_counter() - started
        value = loss_value(loss)
        losses.append(value)
        (warmup_times if step < warmup else step_times).append(elapsed)
        progress({"step": step, "time_s": elapsed, "loss": value})
        if not math.isfinite(value):
            raise HarnessFailure("nonfinite_loss", f"step {step} returned a non-finite loss ({value})", step=step)


def run_mode(mode: str, parts: dict[str, Any], backend, request: dict[str, Any], progress, result: dict[str, Any]) -> None:
    """profile: every eager op of the step with its source line (EagerOpTable);
    capture: the step under torch.compile with Inductor's debug output written to evidence_dir;
    numerics: the gate's probe; npu_profile: torch_npu.profiler output in profile_dir, parsed (real NPU)."""
    warmup, steps = int(request["warmup_steps"]), int(request["steps"])
    if mode in CHANNEL_MODES:
        raise HarnessFailure("bad_workload", f"harness mode {mode!r} runs over the control channel (--channel), timed by the parent")
    if mode == "profile":
        from trainbridge.tools.eager_profile import record_eager_ops

        table = record_eager_ops(parts, Path(request["root"]), steps=steps, warmup=warmup, sync=backend.sync, backend=backend.name)
        result.setdefault("extra", {})["eager_ops"] = table.model_dump(mode="json")
        result["extra"]["optimizer_class"] = type(parts["optimizer"]).__name__
    elif mode == "capture":
        from trainbridge.tools.inductor.capture import capture_inductor_evidence

        out_dir = capture_inductor_evidence(parts, Path(request["evidence_dir"]), steps=max(steps, 2), repo_root=Path(request["root"]),
                                            timed_steps=int(request.get("timed_steps", 0)))
        result.setdefault("extra", {})["evidence_dir"] = str(out_dir)
    elif mode == "numerics":
        from trainbridge.sandbox.numerics_probe import run_numerics

        result.setdefault("extra", {})["numerics"] = run_numerics(parts, backend, request)
    elif mode == "npu_profile":
        from trainbridge.tools.npu_profile.capture import profile_npu_step

        capture = profile_npu_step(parts, Path(request["profile_dir"]), Path(request["root"]), steps=steps, warmup=warmup,
                                   attribution=bool(request.get("attribution", False)), sync=backend.sync)
        result.setdefault("extra", {})["npu_profile"] = capture.model_dump(mode="json")
    else:
        raise HarnessFailure("bad_workload", f"unknown harness mode {mode!r}")


def versions() -> dict[str, str]:
    import platform

    import torch

    found = {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}
    if "torch_npu" in sys.modules:
        npu = sys.modules["torch_npu"]
        emulated = bool(getattr(npu, "__trainbridge_emulated__", False))
        found["torch_npu"] = getattr(npu, "__version__", "?") + (" (emulated)" if emulated else "")
        found["torch_npu_mode"] = "emulated" if emulated else "real"
        try:
            from trainbridge.sandbox.backends import npu_compile_status

            found["torch_npu_compile"] = npu_compile_status(npu).cause
        except Exception as exc:  # a report, never a reason to fail the run
            found["torch_npu_compile"] = f"unknown ({type(exc).__name__})"
    return found


def classify(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or any(marker in text for marker in _OOM_MARKERS):
        return "oom"
    return "exception"


def _failure(kind: str, message: str, exc: BaseException | None, step: int | None) -> dict[str, Any]:
    tail = None
    if exc is not None:
        tail = "".join(traceback.format_exception(exc))[-TRACEBACK_TAIL_CHARS:]
    return {
        "kind": kind,
        "message": message[:2000],
        "exception_type": type(exc).__name__ if exc is not None else None,
        "traceback_tail": tail,
        "step": step,
    }


def _prepare_device(backend) -> None:
    try:
        backend.prepare()
    except BaseException as exc:
        raise HarnessFailure("import_error", f"importing the {backend.name} device plugin failed: {type(exc).__name__}: {exc}",
                             exc=exc) from exc


def write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload), encoding="utf-8")
    os.replace(tmp, path)


def execute(request: dict[str, Any]) -> dict[str, Any]:
    """Run one request; never raises: failures come back in the result."""
    from trainbridge.sandbox.backends import Backend

    import torch

    backend = Backend(request["backend"])
    torch.set_num_threads(int(request["threads"]))
    root = Path(request["root"])
    for extra in request.get("pythonpath", []):
        sys.path.insert(0, str(root / extra))
    progress_path = Path(request["progress_path"])
    last_step: list[int] = []

    def progress(event: dict) -> None:
        last_step.append(event["step"])
        with progress_path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(event) + "\n")

    result: dict[str, Any] = {"versions": {}, "failure": None, "warmup_times_s": [], "step_times_s": [], "losses": []}
    try:
        _prepare_device(backend)  # NPU: import torch_npu before anything seeds or builds a model
        seed_everything(int(request["seed"]))
        parts = load_parts(root, request["entry"], backend.device, int(request["seed"]))
        backend.reset_peak_memory()
        run_mode(request.get("mode", "measure"), parts, backend, request, progress, result)
    except HarnessFailure as failure:
        result["failure"] = _failure(failure.kind, failure.message, failure.exc, failure.step)
    except BaseException as exc:  # the workload's own error: classify, keep the traceback tail
        step = last_step[-1] + 1 if last_step else None
        result["failure"] = _failure(classify(exc), f"{type(exc).__name__}: {exc}", exc, step)
    try:
        result["peak_memory_bytes"] = backend.peak_memory_bytes()
        result["versions"] = versions()
    except Exception as exc:  # reporting must not hide the run's own outcome
        result.setdefault("notes", []).append(f"could not read memory/versions: {exc}")
    return result


def execute_channel(channel) -> None:
    """Serve one timed run over the control channel (see the module doc); never raises for the
    workload's faults: the last message is always {"op": "result", ...}."""
    from trainbridge.sandbox.backends import Backend
    from trainbridge.sandbox.guard import Guard
    from trainbridge.sandbox.child.step_server import StepServer
    from trainbridge.sandbox.random_alignment import align as align_random

    request = channel.recv()
    result: dict[str, Any] = {"op": "result", "versions": {}, "failure": None}
    server = guard = None
    try:
        import torch

        backend = Backend(request["backend"])
        torch.set_num_threads(int(request["threads"]))
        root = Path(request["root"])
        for extra in request.get("pythonpath", []):
            sys.path.insert(0, str(root / extra))
        _prepare_device(backend)
        if request.get("mode") == "gate":
            align_random()  # compiled random ops draw eager's numbers on both sides (sandbox/random_alignment.py)
        guard = Guard().capture()  # before the workload's code runs: what it replaces shows in the result
        seed_everything(int(request["seed"]))
        parts = load_parts(root, request["entry"], backend.device, int(request["seed"]))
        if request.get("compile"):
            parts = {**parts, "model": torch.compile(parts["model"])}
        backend.reset_peak_memory()
        seed_everything(int(request["seed"]))  # a batch drawn from the global RNG must not depend on the build
        server = StepServer(channel, parts, backend)
        channel.send({"op": "ready"})
        server.serve()
        result["peak_memory_bytes"] = backend.peak_memory_bytes()
        result["threads_in_use"] = torch.get_num_threads()
    except HarnessFailure as failure:
        result["failure"] = _failure(failure.kind, failure.message, failure.exc, failure.step)
    except BaseException as exc:  # the workload's own error: classify, keep the traceback tail
        result["failure"] = _failure(classify(exc), f"{type(exc).__name__}: {exc}", exc, server.steps_done if server else None)
    try:
        result["versions"] = versions()
        result["replaced"] = guard.replaced() if guard is not None else []
    except Exception as exc:  # reporting must not hide the run's own outcome
        result.setdefault("notes", []).append(f"could not read versions or the guard: {exc}")
    channel.send(result)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "--channel":
        from trainbridge.sandbox.child.channel import Channel

        read_fd, write_fd = (int(fd) for fd in argv[1].split(","))
        execute_channel(Channel(read_fd, write_fd))
        return 0
    if len(argv) not in (1, 2):
        print("usage: python -m trainbridge.sandbox.harness REQUEST.json [MODE]  (MODE only labels the process)\n"
              "       python -m trainbridge.sandbox.harness --channel READ_FD,WRITE_FD", file=sys.stderr)
        return 2
    request_path = Path(argv[0])
    request = json.loads(request_path.read_text(encoding="utf-8"))
    request_path.unlink()  # the workload runs in this process: it must not learn what the gate asked for
    result = execute(request)
    write_json_atomic(Path(request["result_path"]), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
