"""Run a workload in a confined child process and return a typed `RunResult`.

A crashed, hung or memory-hungry workload never takes TrainBridge down: the child runs in its own
process group (killed as a whole on timeout), under an address-space cap, with a scrubbed
environment and, where the host allows, no network.

Script-mode runs (`launch = "python train.py ..."`) are driven the same way, by the launcher of
sandbox/script/launcher.py (sandbox/script/run.py prepares them).

Timed entry-mode runs (modes "measure" and "gate") are driven step by step over a control channel
and timed on this process's clock (sandbox/child/step_driver.py); analysis modes exchange a request and a
result file with the harness.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.child import fork_server, signal_filter
from trainbridge.sandbox.script import run as script_run
from trainbridge.sandbox.backends import Backend, npu_selection
from trainbridge.sandbox.command_mode import parse_command_output
from trainbridge.sandbox.confinement import Sandbox, cache_dir, child_sandbox
from trainbridge.sandbox.confinement import wanted as confinement_wanted
from trainbridge.sandbox.isolation import default_memory_limit_mb, limit_memory, network_isolation, scrubbed_env
from trainbridge.sandbox.npu_emulation import selection_env
from trainbridge.sandbox.results import Failure, FailureKind, RunResult
from trainbridge.sandbox.scratch import scratch_dir
from trainbridge.sandbox.child.step_driver import ChildSpec, DriveOutcome, StepPlan, drive, drive_pair
from trainbridge.sandbox.workload import Workload

ProgressCallback = Callable[[int, int], None]  # (steps done, steps total)
TAIL_CHARS = 4000
POLL_S = 0.2


def run_workload(
    workload: Workload,
    *,
    backend: str = "cpu",
    mode: str = "measure",
    extra_request: dict[str, Any] | None = None,
    extra_env: dict[str, str] | None = None,
    on_progress: ProgressCallback | None = None,
    work_dir: Path | None = None,
    plan: StepPlan | None = None,
) -> RunResult:
    """Run `workload` (its root may be a git worktree) in the sandbox; never raises for workload faults.
    Modes "measure" and "gate" follow `plan` (default: the configured warm-up and steps on batches
    0, 1, 2, ..., then one cool-down step); "gate" needs a plan."""
    config = workload.config
    target = Backend(backend)
    memory_limit_mb = config.memory_limit_mb or default_memory_limit_mb()
    env = _child_env(config, target, extra_env)
    total = config.warmup_steps + config.steps
    with scratch_dir("trainbridge-run-", work_dir) as tmp_dir:
        if config.mode == "script":
            return _run_script(workload, target, mode, plan, env, memory_limit_mb, tmp_dir, extra_request, on_progress)
        if config.mode == "entry" and mode in CHANNEL_MODES:
            spec, base = _channel_child(workload, target, mode, plan, extra_request, env, memory_limit_mb, tmp_dir)
            started = time.monotonic()
            steps_total = len(spec.plan.timed())
            outcome = drive(spec, on_progress=(lambda done: on_progress(min(done, total), total)) if on_progress else None)
            base.wall_s = time.monotonic() - started
            return _driven_result(_with_tails(base, tmp_dir), outcome, config.timeout_s, steps_total)
        if config.mode == "entry":
            request = {
                "mode": mode,
                "root": str(workload.root),
                "entry": config.entry,
                "pythonpath": config.pythonpath,
                "backend": target.name,
                "seed": config.seed,
                "threads": config.threads,
                "warmup_steps": config.warmup_steps,
                "steps": config.steps,
                "progress_path": str(tmp_dir / "progress.jsonl"),
                "result_path": str(tmp_dir / "result.json"),
                **(extra_request or {}),
            }
            (tmp_dir / "request.json").write_text(json.dumps(request), encoding="utf-8")
            # the mode is repeated in argv only as a label (`ps` shows what a child is doing): the request is
            # deleted by the harness before user code runs
            argv = [sys.executable, "-m", "trainbridge.sandbox.harness", str(tmp_dir / "request.json"), mode]
        else:
            argv = shlex.split(config.command or "")
            if argv and argv[0] in ("python", "python3"):
                argv[0] = sys.executable  # the interpreter TrainBridge runs under, with the same packages
        box = child_sandbox(tmp_dir, root=workload.root, backend=target.name, evidence=request_outputs(extra_request))
        base = _base_result(config, target, box, memory_limit_mb)
        started = time.monotonic()
        outcome = _run_child(
            [*box.prefix, *argv],
            cwd=workload.root,
            env={**env, **box.env},
            memory_limit_mb=memory_limit_mb,
            timeout_s=config.timeout_s,
            tmp_dir=tmp_dir,
            on_progress=(lambda done: on_progress(done, total)) if on_progress else None,
        )
        base.wall_s = time.monotonic() - started
        base.stdout_tail, base.stderr_tail = outcome.stdout[-TAIL_CHARS:], outcome.stderr[-TAIL_CHARS:]
        if config.mode == "command":
            return _command_result(base, outcome, workload)
        return _entry_result(base, outcome, tmp_dir, config.timeout_s)


CHANNEL_MODES = ("measure", "gate")


def run_workload_pair(
    workloads: tuple[Workload, Workload],
    plans: tuple[StepPlan, StepPlan],
    *,
    backend: str = "cpu",
    extra_env: dict[str, str] | None = None,
    orphans_to: int = 1,
    work_dir: Path | None = None,
) -> tuple[RunResult, RunResult]:
    """Two gate children alive at once, their timed steps alternated (sandbox/child/step_driver.py,
    `drive_pair`); `workloads[0]` leads. Never raises for the workloads' faults: when one child's
    fault ends the pair, the other's result is a failure marked `interrupted`."""
    target = Backend(backend)
    modes = {workload.config.mode for workload in workloads}
    if modes not in ({"entry"}, {"script"}):
        raise ValueError(f"paired gate runs need two entry-mode or two script-mode workloads, got {' and '.join(sorted(modes))}")
    with scratch_dir("trainbridge-run-a-", work_dir) as dir_a, scratch_dir("trainbridge-run-b-", work_dir) as dir_b:
        built = []
        for workload, plan, tmp_dir in zip(workloads, plans, (dir_a, dir_b)):
            config = workload.config
            memory_limit_mb = config.memory_limit_mb or default_memory_limit_mb()
            env = _child_env(config, target, extra_env)
            if config.mode == "script":
                child = _script_child(workload, target, "gate", plan, None, env, memory_limit_mb, tmp_dir)
                if isinstance(child, RunResult):  # it cannot start: the pair is not run at all
                    partner = workloads[1 if not built else 0].config
                    other = _base_result(partner, target, _not_started(), partner.memory_limit_mb or default_memory_limit_mb())
                    other.failure = Failure(kind=FailureKind.crashed, message="the other side of the pair could not be started")
                    other.interrupted = "the other side of the pair could not be started"
                    return (child, other) if not built else (other, child)
                built.append(child)
            else:
                built.append((*_channel_child(workload, target, "gate", plan, None, env, memory_limit_mb, tmp_dir), None))
        started = time.monotonic()
        outcomes = drive_pair(built[0][0], built[1][0], orphans_to=orphans_to)
        wall = time.monotonic() - started
        results = []
        for (spec, base, setup), outcome, tmp_dir, workload in zip(built, outcomes, (dir_a, dir_b), workloads):
            base.wall_s = wall
            result = _driven_result(_with_tails(base, tmp_dir), outcome, workload.config.timeout_s, len(spec.plan.timed()))
            if setup is not None:
                result = script_run.finish(result, setup, outcome.result, workload.config.timeout_s)
            results.append(result)
        return results[0], results[1]


OUTPUT_KEYS = ("evidence_dir", "profile_dir")  # request entries naming a folder the child writes its outputs to


def request_outputs(extra_request: dict[str, Any] | None) -> list[Path]:
    """The folders a child's request asks it to write to (the compile reference's evidence, an NPU profile, the
    numerics probe's gradient file's folder), made now: a confined child may write there (sandbox/confinement.py)."""
    request = extra_request or {}
    folders = [Path(request[key]) for key in OUTPUT_KEYS if request.get(key)]
    grads = (request.get("numerics") or {}).get("grads_path")
    folders += [Path(grads).parent] if grads else []
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
    return folders


def child_env(config, backend: str, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a child of a workload with `config` gets on `backend` (a fork server serves the
    children whose environment is its own: sandbox/child/fork_server.py)."""
    return _child_env(config, Backend(backend), extra_env)


def _child_env(config, target: Backend, extra_env: dict[str, str] | None) -> dict[str, str]:
    env = scrubbed_env({**target.child_env(), **(extra_env or {})}, threads=config.threads, seed=config.seed)
    if target.name == "npu":  # the real torch_npu when usable, else the CPU stand-in first on the child's path
        env = selection_env(npu_selection(), env)
    return env


def _channel_child(workload: Workload, target: Backend, mode: str, plan: StepPlan | None, extra_request: dict[str, Any] | None,
                   env: dict[str, str], memory_limit_mb: int, tmp_dir: Path) -> tuple[ChildSpec, RunResult]:
    """How to start one parent-timed child, and the result record its outcome will fill. Inside a gate the child is
    forked from a warm server (network isolated as the server is) instead of exec'd under bubblewrap."""
    config = workload.config
    if plan is None and mode == "gate":
        raise ValueError("mode 'gate' needs a StepPlan (its batch indices, probe and parameter deltas)")
    plan = plan or StepPlan.sequential(config.warmup_steps, config.steps)
    request = {"mode": mode, "root": str(workload.root), "entry": config.entry, "pythonpath": config.pythonpath,
               "backend": target.name, "seed": config.seed, "threads": config.threads, **(extra_request or {})}
    pool = fork_server.active()
    # exec'd (outside a gate, or where the pool cannot fork it) under bubblewrap; forked, confined by itself to the same
    # writable folders (the record says which it was once it started: `_fork_confinement`)
    box = child_sandbox(tmp_dir, root=workload.root, backend=target.name, evidence=plan.evidence_dirs())
    writable = forked_writable(tmp_dir, workload.root, plan.evidence_dirs())
    base = _base_result(config, target, box, memory_limit_mb)
    base.warmup_steps = len(plan.warmup)
    # argv is the same for every timed child: what it is asked comes over the channel only
    spec = ChildSpec(argv=[*box.prefix, sys.executable, "-m", "trainbridge.sandbox.harness"], request=request, plan=plan,
                     cwd=workload.root, env={**env, **box.env}, preexec_fn=limit_memory(memory_limit_mb), timeout_s=config.timeout_s,
                     stdout_path=tmp_dir / "stdout.txt", stderr_path=tmp_dir / "stderr.txt",
                     fork_pool=pool, memory_limit_mb=memory_limit_mb, writable=writable)
    return spec, base


def _with_tails(base: RunResult, tmp_dir: Path) -> RunResult:
    base.stdout_tail = (tmp_dir / "stdout.txt").read_text(encoding="utf-8", errors="replace")[-TAIL_CHARS:]
    base.stderr_tail = (tmp_dir / "stderr.txt").read_text(encoding="utf-8", errors="replace")[-TAIL_CHARS:]
    return base


def _run_script(workload: Workload, target: Backend, mode: str, plan: StepPlan | None, env: dict[str, str],
                memory_limit_mb: int, tmp_dir: Path, extra_request: dict[str, Any] | None, on_progress) -> RunResult:
    """Script mode (sandbox/script/run.py): the user's script under sandbox/script/launcher.py, driven like entry mode."""
    built = _script_child(workload, target, mode, plan, extra_request, env, memory_limit_mb, tmp_dir)
    if isinstance(built, RunResult):
        return built
    spec, base, setup = built
    total = workload.config.warmup_steps + workload.config.steps
    started = time.monotonic()
    outcome = drive(spec, on_progress=(lambda done: on_progress(min(done, total), total)) if on_progress else None)
    base.wall_s = time.monotonic() - started
    result = _driven_result(_with_tails(base, tmp_dir), outcome, workload.config.timeout_s, len(spec.plan.timed()))
    return script_run.finish(result, setup, outcome.result, workload.config.timeout_s)


def _script_child(workload: Workload, target: Backend, mode: str, plan: StepPlan | None, extra_request: dict[str, Any] | None,
                  env: dict[str, str], memory_limit_mb: int,
                  tmp_dir: Path) -> tuple[ChildSpec, RunResult, script_run.ScriptSetup] | RunResult:
    """How to start one script-mode child (its working directory made in `tmp_dir`), or the failed result that
    stops it before it starts (a missing script, a data entry that is nowhere, a multi-process launch)."""
    config = workload.config
    # the profile and capture plans made below ask for no evidence files: the plan given is the one that may
    box = child_sandbox(tmp_dir, root=workload.root, backend=target.name,
                        evidence=[*(plan.evidence_dirs() if plan else []), *request_outputs(extra_request)])
    base = _base_result(config, target, box, memory_limit_mb)
    setup = script_run.prepare(workload, backend=target.name, mode=mode, tmp_dir=tmp_dir, extra_request=extra_request)
    if isinstance(setup, Failure):
        base.failure = setup
        return base
    if plan is None and mode == "gate":
        raise ValueError("mode 'gate' needs a StepPlan (its batch indices, probe and parameter deltas)")
    if mode == "profile":
        plan, setup.request["profile"] = script_run.profile_plan(config.warmup_steps, config.steps)
    if mode == "capture":  # the torch.compile reference over the script's own steps (sandbox/script/capture.py)
        plan, setup.request["capture"] = script_run.capture_plan(config.steps, int(setup.request.get("timed_steps", 0)))
    plan = plan or StepPlan.sequential(config.warmup_steps, config.steps)
    base.warmup_steps = len(plan.warmup)
    ranks = setup.spec.nproc  # torchrun --nproc_per_node N > 1: the rank supervisor starts N launchers (sandbox/child/rank_group.py)
    module = script_run.RANKS_MODULE if ranks > 1 else script_run.LAUNCHER_MODULE
    spec = ChildSpec(argv=[*box.prefix, sys.executable, "-m", module], request=setup.request, plan=plan,
                     cwd=setup.run_dir.cwd, env={**env, **box.env}, preexec_fn=limit_memory(memory_limit_mb), timeout_s=config.timeout_s,
                     stdout_path=tmp_dir / "stdout.txt", stderr_path=tmp_dir / "stderr.txt", ranks=max(1, ranks))
    return spec, base, setup


def forked_writable(scratch: Path, root: Path | str | None, evidence=()) -> tuple[str, ...] | None:
    """The folders a forked child may write, those bubblewrap binds writable for an exec'd one
    (`confinement.child_sandbox`): its scratch, its side's folder and its evidence folders; None (unconfined) where
    confinement was turned off (TRAINBRIDGE_CONFINE=0)."""
    if not confinement_wanted():
        return None
    return tuple(dict.fromkeys(str(Path(p).resolve()) for p in (scratch, cache_dir(root), *evidence)))


SELF_CONFINED_NOTE = ("forked from a warm server, confined by itself (sandbox/child/self_confinement.py): own user and mount "
                      "namespaces, no capability; writable: its own scratch, its side's folder and its evidence folder only; "
                      "not in a PID namespace of its own (its system-call filter stops signals and tracing)")


def _fork_confinement(base: RunResult, forked: bool, confined: bool) -> None:
    """Record on `base` (made for an exec'd child) how a forked child was confined: by itself, or not at all where
    nothing confines children here (the network isolation of its server only)."""
    if not forked:
        return
    isolation = network_isolation()
    base.confined = confined
    base.network_isolated = isolation.isolated
    base.isolation_notes = [SELF_CONFINED_NOTE] if confined else ["forked from a warm server: not confined", *isolation.notes]


def _not_started() -> Sandbox:
    return Sandbox(prefix=(), notes=["not started"])


def _base_result(config, target: Backend, box: Sandbox, memory_limit_mb: int) -> RunResult:
    return RunResult(mode=config.mode, backend=target.name, device=target.device, seed=config.seed, threads=config.threads,
                     warmup_steps=config.warmup_steps, network_isolated=box.network_isolated, isolation_notes=list(box.notes),
                     confined=box.confined, memory_limit_mb=memory_limit_mb)


def _driven_result(base: RunResult, outcome: DriveOutcome, timeout_s: float, steps_total: int) -> RunResult:
    base.timing_source = "parent"
    base.warmup_times_s, base.step_times_s = outcome.warmup_times_s, outcome.step_times_s
    base.cooldown_times_s, base.cooldown_losses = outcome.cooldown_times_s, outcome.cooldown_losses
    base.inner_step_times_s, base.losses = outcome.inner_times_s, outcome.losses
    base.device_kernels_per_step = list(outcome.kernels) if len(outcome.kernels) == len(outcome.inner_times_s) else []
    base.watch = outcome.watch
    _fork_confinement(base, outcome.forked, outcome.fork_confined)
    if len(outcome.clock_pairs) >= 2:
        (parent_first, child_first), (parent_last, child_last) = outcome.clock_pairs[0], outcome.clock_pairs[-1]
        base.clock_span_s = (parent_last - parent_first, child_last - child_first)
    if outcome.result:
        base.versions = outcome.result.get("versions", {})
        base.peak_memory_bytes = outcome.result.get("peak_memory_bytes")
    if outcome.probe is not None:
        base.extra["numerics"] = outcome.probe
    if outcome.final is not None:
        base.extra["final"] = outcome.final
    done = len(outcome.inner_times_s)
    base.interrupted = outcome.interrupted
    if outcome.failure is not None:
        base.failure = outcome.failure
    elif outcome.timed_out:
        base.failure = Failure(kind=FailureKind.timeout, message=f"no result within the {timeout_s:g} s limit; the process group was "
                               f"killed after {done} of {steps_total} step(s)", step=done)
    elif outcome.watch.protocol_violations:
        base.failure = Failure(kind=FailureKind.crashed, message="the run broke the harness's protocol: "
                               + "; ".join(outcome.watch.protocol_violations)[:1500], step=done)
    elif outcome.interrupted:
        base.failure = Failure(kind=FailureKind.crashed, message=f"interrupted after {done} of {steps_total} step(s): {outcome.interrupted}",
                               step=done)
    elif outcome.result is None:
        base.failure = _classify_death(_ChildOutcome(outcome.returncode, False, base.stdout_tail, base.stderr_tail,
                                                     "fork-server" if outcome.forked else "exec"), done)
    return base


class _ChildOutcome:
    def __init__(self, returncode: int | None, timed_out: bool, stdout: str, stderr: str, spawn: str = "exec"):
        self.returncode, self.timed_out, self.stdout, self.stderr, self.spawn = returncode, timed_out, stdout, stderr, spawn


def run_confined(argv: list[str], *, cwd: Path, env: dict[str, str], memory_limit_mb: int, timeout_s: float,
                 tmp_dir: Path, forked: tuple[str, list[str]] | None = None,
                 exec_env: dict[str, str] | None = None, writable: tuple[str, ...] | None = None) -> _ChildOutcome:
    """Run one request-file child of the sandbox's own modules (e.g. sandbox/region_bench.py) the way analysis
    modes run: own process group killed as a whole at `timeout_s`, address-space cap, the given (scrubbed)
    environment; stdout/stderr in `tmp_dir`. The outcome has returncode, timed_out, stdout, stderr, and how the
    child started (`spawn`). With `forked` (a `fork_child.PROGRAMS` name and its arguments) inside a fork pool
    (`fork_server.serving`), the child is forked from the pool's server, with the same confinement; where the
    pool cannot fork it, it is exec'd from `argv`. Either way `exec_env` is added to `env` (the side's own HOME,
    TMPDIR and caches: `confinement.child_sandbox`; a fork server ignores them in choosing the server), and a forked
    child confines itself to `writable` (`forked_writable`: the folders bubblewrap would bind writable)."""
    return _run_child(argv, cwd=cwd, env=env, memory_limit_mb=memory_limit_mb, timeout_s=timeout_s, tmp_dir=tmp_dir,
                      on_progress=None, forked=forked, exec_env=exec_env, writable=writable)


def _fork_confined(forked: tuple[str, list[str]] | None, *, cwd: Path, env: dict[str, str], memory_limit_mb: int,
                   stdout, stderr, writable: tuple[str, ...] | None) -> fork_server.ForkedChild | None:
    pool = fork_server.active()
    if forked is None or pool is None:
        return None
    null_r, null_w = os.open(os.devnull, os.O_RDONLY), os.open(os.devnull, os.O_WRONLY)  # no channel: a request file
    try:
        return pool.fork(cwd=cwd, env=env, channel=(1000, 1001), memory_limit_mb=memory_limit_mb, program=forked[0],
                         args=forked[1], fds={"command": null_r, "reply": null_w, "stdout": stdout.fileno(),
                                              "stderr": stderr.fileno()}, writable=writable)
    finally:
        os.close(null_r)
        os.close(null_w)


def _run_child(argv, *, cwd, env, memory_limit_mb, timeout_s, tmp_dir: Path, on_progress,
               forked: tuple[str, list[str]] | None = None, exec_env: dict[str, str] | None = None,
               writable: tuple[str, ...] | None = None) -> _ChildOutcome:
    stdout_path, stderr_path = tmp_dir / "stdout.txt", tmp_dir / "stderr.txt"
    progress_path = tmp_dir / "progress.jsonl"
    with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
        child = _fork_confined(forked, cwd=cwd, env={**env, **(exec_env or {})}, memory_limit_mb=memory_limit_mb,
                               stdout=stdout, stderr=stderr, writable=writable)
        spawn = "fork-server" if child is not None else "exec"
        try:
            child = child or subprocess.Popen(
                argv,
                cwd=cwd,
                env={**env, **(exec_env or {})},
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,  # its own process group: a timeout kills it and everything it started
                preexec_fn=limit_memory(memory_limit_mb),
            )
        except OSError as exc:
            return _ChildOutcome(None, False, "", f"could not start {argv[0]}: {exc}")
        started = proc_watch.read_stat(child.pid)
        started_ticks = started.start_ticks if started else None
        deadline = time.monotonic() + timeout_s
        timed_out = False
        reported = -1
        try:
            while child.poll() is None:
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                if on_progress is not None:
                    done = _count_lines(progress_path)
                    if done != reported:
                        reported = done
                        on_progress(done)
                time.sleep(POLL_S)
        finally:
            if child.poll() is None:
                _kill_group(child)
            proc_watch.reap_orphans(started_ticks, exclude=child.pid)  # its descendants, if they were handed to us
        if on_progress is not None:
            on_progress(_count_lines(progress_path))
    return _ChildOutcome(
        child.returncode,
        timed_out,
        stdout_path.read_text(encoding="utf-8", errors="replace"),
        stderr_path.read_text(encoding="utf-8", errors="replace"),
        spawn,
    )


def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.wait()


def _count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def _read_progress(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line cut by the kill
    return events


def _entry_result(base: RunResult, outcome: _ChildOutcome, tmp_dir: Path, timeout_s: float) -> RunResult:
    result_path = tmp_dir / "result.json"
    events = _read_progress(tmp_dir / "progress.jsonl")
    if outcome.timed_out or not result_path.exists():
        _fill_from_progress(base, events)
        if outcome.timed_out:
            base.failure = Failure(
                kind=FailureKind.timeout,
                message=f"no result within the {timeout_s:g} s limit; the process group was killed "
                f"after {len(events)} finished step(s)",
                step=len(events),
            )
        else:
            base.failure = _classify_death(outcome, len(events))
        return base
    payload = json.loads(result_path.read_text(encoding="utf-8"))
    base.warmup_times_s = payload.get("warmup_times_s", [])
    base.step_times_s = payload.get("step_times_s", [])
    base.losses = payload.get("losses", [])
    base.peak_memory_bytes = payload.get("peak_memory_bytes")
    base.versions = payload.get("versions", {})
    base.extra = payload.get("extra", {})
    if payload.get("failure"):
        base.failure = Failure.model_validate(payload["failure"])
    return base


def _fill_from_progress(base: RunResult, events: list[dict[str, Any]]) -> None:
    for event in events:
        base.losses.append(event["loss"])
        (base.warmup_times_s if event["step"] < base.warmup_steps else base.step_times_s).append(event["time_s"])


def _classify_death(outcome: _ChildOutcome, steps_done: int) -> Failure:
    code = outcome.returncode
    tail = outcome.stderr[-TAIL_CHARS:] or None
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        if -code == signal_filter.KILLED_BY and outcome.spawn == "fork-server":
            return Failure(kind=FailureKind.forbidden_call, message=f"killed by the sandbox's system-call filter ({name}) after "
                           f"{steps_done} step(s): it tried {signal_filter.WHAT_IT_FORBIDS}", traceback_tail=tail, step=steps_done)
        if -code == signal.SIGKILL:
            return Failure(kind=FailureKind.oom, message=f"killed by {name} after {steps_done} step(s) without a result; "
                           "most likely the kernel's out-of-memory killer", traceback_tail=tail, step=steps_done)
        return Failure(kind=FailureKind.crashed, message=f"died from signal {name} after {steps_done} step(s)", traceback_tail=tail, step=steps_done)
    if tail and ("MemoryError" in tail or "out of memory" in tail.lower()):
        return Failure(kind=FailureKind.oom, message="ran out of memory before writing a result", traceback_tail=tail, step=steps_done)
    return Failure(kind=FailureKind.crashed, message=f"exited with code {code} without writing a result", traceback_tail=tail, step=steps_done)


def _command_result(base: RunResult, outcome: _ChildOutcome, workload: Workload) -> RunResult:
    parsed = parse_command_output(outcome.stdout, workload.config)
    warmup = workload.config.warmup_steps
    base.losses = parsed.losses
    base.warmup_times_s, base.step_times_s = parsed.step_times_s[:warmup], parsed.step_times_s[warmup:]
    if outcome.timed_out:
        base.failure = Failure(kind=FailureKind.timeout, message=f"command did not finish within {workload.config.timeout_s:g} s; "
                               "the process group was killed", step=len(parsed.losses))
    elif outcome.returncode != 0:
        base.failure = _classify_death(outcome, len(parsed.losses))
        if outcome.returncode and outcome.returncode > 0 and base.failure.kind == FailureKind.crashed:
            kind = FailureKind.import_error if "ModuleNotFoundError" in outcome.stderr or "ImportError" in outcome.stderr else FailureKind.exception
            base.failure = Failure(kind=kind, message=f"command exited with code {outcome.returncode}",
                                   exception_type=_last_exception_type(outcome.stderr), traceback_tail=outcome.stderr[-TAIL_CHARS:] or None)
    elif parsed.nonfinite_step is not None:
        base.failure = Failure(kind=FailureKind.nonfinite_loss, message=f"step {parsed.nonfinite_step} printed a non-finite loss",
                               step=parsed.nonfinite_step)
    elif not parsed.step_times_s:
        base.failure = Failure(kind=FailureKind.bad_workload, message="the command's output had no line matching step_time_pattern "
                               f"{workload.config.step_time_pattern!r}; set step_time_pattern in trainbridge.toml")
    return base


def _last_exception_type(stderr: str) -> str | None:
    for line in reversed(stderr.strip().splitlines()):
        head = line.split(":", 1)[0].strip()
        if head.endswith(("Error", "Exception")) and " " not in head:
            return head.rsplit(".", 1)[-1]
    return None
