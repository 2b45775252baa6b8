"""How the CLI shows a run to a person: progress lines, a paused or finished run, a review payload,
and the review decision asked for. Shared by the local (cli_loop) and served (cli_server) commands."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.syntax import Syntax

from trainbridge.graph.cli.terminal import console
from trainbridge.graph.cli.terminal import error as _error


def say(message: str, out: Console | None = None) -> None:
    """One progress line on stderr (or `out`), timestamped."""
    (out or console).print(f"[dim]{datetime.now():%H:%M:%S}[/] {message}", soft_wrap=True, highlight=False)


QUIET, DEFAULT, VERBOSE = -1, 0, 1


def verbosity(verbose: bool, quiet: bool) -> int:
    if verbose and quiet:
        raise typer.BadParameter("give -v (more) or -q (less), not both", param_hint="-v/-q")
    return VERBOSE if verbose else QUIET if quiet else DEFAULT


class TerminalProgress:
    """A long phase's steps (graph/lines.ProgressLine) as one progress bar in a terminal, updated in place, with the
    step's line as its description; elsewhere (a pipe, CI) each step is a line. Any other line ends the bar first,
    so lines never interleave with it; the run log keeps every step's line either way (graph/runs.logged)."""

    def __init__(self, out: Console | None = None) -> None:
        self.console = out or console
        self.bar = None  # rich.progress.Progress, while a phase's bar is shown
        self.phase: str | None = None
        self.task = None
        self.stopped_at_exit = False

    def __call__(self, message: str) -> None:
        from trainbridge.graph.lines import ProgressLine

        if not isinstance(message, ProgressLine) or not self.console.is_terminal:
            self.stop()
            say(message, self.console)
            return
        if self.bar is None or self.phase != message.phase:
            self.stop()
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            # no refresh thread and no redirected stdout: `--json -` and the outcome print as without a bar
            self.bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                                TimeElapsedColumn(), console=self.console, transient=False, auto_refresh=False,
                                redirect_stdout=False, redirect_stderr=False)
            self.phase = message.phase
            self.task = self.bar.add_task(message.strip(), total=message.total, completed=message.done)
            self.bar.start()
            if not self.stopped_at_exit:  # a run that ends mid-phase (an interrupt, an error) leaves no live display
                atexit.register(self.stop)
                self.stopped_at_exit = True
        self.bar.update(self.task, description=message.strip(), completed=message.done, total=message.total)
        self.bar.refresh()

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()  # its last state stays on the screen: the phase's last step
            self.bar, self.phase, self.task = None, None, None


def say_at(level: int, out: Console | None = None):
    """`say` for a run at this verbosity (graph/lines.py): -q keeps the verdict lines only, the default adds the
    phases and the gate's progress (a progress bar in a terminal: `TerminalProgress`), -v also a failed child's
    stderr tail. The run's log file keeps every line."""
    from trainbridge.graph.lines import Detail, VerdictLine

    show = TerminalProgress(out)

    def emit(message: str) -> None:
        if isinstance(message, Detail) and level < VERBOSE:
            return
        if level <= QUIET and not isinstance(message, VerdictLine):
            return
        show(message)

    return emit


def print_outcome(name: str, waiting: dict | None, state: dict, finished: bool, *, review_command: str,
                  where: str = "", show_report: bool = True, quiet: bool = False) -> bool:
    """A paused or finished run as the CLI shows it (local or served: `where` says on which machine the
    branch and report are); `quiet`: in one line. Returns False when the run is neither, for the caller to say
    what it is."""
    from trainbridge.graph.runs import summary_line

    if quiet and finished and waiting is None:
        report = next((p for p in state.get("report_paths") or [] if p.endswith("report.md")), None)
        console.print(f"run {name} finished: {state.get('stop_reason')}; {summary_line(state)}; branch {state.get('run_branch')}"
                      + (f"; report {report}" if report else ""), soft_wrap=True, markup=False, highlight=False)
        return True
    if waiting is not None:
        console.print(f"[yellow]paused for review[/] of candidate {waiting.get('candidate')} ({(waiting.get('intent') or {}).get('category')}); "
                      f"answer with: {review_command}", soft_wrap=True)
        return True
    if not finished:
        return False
    console.print(f"[green]run {name} finished[/]: {state.get('stop_reason')}; {summary_line(state)}", soft_wrap=True)
    console.print(f"branch: {state.get('run_branch')}" + (f" (in the repository {where})" if where else ""), soft_wrap=True)
    for path in state.get("report_paths") or []:
        if path.endswith("report.md"):
            console.print(f"report {where}: {path}" if where else f"report: {path}", soft_wrap=True)
            if show_report:
                print(Path(path).read_text(encoding="utf-8"))
    return True


def show_review(payload: dict, diff_to_stderr: bool = False) -> None:
    """The review payload (graph/review.py) as a person reads it: the patch, its intent and evidence, the figures so far
    (on stderr; the patch on stdout unless stdout carries JSON)."""
    intent = payload.get("intent") or {}
    where = ", ".join(f"{s['file']}:{s['line_start']}" for s in intent.get("spans") or [])
    console.print(f"candidate {payload['candidate']} — recipe {payload.get('recipe_id')} — intent {intent.get('category')} at {where}",
                  soft_wrap=True)
    console.print(f"evidence: {json.dumps(intent.get('evidence'), default=str)}", soft_wrap=True, highlight=False)
    measured = payload.get("measured") or {}
    if measured.get("baseline_step_s"):
        judged = [v for v in measured.get("verdicts") or [] if v.get("candidate")]
        console.print(f"so far: baseline step {measured['baseline_step_s'] * 1000:.1f} ms; {len(judged)} candidate(s) judged, "
                      f"{len(measured.get('accepted') or [])} accepted (gate ratios multiply to {measured.get('accepted_ratio_product', 1.0):.3f})",
                      soft_wrap=True, highlight=False)
        for verdict in judged:
            ratio = f", ratio {verdict['ratio']:.3f}" if verdict.get("ratio") else ""
            console.print(f"  {verdict['candidate']}: {verdict['reason']}{ratio}", soft_wrap=True, highlight=False)
    (console if diff_to_stderr else Console()).print(Syntax(payload.get("diff") or "", "diff"))


def answered(ask, unattended: str):
    """`ask()` (a typer prompt or confirm); when no answer can come (stdin closed: cron, a pipe, Ctrl-D) one line saying
    which options answer it instead, exit 1 (click said only 'Aborted!'). Ctrl-C is sandbox/termination.py's."""
    import signal

    try:
        return ask()
    except typer.Abort:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
            raise KeyboardInterrupt from None  # a Ctrl-C (read as Abort too): sandbox/termination.py has handled it
        _error(f"no answer (standard input is closed): nothing done; unattended, give the answer as options: {unattended}")
        raise typer.Exit(1) from None


def ask_decision(payload: dict, action: Optional[str], reason: Optional[str], patch_file: Optional[Path]) -> dict:
    """The resume value (review schema) from the options, asking for what is missing."""
    from trainbridge.graph.review import REVIEW_SCHEMA_VERSION

    unattended = "--action approve, --action reject --reason TEXT, or --action edit --patch FILE"
    action = action or answered(lambda: typer.prompt("approve, reject or edit", type=str), unattended)
    decision: dict = {"schema": REVIEW_SCHEMA_VERSION, "action": action}
    if action == "reject":
        decision["reason"] = reason or answered(lambda: typer.prompt("reason"), unattended)
    elif action == "edit":
        decision["patch"] = patch_file.read_text(encoding="utf-8") if patch_file else _edit_in_editor(payload.get("diff") or "")
    elif action != "approve":
        _error("action must be approve, reject or edit")
        raise typer.Exit(2)
    return decision


def _edit_in_editor(diff: str) -> str:
    editor = os.environ.get("EDITOR") or os.environ.get("VISUAL") or "vi"
    with tempfile.NamedTemporaryFile("w", suffix=".patch", delete=False) as handle:
        handle.write(diff)
    try:
        subprocess.run([*editor.split(), handle.name], check=True)
        return Path(handle.name).read_text(encoding="utf-8")
    finally:
        Path(handle.name).unlink(missing_ok=True)
