"""`trainbridge init <repo>`: find the training script and its launch line, say what was found and
why, write a commented `trainbridge.toml`, then prove it with one short measurement: on a failure, say
the cause and its fix (graph/cli/check_advice.py) and try the next lines that can run here, then
the line with the override that fixes its device (`prove`), keeping the first that runs.

Script mode (running `launch`) is not in every version: until the workload loader knows the
`launch` key, init writes the file and says "written; run `trainbridge measure <repo>` to check it"
instead of measuring. Mounted on the root app by graph/cli/app.py; nothing runs at import time.
"""

from __future__ import annotations


from pathlib import Path
from typing import TYPE_CHECKING

import typer

from trainbridge.graph.cli.terminal import console
from trainbridge.graph.cli.terminal import error as _error
from trainbridge.tools.launch.init_toml import literal_value, render_toml, toml_key, toml_value
from trainbridge.tools.launch.discovery import Discovery, LaunchCandidate, discover_launch

if TYPE_CHECKING:
    from trainbridge.sandbox.results import RunResult

TOML_NAME = "trainbridge.toml"
CHECK_STEPS, CHECK_WARMUP = 2, 1  # the one short measurement
MAX_TRIES = 3  # launch lines measured at most, the chosen one and those after it


def init(
    repo: Path = typer.Argument(..., help="The training repository's root folder."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Unattended: take the best launch line and write without asking."),
    force: bool = typer.Option(False, "--force", help=f"Overwrite an existing {TOML_NAME}."),
    measure: bool = typer.Option(True, "--measure/--no-measure", help="After writing, measure a few steps to prove it works."),
) -> None:
    """Find the training script and its launch line, and write a commented trainbridge.toml.

    Looks at README/markdown code blocks, shell scripts, and Python files that run as a script, build an optimizer and call .backward() (read, never run); ranks what it finds and prints why. The toml gets `launch = "..."`, the git-ignored data paths the script reads (`data = [...]`), and a commented \\[overrides] table with the settings one could shrink. Exit code 1 when no training script is found, 2 for bad input.
    """
    root = repo.expanduser()
    if not root.is_dir():
        _error(f"{repo} is not a folder: pass the root of the training repository")
        raise typer.Exit(2)
    target = root / TOML_NAME
    if target.exists() and not force:
        _error(f"{target} already exists; init does not overwrite it. Pass --force to replace it, or edit it by hand.")
        raise typer.Exit(2)
    found = discover_launch(root, cuda=cuda_here())
    show_discovery(found)
    if found.best is None:
        _error(found.nothing_found())
        raise typer.Exit(1)
    chosen = found.best if yes else _choose(found)
    if not yes and not typer.confirm(f"Write {target} with launch = {chosen.launch!r}?", default=True):
        _say("nothing written")
        raise typer.Exit(0)
    target.write_text(render_toml(found, chosen), encoding="utf-8")
    _say(f"wrote {target}")
    failed = measure and prove(root, found, chosen) is False
    shrink = shrink_hints(found)
    if shrink and not failed:  # a failed check said its own fix
        _say(f"if a step does not fit this machine, shrink it under [overrides] in {target}: {shrink}")


def _say(text: str) -> None:
    """Progress and findings to stderr, unwrapped and without markup (paths and `[overrides]` print as is)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def show_discovery(found: Discovery) -> None:
    """What was found and why, best first."""
    for rank, candidate in enumerate(found.candidates, 1):
        runner = f"torchrun, {candidate.nproc or '?'} processes" if candidate.torchrun else "one process"
        _say(f"{rank}. {candidate.launch}   [{runner}; score {candidate.score:g}]")
        for evidence in candidate.evidence:
            _say(f"     {evidence.where} ({evidence.kind}): {evidence.text}")
        _say(f"     why: {'; '.join(candidate.reasons)}")
    for miss in found.near_misses:
        _say(f"not a training script: {miss.script}: {miss.reason}")
    if found.best is not None:
        if found.configurable_by:
            _say(f"{found.best.script} takes settings by: {'; '.join(found.configurable_by)}")
        if found.distributed:
            _say(f"{found.best.script} runs distributed when torchrun sets RANK/WORLD_SIZE")
        if found.data_paths:
            _say(f"git-ignored paths it reads: {', '.join(found.data_paths)}")
        if found.data_missing:
            _say(f"git-ignored files it names but that are nowhere in the repository yet (left out of data = [...]; "
                 f"outputs, or data not prepared yet: prepare it, then `trainbridge init --force`): "
                 f"{', '.join(found.data_missing)}")


def _choose(found: Discovery) -> LaunchCandidate:
    if len(found.candidates) == 1:
        return found.candidates[0]
    number = typer.prompt(f"Which launch line (1-{len(found.candidates)})?", default=1, type=int)
    if not 1 <= number <= len(found.candidates):
        _error(f"{number} is not one of 1-{len(found.candidates)}")
        raise typer.Exit(2)
    return found.candidates[number - 1]


def script_mode_available() -> bool:
    """Whether this version's workload loader runs a `launch` line (script mode)."""
    from trainbridge.sandbox.workload import WorkloadConfig

    return "launch" in WorkloadConfig.model_fields


def cuda_here() -> bool:
    """Whether this host can run CUDA (ranks a README's CPU line before its GPU line when not)."""
    from trainbridge.sandbox.backends import availability

    return availability("cuda").available


def prove(root: Path, found: Discovery, chosen: LaunchCandidate) -> LaunchCandidate | bool:
    """Measure the written launch line; when it fails for a reason another line may not share (a device), try the
    next candidates that can run here, the lines that name the CPU first, then the failed line with the override that
    fixes it (its device setting = "cpu"), MAX_TRIES checks in all, and keep the first that runs. Says the cause of
    each failure and its fix (graph/cli/check_advice.py). Returns the line that ran, False when none did, True
    when no check could run (said so)."""
    from trainbridge.graph.cli.check_advice import advise

    target = root / TOML_NAME
    queue: list[tuple[LaunchCandidate, dict | None]] = [(c, None) for c in [chosen, *(c for c in found.candidates if c is not chosen)]]
    tried: list[LaunchCandidate] = []
    fixed = False
    while queue and len(tried) < MAX_TRIES:
        candidate, overrides = queue.pop(0)
        if tried:
            if overrides is None and launch_refused(root, candidate):
                continue
            settings = ", ".join(f"{key} = {value!r}" for key, (value, _) in (overrides or {}).items())
            _say(f"trying {f'it with {settings}' if overrides else 'the next launch line'}: {candidate.launch}")
            target.write_text(render_toml(found, candidate, overrides=overrides), encoding="utf-8")
        tried.append(candidate)
        result = check_once(root)
        if result is None:
            return True
        if result.ok:
            if len(tried) > 1:
                _say(f"wrote {target} with launch = {candidate.launch!r}{' and that override' if overrides else ''}: it runs "
                     f"here; {chosen.launch!r} as found did not")
            return candidate
        advice = advise(result.failure, found)
        _say(f"cause: {advice.cause}" + (f"; fix: {advice.fix}" if advice.fix else ""))
        if not advice.line_specific:
            break
        if advice.override and not fixed:  # the same line with the fix, after the lines that name the CPU
            fixed = True
            cpu = [item for item in queue if item[0].device == "cpu"]
            queue = cpu + [(candidate, {k: (v, f"init: {advice.cause}") for k, v in advice.override.items()})] + \
                [item for item in queue if item not in cpu]
    if len(tried) > 1:
        target.write_text(render_toml(found, chosen), encoding="utf-8")
        _say(f"no launch line ran here ({len(tried)} tried); {target} keeps launch = {chosen.launch!r}: apply the fix above")
    return False


def launch_refused(root: Path, candidate: LaunchCandidate) -> bool:
    """Whether script mode refuses the line before running it (several nodes, too many ranks): not worth a check."""
    from trainbridge.sandbox.script.launch import LaunchError, parse_launch

    try:
        return parse_launch(candidate.launch).launch_problem() is not None
    except LaunchError:
        return True


def check_once(root: Path) -> RunResult | None:
    """One short measurement through the measure path: its result, or None when it could not run (said so). Guarded:
    without script mode, or when the loader cannot read the file yet, it says how to check instead of failing."""
    if not script_mode_available():
        _say(f"written; run `trainbridge measure {root}` to check it (this version cannot run a "
             "`launch` line yet)")
        return None
    from trainbridge.sandbox.runner import run_workload
    from trainbridge.sandbox.workload import WorkloadConfigError, load_workload

    try:
        workload = load_workload(root).with_overrides(steps=CHECK_STEPS, warmup_steps=CHECK_WARMUP)
    except WorkloadConfigError as exc:
        _say(f"written, but it does not load yet: {exc}; run `trainbridge measure {root}` after fixing it")
        return None
    _say(f"measuring {CHECK_WARMUP} warm-up + {CHECK_STEPS} steps to check it")
    result = run_workload(workload, backend="cpu")
    if result.ok:
        _say(f"it runs: median step {result.median_step_s() * 1000:.1f} ms")
        return result
    failure = result.failure
    tail = f"\n{failure.traceback_tail}" if failure and failure.traceback_tail else ""
    _say(f"the check failed ({failure.kind if failure else 'unknown'}): {failure.message if failure else ''}{tail}")
    return result


def shrink_hints(found: Discovery, most: int = 6) -> str:
    """The size-like settings of the best script with their defaults, e.g. `batch_size = 32 (...)`."""
    from trainbridge.tools.launch.script_facts import SIZE_NAMES

    sizes = [s for s in found.settings if s.name in SIZE_NAMES and literal_value(s.value) is not None]
    return ", ".join(f"{toml_key(s)} = {toml_value(literal_value(s.value))} ({s.where})" for s in sizes[:most])
