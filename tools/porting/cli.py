"""`trainbridge port <repo> --to npu`: write an NPU port of a CUDA program somewhere reviewable.

The user's checkout is never modified. The port is written either into `--out` (an empty folder,
which gets a copy of the repository first, made a git repository with the original as its first commit and
the port as its second, so that `run` works on it at once; or a git worktree, whose files are ported in place), or,
with `--run-id`, onto the branch `trainbridge/<run>.port` through tools/git/ops.py's worktrees.
A rich table shows the changes and what could not be ported; JSON and markdown reports are written
beside the output.

Mount with `app.command("port")(port_command)` (or `app.add_typer(port_app)`).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Annotated

import typer
from pydantic import Field
from rich.console import Console
from rich.table import Table

from trainbridge.records import Record
from trainbridge.tools.git.names import valid_run_id
from trainbridge.tools.git.ops import GitOpsError
from trainbridge.tools.porting import RepoPortResult, port_repo
from trainbridge.tools.porting.repo import SKIP_DIRS
from trainbridge.settings import settings

TARGETS = ("npu",)
PORT_CANDIDATE = "port-npu"
PORT_BRANCH_SUFFIX = "port"


class PortError(Exception):
    """The port cannot be done as asked; the message says what to do instead."""


class PortOutcome(Record):
    repo: Path
    target: str
    dry_run: bool
    out_dir: Path | None = Field(description="where the ported tree is (None for a dry run)")
    files_written: list[str] = Field(default_factory=list)
    report_json: Path | None = None
    report_md: Path | None = None
    branch: str | None = Field(default=None, description="trainbridge/<run>.port when committed")
    commit: str | None = None
    result: RepoPortResult

    @property
    def blocking(self) -> int:
        return sum(1 for s in self.result.skipped if s.blocking)


# ---------------------------------------------------------------- core (no printing)


def ports_root() -> Path:
    """Workspaces of `port --run-id`: $TRAINBRIDGE_HOME/ports, else the per-user data folder's."""
    return settings().data_dir("ports")


def _check_target(to: str) -> None:
    if to not in TARGETS:
        raise PortError(f"cannot port to {to!r}: supported targets are {', '.join(TARGETS)} (use --to npu)")


def _outside(out_dir: Path, repo: Path) -> None:
    out, root = Path(os.path.realpath(out_dir)), Path(os.path.realpath(repo))
    if out == root or out.is_relative_to(root) or root.is_relative_to(out):
        raise PortError(f"output {out_dir} overlaps the repository {repo}: writing there would change your checkout. "
                        "Pass an empty folder outside it, or a git worktree (e.g. made with "
                        "`git worktree add ../port-npu`), or use --run-id to get a trainbridge/<run>.port branch.")


def _prepare_tree(repo: Path, out_dir: Path) -> None:
    """An empty/missing `out_dir` gets a copy of the repo; a git worktree is ported in place."""
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        ignore = shutil.ignore_patterns(*SKIP_DIRS, "*.egg-info", "*.pyc")
        shutil.copytree(repo, out_dir, symlinks=True, ignore=ignore, dirs_exist_ok=True)
    elif not (out_dir / ".git").exists():
        raise PortError(f"{out_dir} is neither empty nor a git worktree; TrainBridge will not overwrite files in it. "
                        "Pass an empty (or new) folder, or a worktree of the repository.")


def write_port(root: Path, result: RepoPortResult) -> list[str]:
    """Write the ported files of `result` into `root`; returns their repo-relative paths."""
    written = []
    for ported in result.changed_files:
        (root / ported.file).write_text(ported.source, encoding="utf-8")
        written.append(ported.file)
    return written


def default_out_dir(repo: Path, to: str) -> Path:
    """Where a port goes without --out: a new folder beside the repository, `<repo>-<target>`."""
    root = Path(os.path.realpath(repo))
    return root.parent / f"{root.name}-{to}"


def run_port(repo: Path, *, to: str = "npu", out_dir: Path | None = None, dry_run: bool = False,
             report_dir: Path | None = None) -> PortOutcome:
    """Port `repo` into `out_dir` (default `<repo>-<to>` beside it; or only report, with `dry_run`); the repo
    itself is only read."""
    _check_target(to)
    repo = Path(repo)
    if not repo.is_dir():
        raise PortError(f"{repo} is not a directory: pass the root of the repository to port")
    if dry_run:
        outcome = PortOutcome(repo=repo, target=to, dry_run=True, out_dir=None, result=port_repo(repo))
        return write_reports(outcome, report_dir) if report_dir is not None else outcome
    if out_dir is None:
        out_dir = default_out_dir(repo, to)
        if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / ".git").is_file():  # (a linked worktree's .git is a file)
            raise PortError(f"{out_dir} (the default output, beside the repository) already holds files, perhaps an "
                            "earlier port: remove it, or pass --out <empty folder or git worktree>, --run-id <id> for a "
                            "trainbridge/<run>.port branch, or --dry-run to only see the report")
    _outside(out_dir, repo)
    copied = not (out_dir / ".git").exists()
    _prepare_tree(repo, out_dir)
    if copied:  # a git repository, so that `run`, `init` and a diff work on it at once: the original, then the port
        from trainbridge.tools.git.repo import new_repository

        new_repository(out_dir, f"the original, copied from {Path(os.path.realpath(repo))} by trainbridge port")
    result = port_repo(out_dir)
    outcome = PortOutcome(repo=repo, target=to, dry_run=False, out_dir=out_dir, files_written=write_port(out_dir, result),
                          result=result)
    if copied:
        from trainbridge.tools.git.repo import commit_everything

        commit_everything(out_dir, f"ported to {to} by trainbridge port ({len(outcome.files_written)} file(s) rewritten)")
    default_reports = out_dir.parent / f"{out_dir.name}.port-report"
    return write_reports(outcome, report_dir or default_reports)


def port_in_workspace(workspace, *, to: str = "npu", report_dir: Path | None = None) -> PortOutcome:
    """Port on a candidate of `workspace` (a git_ops.RunWorkspace) and put it on `trainbridge/<run>.port`.

    Safe to repeat: a second call finds the port commit on that branch by its trailer.
    """
    _check_target(to)
    candidate = workspace.start_candidate(PORT_CANDIDATE)
    result = port_repo(candidate.path)
    written = write_port(candidate.path, result)
    blocking = sum(1 for s in result.skipped if s.blocking)
    message = (f"Port CUDA to {to} (trainbridge port)\n\n{len(result.changes)} change(s) in {len(written)} file(s); "
               f"{len(result.skipped)} construct(s) not ported, {blocking} of them need manual work (see the report).")
    commit = workspace.commit_candidate(PORT_CANDIDATE, message)
    branch = sha = None
    if commit.empty:
        workspace.reject_candidate(PORT_CANDIDATE)
    else:
        pushed = workspace.push_to_branch(PORT_CANDIDATE, suffix=PORT_BRANCH_SUFFIX)
        branch, sha = pushed.branch, pushed.sha
    outcome = PortOutcome(repo=workspace.repo.root, target=to, dry_run=False, out_dir=None, files_written=written,
                          branch=branch, commit=sha, result=result)
    return write_reports(outcome, report_dir or workspace.root / "port-report")


def port_to_branch(repo: Path, run_id: str, workspace_root: Path, *, to: str = "npu",
                   report_dir: Path | None = None) -> PortOutcome:
    """Open the user's repo (refusing unsafe states), make the run workspace, port onto its .port branch."""
    from trainbridge.tools.git.ops import RunWorkspace, open_repo  # noqa: PLC0415 - only this path needs git

    _check_target(to)
    workspace = RunWorkspace.create_run(open_repo(repo), run_id, workspace_root=workspace_root)
    return port_in_workspace(workspace, to=to, report_dir=report_dir)


# ---------------------------------------------------------------- reports


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(outcome: PortOutcome) -> str:
    result = outcome.result
    skipped = sorted(result.skipped, key=lambda s: (s.file, s.line))
    blocking = [s for s in skipped if s.blocking]
    harmless = [s for s in skipped if not s.blocking]
    if outcome.branch:
        where = f"branch `{outcome.branch}` (commit {(outcome.commit or '')[:12]})"
    elif outcome.out_dir:
        where = f"`{outcome.out_dir}`"
    else:
        where = "nothing written (dry run)"
    lines = [f"# TrainBridge port of `{outcome.repo}` to {outcome.target}", "",
             f"- Output: {where}",
             f"- {len(result.changes)} change(s) in {len(result.changed_files)} file(s) "
             f"(of {len(result.files)} Python files)",
             f"- {len(result.skipped)} construct(s) not ported: {len(blocking)} need manual work, "
             f"{len(harmless)} are harmless on the {outcome.target}", ""]
    for title, items in (("Not ported: needs manual work", blocking), ("Not ported: harmless as it is", harmless)):
        if items:
            lines += [f"## {title}", "", "| location | category | code | why / what to do |", "|---|---|---|---|"]
            lines += [f"| `{s.location}` | {s.category} | `{_cell(s.code)}` | {_cell(s.reason)} |" for s in items]
            lines.append("")
    if result.changes:
        lines += ["## Changes", "", "| location | kind | before | after |", "|---|---|---|---|"]
        lines += [f"| `{c.file}:{c.line}` | {c.kind} | `{_cell(c.before)}` | `{_cell(c.after)}` |"
                  for c in result.changes]
        lines.append("")
    reviewed = [c for c in result.changes if c.review]
    if reviewed:
        lines += ["## To review: precision and behaviour notes", "", "| location | kind | note |", "|---|---|---|"]
        lines += [f"| `{c.file}:{c.line}` | {c.kind} | {_cell(c.review)} |" for c in reviewed]
        lines.append("")
    return "\n".join(lines)


def report_payload(outcome: PortOutcome) -> dict:
    result = outcome.result
    return {
        "repo": str(outcome.repo), "target": outcome.target, "dry_run": outcome.dry_run,
        "out_dir": str(outcome.out_dir) if outcome.out_dir else None, "branch": outcome.branch,
        "commit": outcome.commit, "files_written": outcome.files_written,
        "changes": [c.model_dump(mode="json") for c in result.changes],
        "skipped": [s.model_dump(mode="json") for s in result.skipped],
    }


def write_reports(outcome: PortOutcome, report_dir: Path) -> PortOutcome:
    report_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = report_dir / "port-report.json", report_dir / "port-report.md"
    outcome = outcome.model_copy(update={"report_json": json_path, "report_md": md_path})
    json_path.write_text(json.dumps(report_payload(outcome), indent=2) + "\n", encoding="utf-8")
    md_path.write_text(render_markdown(outcome), encoding="utf-8")
    return outcome


def print_outcome(outcome: PortOutcome, console: Console) -> None:
    result = outcome.result
    changes = Table(title=f"Ported to {outcome.target}: {len(result.changes)} change(s)", show_lines=False)
    for column in ("location", "kind", "before", "after"):
        changes.add_column(column, overflow="fold")
    for c in result.changes:
        changes.add_row(f"{c.file}:{c.line}", c.kind.value, c.before, c.after)
    skipped = Table(title=f"Not ported: {len(result.skipped)} ({outcome.blocking} need manual work)")
    for column in ("location", "category", "manual", "code", "why / what to do"):
        skipped.add_column(column, overflow="fold")
    for s in sorted(result.skipped, key=lambda s: (s.file, s.line)):
        skipped.add_row(s.location, s.category.value, "yes" if s.blocking else "no", s.code, s.reason)
    console.print(changes)
    console.print(skipped)
    if outcome.branch:
        console.print(f"committed {(outcome.commit or '')[:12]} on [bold]{outcome.branch}[/]")
    elif outcome.out_dir:
        console.print(f"wrote {len(outcome.files_written)} file(s) into {outcome.out_dir}")
    else:
        console.print("dry run: nothing written")
    if outcome.report_md:
        console.print(f"report: {outcome.report_md} and {outcome.report_json}")


# ---------------------------------------------------------------- command


def port_command(
    repo: Annotated[Path, typer.Argument(help="The CUDA program's repository (read only).")],
    to: Annotated[str, typer.Option("--to", help="Target device.")] = "npu",
    out_dir: Annotated[Path | None, typer.Option("--out", help="Empty folder or git worktree to write the port into (default: a new folder <repo>-<target> beside the repository).")] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", callback=valid_run_id, help="Commit the port on trainbridge/<run-id>.port.")] = None,
    workspace: Annotated[Path | None, typer.Option("--workspace", help="Workspace for --run-id worktrees "
                                                   "(default <TRAINBRIDGE_HOME>/ports/<run-id>).")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only report; write nothing.")] = False,
    report_dir: Annotated[Path | None, typer.Option("--report-dir", help="Where port-report.{json,md} go.")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when anything needs manual work.")] = False,
) -> None:
    """Rewrite a CUDA training program for the Ascend NPU and report what could not be ported."""
    console = Console()
    try:
        if run_id is not None and not dry_run:
            if out_dir is not None:
                raise PortError("--out and --run-id are alternatives: pass one of them")
            root = workspace or ports_root() / run_id
            outcome = port_to_branch(repo, run_id, root, to=to, report_dir=report_dir)
        else:
            outcome = run_port(repo, to=to, out_dir=out_dir, dry_run=dry_run, report_dir=report_dir)
    except (PortError, GitOpsError) as exc:
        Console(stderr=True).print(str(exc), style="red", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    print_outcome(outcome, console)
    if strict and outcome.blocking:
        raise typer.Exit(1)


port_app = typer.Typer(add_completion=False, no_args_is_help=True)
port_app.command("port")(port_command)
