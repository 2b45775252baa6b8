"""The torch.compile reference of an unmodified script (harness mode "capture" in script mode; runs INSIDE the child).

Entry mode owns its loop and compiles `parts["model"]` (tools/inductor/capture.py); a script owns
its own loop, so the capture follows its step windows instead (a window runs from one step boundary
to the next: sandbox/script/hooks.py). The plan (`capture_plan`, parent side) numbers them:

- windows before `count_at`: eager, the op counter's forward hooks installed (the backward the next
  window runs belongs to a forward seen here);
- window `count_at`: eager, its ATen ops counted per phase (`eager_op_counts.json`);
- from window `compile_at`: the modules whose parameters the optimizers hold are compiled in place
  (sandbox/script_hooks.compile_trained_modules). A script that compiles its model itself (its
  `--compile` flag) keeps its own compile: nothing more is compiled, and its step is not eager,
  so no eager counts are written (the manifest says so);
- windows `compile_at` .. `trace_at - 1`: the cold compile (forward graphs at the next forward,
  backward graphs at the next backward); window `trace_at`: traced by torch.profiler;
- the `timed` windows after it: the compiled step's speed (`compiled_step_s`).

Inductor's evidence session (debug trace, graph caches off, kernel -> stack tables, Dynamo's graph breaks
and recompiles) is open from before the script runs to the closing result, so graphs the script
compiles itself are captured as well as ours.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

COUNT_AT, COMPILE_AT = 1, 2


def capture_plan(steps: int, timed: int):
    """The step windows of a script-mode capture (see the module doc), and what the launcher is told about them.
    `steps`: compiled windows up to and including the traced one (at least 2: forward and backward compile)."""
    from trainbridge.sandbox.child.driven import StepPlan

    trace_at = COMPILE_AT + max(steps, 2)
    plan = StepPlan(warmup=list(range(COMPILE_AT)), measured=list(range(COMPILE_AT, trace_at + 1)),
                    cooldown=list(range(trace_at + 1, trace_at + 1 + max(timed, 0))))
    return plan, {"count_at": COUNT_AT, "compile_at": COMPILE_AT, "trace_at": trace_at, "timed": max(timed, 0)}


class ScriptCapture:
    """Follows the controller's step windows (`window_started(i)`, `window_ended(i, seconds, loss)`) and writes the
    evidence folder at `finish()`."""

    def __init__(self, out_dir: Path, windows: dict[str, int], repo_root: Path):
        from trainbridge.tools.inductor.capture import EvidenceSession

        self.windows, self.repo_root = windows, repo_root
        self.session = EvidenceSession(out_dir)
        self.counter: Any = None
        self.counts: dict[str, Any] | None = None
        self.profiler: Any = None
        self.script_compiled = False
        self.compiled: list[str] = []
        self.times: dict[int, float] = {}
        self.losses: dict[int, float] = {}
        self.device: Any = None

    def begin(self) -> "ScriptCapture":
        """Before the script runs: every compile from here on is captured."""
        self.session.__enter__()
        return self

    def first_boundary(self) -> None:
        """The script's first backward: its model and optimizers exist. A model it compiled itself is honoured."""
        from trainbridge.sandbox.script.hooks import live_optimizers, tracked_params, trained_root_modules

        params = tracked_params()
        self.device = params[0][1].device if params else None
        roots = trained_root_modules()
        self.script_compiled = bool(self.session.recorder.graphs) or any(hasattr(m, "_orig_mod") for m in roots)
        if self.script_compiled:
            self.session.notes.append("the script compiles its model itself (torch.compile in the script): its own compile "
                                      "is the reference; no eager op counts (its step is not eager)")
            return
        from trainbridge.tools.eager_op_counts import OpCounter

        self.counter = OpCounter(roots, live_optimizers()).install()

    def window_started(self, index: int) -> None:
        if self.counter is not None and index == self.windows["count_at"]:
            self.counter.start()
        if index == self.windows["compile_at"]:
            if self.counter is not None:
                self.counter.remove()
                self.counter = None
            if not self.script_compiled:
                from trainbridge.sandbox.script.hooks import compile_trained_modules

                self.compiled = compile_trained_modules()
        if index == self.windows["trace_at"]:
            from trainbridge.tools.inductor.capture import step_profiler

            self.profiler = step_profiler(self.device)
            self.profiler.__enter__()

    def window_ended(self, index: int, seconds: float, loss: float) -> None:
        """Called at the boundary that ends window `index`, after the device sync."""
        self.times[index], self.losses[index] = seconds, loss
        if self.counter is not None and index == self.windows["count_at"]:
            self.counter.stop()
            self.counts = self.counter.report(step=index)
        if self.profiler is not None and index == self.windows["trace_at"]:
            from trainbridge.tools.inductor.parser import TRACE_FILE

            profiler, self.profiler = self.profiler, None
            profiler.__exit__(None, None, None)
            profiler.export_chrome_trace(str(self.session.out_dir / TRACE_FILE))

    def finish(self) -> dict[str, Any]:
        """Close the session and write the evidence; the closing result's extra (`evidence_dir`, what was compiled)."""
        from trainbridge.tools.inductor.capture import describe_device
        from trainbridge.tools.inductor.parser import EAGER_COUNTS_FILE

        if self.counter is not None:
            self.counter.stop()
            self.counter.remove()
        if self.profiler is not None:
            self.profiler.__exit__(None, None, None)
        self.session.__exit__(None, None, None)
        compile_at, trace_at = self.windows["compile_at"], self.windows["trace_at"]
        if self.counts is not None:
            self.session.write_json(EAGER_COUNTS_FILE, self.counts)
        timed = [self.times[i] for i in range(trace_at + 1, trace_at + 1 + self.windows["timed"]) if i in self.times]
        captured = [self.times[i] for i in range(compile_at, trace_at + 1) if i in self.times]
        # the script's own compile ran before its first step boundary: no window holds the cold compile
        cold = sum(self.times[i] for i in range(compile_at, trace_at) if i in self.times) if captured and not self.script_compiled else None
        losses = [self.losses[i] if not math.isnan(self.losses[i]) else None for i in sorted(self.losses)]
        out_dir = self.session.write(device=describe_device(self.device), repo_root=self.repo_root, steps=trace_at - compile_at + 1,
                                     trace_step=trace_at if (self.session.out_dir / "trace.json").is_file() else None,
                                     step_wall_s=captured, cold_compile_step_s=cold, timed_wall_s=timed, losses=losses,
                                     mode="script", compiled_modules=self.compiled, script_compiled=self.script_compiled,
                                     windows=self.windows)
        return {"evidence_dir": str(out_dir), "compiled_modules": self.compiled, "script_compiled": self.script_compiled}
