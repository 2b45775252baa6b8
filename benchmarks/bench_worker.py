"""A persistent benchmark worker: builds one workload variant once, then times steps on command.

Runs inside a sandboxed child (launched by `speedup.Worker` with the sandbox's scrubbed environment,
memory cap, own process group and, where the host allows, no network):

    python -P benchmarks/bench_worker.py REQUEST.json

The request (deleted before any workload code runs, as the step harness does) names the workload
root, entry, seed, threads, whether to `torch.compile` the model and how many warm-up steps to
run. The model is compiled the way the analyst's reference capture compiles it
(`torch.compile(model, backend="inductor")`, default mode, the workload's own `train_step` around
it). Then the worker answers one JSON line per command on its stdin:

    {"cmd": "run", "steps": 8, "warmup": 1}  ->  {"step_times_s": [...], "losses": [...], "graphs": 3}
    {"cmd": "exit"}                          ->  (exits)

Replies go to the original stdout only; anything the workload prints lands on stderr, so user
output can never corrupt the protocol. Timing is the harness's own `run_steps` (device
synchronised around each step).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO


def _protocol_out() -> TextIO:
    """Keep a private copy of stdout for replies and point fd 1 at stderr for everything else."""
    out = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)
    return out


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0))


def build(request: dict[str, Any]) -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Seed, import the entry, optionally compile the model, run the warm-up; returns (parts, backend, ready reply)."""
    import torch

    from trainbridge.sandbox.backends import Backend
    from trainbridge.sandbox.harness import load_parts, run_steps, seed_everything, versions

    backend = Backend(request["backend"])
    torch.set_num_threads(int(request["threads"]))
    root = Path(request["root"])
    for extra in request.get("pythonpath", []):
        sys.path.insert(0, str(root / extra))
    started = time.perf_counter()
    backend.prepare()
    seed_everything(int(request["seed"]))
    parts = load_parts(root, request["entry"], backend.device, int(request["seed"]))
    if request.get("compile"):
        torch._dynamo.reset()
        parts = {**parts, "model": torch.compile(parts["model"], backend="inductor")}
    build_s = time.perf_counter() - started
    record: dict[str, list[float]] = {"warmup_times_s": [], "step_times_s": [], "losses": []}
    run_steps(parts, backend, int(request["warmup_steps"]), 0, lambda event: None, record)
    ready = {"ready": True, "build_s": build_s, "warmup_times_s": record["warmup_times_s"],
             "graphs": _compiled_graphs() if request.get("compile") else 0, "versions": versions()}
    return parts, backend, ready


def serve(parts: dict[str, Any], backend, commands: TextIO, out: TextIO, compiled: bool) -> None:
    from trainbridge.sandbox.harness import run_steps

    for line in commands:
        command = json.loads(line)
        if command.get("cmd") == "exit":
            return
        if command.get("cmd") != "run":
            raise ValueError(f"unknown worker command {command!r}")
        record: dict[str, list[float]] = {"warmup_times_s": [], "step_times_s": [], "losses": []}
        run_steps(parts, backend, int(command.get("warmup", 0)), int(command["steps"]), lambda event: None, record)
        reply = {"step_times_s": record["step_times_s"], "losses": record["losses"],
                 "graphs": _compiled_graphs() if compiled else 0}
        out.write(json.dumps(reply) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -P benchmarks/bench_worker.py REQUEST.json (started by benchmarks/speedup.py)", file=sys.stderr)
        return 2
    out = _protocol_out()
    request_path = Path(argv[0])
    request = json.loads(request_path.read_text(encoding="utf-8"))
    request_path.unlink()  # the workload runs in this process: it must not read what it is asked
    try:
        parts, backend, ready = build(request)
        out.write(json.dumps(ready) + "\n")
        serve(parts, backend, sys.stdin, out, bool(request.get("compile")))
    except BaseException as exc:  # the workload's own failure: report it on the protocol, then exit
        import traceback

        tail = "".join(traceback.format_exception(exc))[-4000:]
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback_tail": tail}) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
