"""Script mode, parent side: what a script-mode run is asked over the channel, and what its failures mean.

sandbox/runner.py drives the child (sandbox/script/launcher.py) through sandbox/child/step_driver.py, as
for entry mode; this module checks the launch line and the files before anything starts, builds
the request and the run's working directory (sandbox/script/files.py), and turns the bare
failures of a script (a timeout before any step, an early exit) into messages that say what to do.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainbridge.sandbox.results import Failure, FailureKind, RunResult
from trainbridge.sandbox.script.capture import capture_plan  # noqa: F401 - harness mode "capture": the runner asks script_run for its steps
from trainbridge.sandbox.script.files import DataPathError, RunDir, make_run_dir, snapshot, use_workdir
from trainbridge.sandbox.script.launch import LaunchSpec, parse_launch
from trainbridge.sandbox.workload import DEFAULT_LOSS_PATTERN, Workload

LAUNCHER_MODULE = "trainbridge.sandbox.script.launcher"
RANKS_MODULE = "trainbridge.sandbox.child.rank_supervisor"  # torchrun with several ranks (sandbox/child/rank_group.py)
OUTPUT_TAIL_CHARS = 2000
SCRIPT_MODES = ("measure", "gate", "profile", "capture")
PROFILE_TIMED_STEPS = 3  # unprofiled steps timed before the recorded ones, as tools/eager_profile.record_eager_ops does


def profile_plan(warmup: int, steps: int):
    """Harness mode "profile" as steps: warm-up, PROFILE_TIMED_STEPS timed ones, then `steps` recorded ones;
    and what the launcher is told about them."""
    from trainbridge.sandbox.child.step_driver import StepPlan

    timed = max(steps, PROFILE_TIMED_STEPS)
    plan = StepPlan(warmup=list(range(warmup)), measured=list(range(warmup, warmup + timed)),
                    cooldown=list(range(warmup + timed, warmup + timed + steps)))
    return plan, {"timed_from": warmup, "start": warmup + timed, "steps": steps}


@dataclass
class ScriptSetup:
    request: dict[str, Any]
    run_dir: RunDir
    spec: LaunchSpec
    data_before: dict[str, tuple[int, int]]


def prepare(workload: Workload, *, backend: str, mode: str, tmp_dir: Path, extra_request: dict[str, Any] | None) -> ScriptSetup | Failure:
    """The request and the working directory of one script-mode run, or the Failure that stops it before it starts."""
    config = workload.config
    spec = parse_launch(config.launch or "")
    problem = launch_problem(workload)
    if problem:
        return Failure(kind=FailureKind.bad_workload, message=problem)
    if mode not in SCRIPT_MODES:
        return Failure(kind=FailureKind.bad_workload, message=f"harness mode {mode!r} is not available in script mode; script "
                       f"mode runs {', '.join(SCRIPT_MODES)}. Add an entry = \"module:function\" to trainbridge.toml (precise "
                       "mode) for the others")
    if "loss" not in re.compile(config.loss_pattern).groupindex:
        return Failure(kind=FailureKind.bad_workload, message=f"loss_pattern {config.loss_pattern!r} of trainbridge.toml needs a named "
                       "group (?P<loss>...) around the number, e.g. loss_pattern = 'train_loss=(?P<loss>[-+0-9.eE]+)'")
    try:
        run_dir = make_run_dir(workload.root, config.data, tmp_dir / "cwd", workdir=config.workdir)
    except DataPathError as exc:
        return Failure(kind=FailureKind.bad_workload, message=str(exc))
    run_dir.script = spec.script or ""
    folder = config.workdir or _own_folder(workload, spec, run_dir)
    workdir = {"workdir": str(use_workdir(run_dir, folder)), "run_dir": str(run_dir.cwd)} if folder else {}
    request = {"mode": mode, "root": str(workload.root), "launch": spec.to_json(), "overrides": config.overrides,
               "pythonpath": config.pythonpath, "backend": backend, "seed": config.seed, "threads": config.threads,
               "protected": [str(p) for p in run_dir.protected],
               "replaceable": [str(p) for p in run_dir.shown.values()],  # copied on write (sandbox/script/launcher.py)
               # the printed loss: the fallback when backward() saw no scalar, the source when the toml sets its own pattern
               "loss_pattern": config.loss_pattern, "loss_pattern_preferred": config.loss_pattern != DEFAULT_LOSS_PATTERN,
               **workdir, **(extra_request or {})}
    return ScriptSetup(request=request, run_dir=run_dir, spec=spec, data_before=snapshot(_read_only_sources(run_dir)))


def _own_folder(workload: Workload, spec: LaunchSpec, run_dir: RunDir) -> str | None:
    """Zero config for a script written to run from its own folder (`-- python projects/chargpt/chargpt.py`, no
    workdir in trainbridge.toml): its folder, when it opens a relative path that the run's mirror has beside it and not
    at the root (tools/launch/workdir.py; the mirror shows the checkout's untracked input.txt); said in the
    run's notes. None otherwise, or when the script cannot be read."""
    if spec.script is None or Path(spec.script).parent == Path("."):
        return None
    from trainbridge.tools.launch.workdir import own_folder
    from trainbridge.tools.launch.script_facts import read_script_facts

    try:
        found = own_folder(run_dir.cwd, spec.script, read_script_facts(workload.root, spec.script))
    except OSError:
        return None
    if found is None:
        return None
    run_dir.notes.append(f"{spec.script} runs from its folder: {found[1]}; workdir = \"{found[0]}\" in trainbridge.toml "
                         "says so for every run")
    return found[0]


def _read_only_sources(run_dir: RunDir) -> list[Path]:
    """The data entries' files, compared before and after the run. The files it shows by itself from outside git are
    not: like the rest of the checkout they are kept by the write guard and the sandbox's read-only view, and you may
    go on working in your checkout (an untracked note edited during an overnight run must not fail a gate round)."""
    return list(run_dir.data_sources.values())


def launch_problem(workload: Workload) -> str | None:
    """Why the workload's launch line cannot run here, before anything starts (None: it can)."""
    spec = parse_launch(workload.config.launch or "")
    problem = spec.launch_problem()
    if problem:
        return problem
    workdir = workload.config.workdir
    if workdir is not None and not (workload.root / workdir).is_dir():
        return (f"workdir {workdir!r} of trainbridge.toml is not a folder of {workload.root}: name the folder (relative to the "
                "repository's root) the script runs from, or leave workdir out to run it from the root")
    if spec.script is not None and not (workload.root / spec.script).is_file():
        near = sorted(p.name for p in workload.root.glob("*.py"))[:8]
        beside = workdir is not None and (workload.root / workdir / spec.script).is_file()
        return (f"script {spec.script!r} of launch line {spec.line!r} not found in {workload.root}"
                + (f" (Python files there: {', '.join(near)})" if near else "")
                + (f"; it is in workdir {workdir!r}: the launch line names the script from the repository's root, "
                   f"launch = \"python {Path(workdir, spec.script).as_posix()} ...\"" if beside else ""))
    return None


def finish(result: RunResult, setup: ScriptSetup, closing: dict[str, Any] | None, timeout_s: float) -> RunResult:
    """Script-mode facts into the result (extra["script"]), and failures explained."""
    from trainbridge.sandbox.script.files import changed

    info: dict[str, Any] = dict((closing or {}).get("script") or {})
    result.extra.update((closing or {}).get("extra") or {})  # harness mode "profile": eager_ops, optimizer_class
    if (closing or {}).get("notes"):
        info["notes"] = list(closing["notes"])
    info.update(launch=setup.spec.line, cwd=str(setup.run_dir.cwd), data={k: str(v) for k, v in setup.run_dir.data_sources.items()},
                overrides=setup.request["overrides"], data_shown=list(setup.run_dir.shown), data_skipped=dict(setup.run_dir.skipped))
    if setup.run_dir.notes:
        info["notes"] = [*info.get("notes", []), *setup.run_dir.notes]
    touched = changed(setup.data_before, snapshot(_read_only_sources(setup.run_dir)))
    info["data_changed"] = touched
    result.extra["script"] = info
    failure = result.failure
    if failure is None and touched:
        result.failure = Failure(kind=FailureKind.bad_workload, message=f"the run changed files of your checkout's data: "
                                 f"{', '.join(touched[:5])}; the data must stay read-only")
        return result
    if failure is None:
        return result
    output = (result.stdout_tail + result.stderr_tail)[-OUTPUT_TAIL_CHARS:].strip()
    steps = len(result.inner_step_times_s)
    if failure.kind == FailureKind.timeout and steps == 0 and "numerics" not in result.extra:
        failure.message = (f"no optimizer step within the {timeout_s:g} s limit: the script never reached its first backward() "
                           "or optimizer.step() (it may wait for input, a download, a lock, or its set-up is too slow for the "
                           "limit: raise timeout_s or shrink it with [overrides])")
    if failure.kind in (FailureKind.bad_workload, FailureKind.timeout, FailureKind.crashed) and output and not failure.traceback_tail:
        failure.traceback_tail = output
    if failure.message.startswith(MISSING_FILE):
        failure.message = missing_file_hint(failure.message, setup.run_dir)
    if "its output tail is below" in failure.message and output:
        failure.message = failure.message.replace("its output tail is below", f"its output ends: {output[-600:]}")
    return result


MISSING_FILE = "the script needs a file that is missing: "  # the launcher's message (sandbox/script/launcher.py)


def missing_file_hint(message: str, run_dir: RunDir) -> str:
    """The launcher's missing-file message, told what the run knows: the file is in the user's checkout but was left
    out by its name (an output or cache folder: the data entry that shows it), or it is nowhere there."""
    match = re.match(re.escape(MISSING_FILE) + r"'([^']+)'", message)
    if match is None or run_dir.checkout is None:
        return message
    name, path = match.group(1), Path(match.group(1))
    rel = Path(os.path.normpath(path.relative_to(run_dir.cwd) if path.is_absolute() and path.is_relative_to(run_dir.cwd)
                                else Path(run_dir.workdir or ".") / path))
    if rel.is_absolute() or ".." in rel.parts:
        return message
    checkout = run_dir.checkout
    if (checkout / rel).exists():
        skipped = next(((entry, why) for entry, why in run_dir.skipped.items()
                        if rel.as_posix() == entry.rstrip("/") or rel.as_posix().startswith(entry.rstrip("/") + "/")), None)
        entry, why = skipped if skipped else (rel.as_posix(), "")
        return (f"{MISSING_FILE}{name!r}: it is in your checkout ({checkout / rel}) but the run did not show it"
                f"{f' ({entry}: {why})' if why else ''}. Add data = [\"{entry}\"] to trainbridge.toml and every run sees "
                "it read-only (with `-- <launch line>` too: a trainbridge.toml still gives its data)")
    elsewhere = _files_named(checkout, rel.name)
    if elsewhere:
        where = f"workdir {run_dir.workdir!r} of trainbridge.toml" if run_dir.workdir else \
            "the repository's root unless trainbridge.toml sets workdir (as `python <script>` typed at the root)"
        folder = Path(elsewhere[0]).parent.joinpath(*[".."] * (len(path.parts) - 1)) if not path.is_absolute() else None
        folder = Path(os.path.normpath(folder)) if folder is not None else None
        fix = (f"If the script is written to run from {folder.as_posix()}/, add workdir = \"{folder.as_posix()}\" to "
               "trainbridge.toml (the folder it runs in); else make" if folder is not None and ".." not in folder.parts
               and folder.as_posix() != "." else "Make")
        return (f"{MISSING_FILE}{name!r}: your checkout has {', '.join(elsewhere[:3])}, but the script looks for it relative "
                f"to its working directory, {where}. {fix} the path it opens one relative to that folder (an argument or "
                "setting of the script, set under [overrides] in trainbridge.toml), or put the file where it looks")
    folder = Path(run_dir.script).parent if run_dir.script else Path(".")
    beside = (f" A script in a subfolder often opens it from its own folder: put it at {(folder / path).as_posix()} in your "
              f"checkout and runs start the script in {folder.as_posix()}/ by themselves (workdir)."
              if folder != Path(".") and not run_dir.workdir and not path.is_absolute() else "")
    return (f"{MISSING_FILE}{name!r} (working directory: the run's mirror of the repository): it is not in your checkout "
            f"({checkout}) either, and the run shows the checkout's git-ignored files read-only by itself. Create it there "
            "first (the repository's data preparation step; its README says which), or, if the script reads it from "
            "elsewhere in the repository under another name, list that in data = [...] of trainbridge.toml." + beside)


def _files_named(root: Path, name: str, limit: int = 20_000) -> list[str]:
    """Repo-relative paths of the files called `name` below `root` (hidden folders skipped, `limit` files looked at)."""
    hits, seen = [], 0
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in ("__pycache__", "node_modules"))
        seen += len(files)
        if name in files:
            hits.append(Path(folder, name).relative_to(root).as_posix())
        if seen > limit:
            break
    return hits
