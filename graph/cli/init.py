"""`trainbridge init <repo>`: find the training script and its launch line, say what was found and
why, write a commented `trainbridge.toml`, then prove it with one short measurement: on a failure, say
the cause and its fix (graph/cli/check_advice.py) and try the next lines that can run here, then
the line with the override that fixes its device (`prove`), keeping the first that runs. A line that stops at a
file it opens relative to its folder (minGPT's chargpt reads `open("input.txt")` beside it) is tried again from
that folder (`workdir`).

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
from trainbridge.tools.launch.discovery import Discovery, LaunchCandidate, discover_launch, with_best

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
    script: str = typer.Option("", "--script", help="Take the best launch line of this script (a path from the repository's "
                               "root, e.g. projects/chargpt/chargpt.py) instead of the best line overall."),
) -> None:
    """Find the training script and its launch line, and write a commented trainbridge.toml.

    Looks at README/markdown code blocks, shell scripts, and Python files that run as a script, build an optimizer and call .backward() (read, never run); ranks what it finds and prints why. The toml gets `launch = "..."`, `workdir` when the script runs from its own folder, the git-ignored data paths the script reads (`data = [...]`), and a commented \\[overrides] table with the settings one could shrink. `--script` takes the best line of one script (a folder of examples). Exit code 1 when no training script is found or the written line's check failed (the file is kept; the cause and its fix are printed), 2 for bad input.
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
    if script:
        chosen = _of_script(found, script)
    else:
        chosen = found.best if yes else _choose(found)
    found = with_best(found, chosen)
    show_chosen(found)
    if not yes and not typer.confirm(f"Write {target} with launch = {chosen.launch!r}?", default=True):
        _say("nothing written")
        raise typer.Exit(0)
    target.write_text(render_toml(found, chosen), encoding="utf-8")
    _say(f"wrote {target}")
    lines = found if not script else found.model_copy(update={"candidates": [c for c in found.candidates if c.script == chosen.script]})
    proven = prove(root, lines, chosen) if measure else True  # --script: only that script's lines are tried
    failed = proven is False
    if isinstance(proven, LaunchCandidate):
        found = with_best(found, proven)
    shrink = shrink_hints(found)
    if shrink and not failed:  # a failed check said its own fix
        _say(f"if a step does not fit this machine, shrink it under [overrides] in {target}: {shrink}")
    if failed:  # the file is written, but its check did not pass: the cause and its fix were said above
        raise typer.Exit(1)


def _say(text: str) -> None:
    """Progress and findings to stderr, unwrapped and without markup (paths and `[overrides]` print as is)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def show_discovery(found: Discovery) -> None:
    """What was found and why, best first."""
    for rank, candidate in enumerate(found.candidates, 1):
        runner = f"torchrun, {candidate.nproc or '?'} processes" if candidate.torchrun else "one process"
        folder = f"; from {candidate.workdir}/" if candidate.workdir else ""
        _say(f"{rank}. {candidate.launch}   [{runner}{folder}; score {candidate.score:g}]")
        for evidence in candidate.evidence:
            _say(f"     {evidence.where} ({evidence.kind}): {evidence.text}")
        _say(f"     why: {'; '.join(candidate.reasons)}")
    for miss in found.near_misses:
        _say(f"not a training script: {miss.script}: {miss.reason}")


def show_chosen(found: Discovery) -> None:
    """What init read of the chosen line's script (found.best): how it takes settings, what it reads."""
    if found.best is not None:
        if found.best.workdir:
            _say(f"{found.best.script} runs from its folder: workdir = {found.best.workdir!r}")
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


def _of_script(found: Discovery, script: str) -> LaunchCandidate:
    """The best launch line of `script` (`--script`); exit 2 when none trains it."""
    wanted = Path(script).as_posix().removeprefix("./")
    chosen = next((c for c in found.candidates if c.script == wanted), None)
    if chosen is None:
        scripts = ", ".join(dict.fromkeys(c.script for c in found.candidates)) or "none"
        _error(f"--script {script}: no launch line of that script was found (training scripts found: {scripts})")
        raise typer.Exit(2)
    _say(f"--script {script}: launch line {found.candidates.index(chosen) + 1}")
    return chosen


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
            again = candidate.workdir and candidate.launch == tried[-1].launch and not overrides
            _say(f"trying {f'it with {settings}' if overrides else f'it from {candidate.workdir}/' if again else 'the next launch line'}: "
                 f"{candidate.launch}")
            target.write_text(render_toml(with_best(found, candidate), candidate, overrides=overrides), encoding="utf-8")
        tried.append(candidate)
        result = check_once(root)
        if result is None:
            return True
        if result.ok:
            if len(tried) > 1 and candidate.launch == chosen.launch and candidate.workdir != chosen.workdir and not overrides:
                _say(f"wrote {target} with workdir = {candidate.workdir!r}: it runs from there")
            elif len(tried) > 1:
                _say(f"wrote {target} with launch = {candidate.launch!r}{' and that override' if overrides else ''}: it runs "
                     f"here; {chosen.launch!r} as found did not")
            return candidate
        from_folder = own_folder_retry(root, candidate, result.failure)
        if from_folder is not None:  # no advice: the next check is the fix
            _say(f"cause: {from_folder.reasons[-1]}")
            queue.insert(0, (from_folder, overrides))
            continue
        advice = advise(result.failure, with_best(found, candidate))
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


def own_folder_retry(root: Path, candidate: LaunchCandidate, failure) -> LaunchCandidate | None:
    """The candidate run from its script's folder, when its check stopped at a relative file that is missing from the
    root's point of view and is there beside the script (`open("input.txt")` in projects/chargpt/chargpt.py); else None."""
    import re

    from trainbridge.sandbox.script.run import MISSING_FILE

    match = re.search(re.escape(MISSING_FILE) + r"'([^']+)'", failure.message if failure else "")
    folder = Path(candidate.script).parent
    if match is None or candidate.workdir or folder == Path("."):
        return None
    name = Path(match.group(1))
    if name.is_absolute() or ".." in name.parts or not (root / folder / name).exists():
        return None
    reason = (f"it opens {name.as_posix()} relative to its working directory and that file is beside it "
              f"({(folder / name).as_posix()}): it runs from {folder.as_posix()}/ (workdir)")
    return candidate.model_copy(update={"workdir": folder.as_posix(), "reasons": [*candidate.reasons, reason]})


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
    from trainbridge.graph.cli.workload import resolve_backend

    # a program that imports torch_npu (a ported one) is checked on the npu backend, the emulation where no NPU is
    # here (said on stderr), as `measure` does: on the CPU backend it stopped at `No module named 'torch_npu'`
    backend = resolve_backend(None, root)
    _say(f"measuring {CHECK_WARMUP} warm-up + {CHECK_STEPS} steps to check it{' on the npu backend' if backend == 'npu' else ''}")
    result = run_workload(workload, backend=backend)
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
