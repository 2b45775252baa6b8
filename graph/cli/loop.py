"""CLI commands of the loop: run, resume, status, review, report, demo, verify. Mounted on the root app by cli.py."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

import typer
from pydantic import ValidationError

from trainbridge.graph.cli.display import DEFAULT, QUIET, answered, ask_decision, print_outcome, say as _say, say_at, show_review, verbosity
from trainbridge.graph.cli.json_output import json_option, outcome_condition, run_record, to_stdout, write_json
from trainbridge.graph.cli.inputs import TargetChoice, config_errors, default_run_id, examples_dir, parse_duration, valid_run_id
from trainbridge.graph.cli.serve import review_on_server, run_on_server, served_run_status
from trainbridge.graph.cli.terminal import console
from trainbridge.graph.cli.terminal import error as _error
from trainbridge.sandbox.termination import Terminated

CHECKPOINT_HELP = ("Postgres URL of the run's checkpoints (postgresql://user@host:5432/db; the password in PGPASSWORD or ~/.pgpass); "
                   "a run checkpointed there can be shown, reviewed, resumed and reported from any machine that reaches the "
                   "database and the repository (default: TRAINBRIDGE_CHECKPOINT, else the run's SQLite file).")


# RunConfig's fields that `run` sets from an option of another name (the rest are --field-name)
RUN_OPTIONS = {"budget_s": "--budget", "gate_rounds": "--rounds", "reference_pack": "--reference", "categories": "--category",
               "compile_reference": "--no-reference", "launch": "the launch line after --", "repo": "REPO"}


def _checkpoint_option():
    return typer.Option(None, "--checkpoint", help=CHECKPOINT_HELP)


def _checkpoint_url(given: Optional[str]) -> Optional[str]:
    from trainbridge.graph.checkpoints import default_checkpoint

    try:
        return default_checkpoint(given)
    except ValueError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None


def _report_outcome(outcome, json_out: Optional[Path] = None, level: int = DEFAULT) -> None:
    """The outcome for a person (the report's markdown on stdout unless stdout carries the JSON, or -q), and the run's
    record for `--json`."""
    if not print_outcome(outcome.run_id, outcome.waiting_for_review, outcome.state, outcome.finished,
                         review_command=f"trainbridge review {outcome.run_id}", show_report=not to_stdout(json_out) and level > QUIET,
                         quiet=level <= QUIET):
        console.print(f"run {outcome.run_id} stopped at {outcome.state.get('node')}; continue with: trainbridge resume {outcome.run_id}")
    write_json(json_out, run_record(outcome.run_id, outcome.state, condition=outcome_condition(outcome)))


def _verbose_option():
    return typer.Option(False, "--verbose", "-v", help="Also show a failed candidate's stderr tail (the gate's progress lines are shown by default).")


def _quiet_option():
    return typer.Option(False, "--quiet", "-q", help="Show only the verdict lines and the final line (run.log in the run's folder keeps every line).")


def run(
    repo: Path = typer.Argument(..., help="The git checkout of the training repository (never modified; work happens in worktrees)."),
    target: TargetChoice = typer.Option(TargetChoice.cpu, "--target", "-t", help="Backend to optimise for (npu without an NPU: numerics verified by emulation, speed unmeasured)."),
    budget: str = typer.Option("8h", help="Wall-clock budget, e.g. 8h, 90m, 1h30m."),
    max_candidates: int = typer.Option(50, help="Stop after this many candidates were judged."),
    review: bool = typer.Option(False, "--review", help="Pause at every patch for a person to approve, reject (with a reason) or edit it (`trainbridge review`)."),
    reference: Optional[Path] = typer.Option(None, "--reference", help="Evidence pack from `trainbridge collect-evidence` instead of compiling here."),
    no_reference: bool = typer.Option(False, "--no-reference", help="Skip the torch.compile reference (faster analysis, coarser ranking)."),
    kb_url: Optional[str] = typer.Option(None, "--kb-url", help="Shared knowledge base on a Chroma server, e.g. http://kb-host:8000."),
    kb_dir: Optional[Path] = typer.Option(None, "--kb-dir", help="Embedded knowledge base directory (default: per user)."),
    run_id: Optional[str] = typer.Option(None, "--run-id", callback=valid_run_id, help="Name of the run: 1-64 letters, digits, '_' or '-', starting with a letter or digit (default: <repo>-<timestamp>)."),
    min_gain: float = typer.Option(0.01, help="Smallest step-time gain to accept (0.01 = 1%)."),
    rounds: int = typer.Option(10, help="Interleaved A/B rounds per candidate in the gate: it looks at 6, 8, ... rounds up to twice this many, and stops at the first look that decides (6 when every round agrees)."),
    final_rounds: int = typer.Option(6, help="Interleaved rounds of the closing comparison: original, final head and torch.compile of the original (0: a single plain measurement)."),
    category: Optional[list[str]] = typer.Option(None, "--category", help="Only intents of this category (repeatable)."),
    server: Optional[str] = typer.Option(None, "--server", help="Submit the run to the LangGraph server at this URL (`trainbridge serve`) instead of running it here; REPO and the other paths are read on the server's machine. Ctrl-C detaches, the run goes on."),
    checkpoint: Optional[str] = typer.Option(None, "--checkpoint", help="Keep the run's checkpoints in this Postgres database (postgresql://user@host:5432/db; the password in PGPASSWORD or ~/.pgpass) instead of the SQLite file in the run's folder: any machine that reaches the database and the repository can then show, review, resume and report it. Default: TRAINBRIDGE_CHECKPOINT."),
    devices: Optional[str] = typer.Option(None, "--devices", help="Judge up to this many candidates at once, each gate on a slot of its own: cpu:2 (two slots of pinned cores), cuda:0,1, npu:0-7. The run branch still moves one verified commit at a time."),
    unconfined: bool = typer.Option(False, "--unconfined", envvar="TRAINBRIDGE_UNCONFINED", help="Judge candidates even where this machine cannot confine them (no bubblewrap or no user namespaces; without this such a run is refused): they can then write wherever you can and see your processes. Every verdict and the report say so."),
    ray: Optional[str] = typer.Option(None, "--ray", help="Run the gates as Ray tasks on this cluster (auto, or its address), each asking for one device; pip install 'trainbridge\\[team]'."),
    json_out: Optional[Path] = json_option("run's record when the command returns (finished, paused or failed: its accepted commits, verdicts, closing comparison, report paths)"),
    verbose: bool = _verbose_option(),
    quiet: bool = _quiet_option(),
    launch: Optional[list[str]] = typer.Argument(None, metavar="[-- LAUNCH...]", help="Script mode: the command the repository trains with, after `--` (e.g. `-- python train.py --batch_size=4`); replaces trainbridge.toml's launch/entry/command for this run (a trainbridge.toml, when committed, still gives steps, data and overrides)."),
) -> None:
    """Run the whole loop on a repository: analyse, rewrite, gate, keep what is faster; leave a branch and a report.

    Checkpointed after every step: if the process dies, `trainbridge resume <run-id>` continues without duplicate commits or lost verdicts.
    With --server URL the run is a thread on that LangGraph server: answer its reviews with `trainbridge review --server URL <run-id>`.
    """
    from trainbridge.graph.runs import RunError, start_run
    from trainbridge.graph.state import RunConfig

    repo, target = repo.resolve(), TargetChoice(target).value
    level = verbosity(verbose, quiet)
    say = say_at(level)
    line = None
    if launch:
        from trainbridge.graph.cli.workload import launch_line
        from trainbridge.sandbox.script.launch import LaunchError, parse_launch

        line = launch_line(launch)
        try:
            parse_launch(line)
        except LaunchError as exc:
            _error(str(exc))
            raise typer.Exit(2) from None
    name = run_id or default_run_id(repo.name)
    try:
        config = RunConfig(repo=str(repo), run_id=name, target=target, budget_s=parse_duration(budget, "--budget"), max_candidates=max_candidates,
                           review=review, reference_pack=str(reference.resolve()) if reference else None,
                           compile_reference=not no_reference, kb_url=kb_url, kb_dir=str(kb_dir) if kb_dir else None,
                           min_gain=min_gain, gate_rounds=rounds, final_rounds=final_rounds, categories=category or None,
                           launch=line, checkpoint=_checkpoint_url(checkpoint), devices=devices, ray=ray,
                           unconfined=unconfined)
    except ValidationError as exc:
        _error(config_errors(exc, RUN_OPTIONS))
        raise typer.Exit(2) from None
    except ValueError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    if server:
        run_on_server(server, config)
        return
    from trainbridge.graph.preflight import RunInputError, check_run_input

    from trainbridge.knowledge.store_records import KnowledgeBaseError

    try:  # before anything of the run exists: a bad repository or knowledge base leaves no run record behind
        for note in check_run_input(config):
            say(note)
        check_knowledge_base(config)
    except (RunInputError, KnowledgeBaseError) as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    say(f"run {name} on {repo} (target {target}); resume with: trainbridge resume {name}")
    try:
        outcome = start_run(config, say=say)
    except RunError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    except _stopping_errors() as exc:
        _error(f"run {name} stopped: {exc}\n(fix the cause, then: trainbridge resume {name}; or remove the run, its branches "
               f"and worktrees: trainbridge rm {name})")
        write_json(json_out, run_record(name, {}, condition="failed", error=str(exc)))
        raise typer.Exit(1) from None
    except (KeyboardInterrupt, Terminated):  # Ctrl-C or SIGTERM (sandbox/termination.py ends the processes after this)
        _error(f"run {name} interrupted; its last checkpoint is kept: continue it with `trainbridge resume {name}`")
        raise
    _report_outcome(outcome, json_out, level)


def check_knowledge_base(config) -> None:
    """Open the run's knowledge base once before the run starts: a damaged folder or a server that does not answer
    stops it here in one line (KnowledgeBaseError says what to do), not at its first retrieval after the baseline and
    the analysis, with a traceback."""
    from trainbridge.knowledge.store import KnowledgeBase

    kb = KnowledgeBase.connect(config.kb_url) if config.kb_url else KnowledgeBase(config.kb_dir)
    kb.close()


def run_condition(info: dict, run_id: str) -> str:
    """Running (its pid), waiting for review, finished, failed (the cause) or stopped (where), in words."""
    resume = f"`trainbridge resume {run_id}`"
    if info.get("running_pid"):
        return f"running (pid {info['running_pid']}); next: {', '.join(info['next']) or '-'}"
    if info["waiting_for_review"]:
        return "waiting for review"
    if info["finished"]:
        return "finished"
    failure = info.get("failure")
    if failure:
        return (f"failed at {', '.join(failure.get('node') or info['next']) or 'its start'} ({failure.get('type')}: "
                f"{failure.get('error')}); fix the cause, then {resume}, or remove it with `trainbridge rm {run_id}`")
    if not info["state"]:
        return f"stopped before its first step; continue with {resume}"
    return f"stopped; next: {', '.join(info['next'])}; continue with {resume}"


def _stopping_errors() -> tuple[type[BaseException], ...]:
    """Errors that stop a run with a message the user can act on (no traceback)."""
    from trainbridge.agents.analyst.analyze import AnalysisError
    from trainbridge.agents.coder.llm.config import LLMConfigError
    from trainbridge.graph.stops import RunStopped
    from trainbridge.knowledge.store_records import KnowledgeBaseError
    from trainbridge.sandbox.workload import WorkloadConfigError
    from trainbridge.tools.git.ops import UnsafeRepoState

    return (AnalysisError, KnowledgeBaseError, LLMConfigError, RunStopped, UnsafeRepoState, WorkloadConfigError)


def resume(run_id: str = typer.Argument(..., callback=valid_run_id, help="The run to continue."),
           checkpoint: Optional[str] = _checkpoint_option(),
           budget: Optional[str] = typer.Option(None, "--budget", help="A new time budget from now (e.g. 90m, 8h); default: what the run had left when it stopped (the time it was down is not counted)."),
           json_out: Optional[Path] = json_option("run's record when the command returns (as `run --json` writes it)"),
           verbose: bool = _verbose_option(),
           quiet: bool = _quiet_option()) -> None:
    """Continue a run that was stopped or killed, from its last checkpoint (here or, with --checkpoint, in Postgres)."""
    from trainbridge.graph.runs import RunError, resume_run

    level = verbosity(verbose, quiet)
    budget_s = parse_duration(budget, "--budget") if budget is not None else None
    try:
        outcome = resume_run(run_id, say=say_at(level), checkpoint=_checkpoint_url(checkpoint), budget_s=budget_s)
    except RunError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    except _stopping_errors() as exc:
        _error(f"run {run_id} stopped: {exc}")
        write_json(json_out, run_record(run_id, {}, condition="failed", error=str(exc)))
        raise typer.Exit(1) from None
    except (KeyboardInterrupt, Terminated):
        _error(f"run {run_id} interrupted; its last checkpoint is kept: continue it with `trainbridge resume {run_id}`")
        raise
    _report_outcome(outcome, json_out, level)


def remove(run_id: str = typer.Argument(..., callback=valid_run_id, help="The run to remove."),
           yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask."),
           json_out: Optional[Path] = json_option("removal's record (worktrees and branches removed, branches kept and why, the folder)")) -> None:
    """Remove a run: its worktrees, its trainbridge/<run-id> branches and its folder (settings, checkpoints, report).

    Never touches your own branches, checkout or uncommitted work; a run branch you have checked out stays (named). Refused while the run is running.
    """
    from trainbridge.graph.runs import RunError, remove_run

    if not yes and not answered(lambda: typer.confirm(f"Remove run {run_id} (its branches, worktrees and report)?", default=False),
                                f"trainbridge rm {run_id} --yes"):
        _error(f"nothing removed (run {run_id} stays; `trainbridge rm {run_id} --yes` removes it without asking)")
        raise typer.Exit(1)
    try:
        removal = remove_run(run_id)
    except RunError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    git = removal.git
    write_json(json_out, {"run_id": run_id, "folder": str(removal.folder), "notes": removal.notes,
                          "removed_worktrees": [str(p) for p in git.removed_worktrees] if git else [],
                          "removed_branches": list(git.removed_branches) if git else [],
                          "kept_branches": dict(git.kept_branches) if git else {}})
    if removal.git is not None:
        _say(f"removed {len(removal.git.removed_worktrees)} worktree(s) and {len(removal.git.removed_branches)} branch(es)"
             + (f": {', '.join(removal.git.removed_branches)}" if removal.git.removed_branches else ""))
        for branch, why in removal.git.kept_branches.items():
            _say(f"kept {branch}: {why} (switch that checkout to another branch, then `git branch -D {branch}`)")
    for note in removal.notes:
        _say(f"note: {note}")
    _say(f"removed {removal.folder}")


def status(run_id: Optional[str] = typer.Argument(None, callback=valid_run_id, help="A run (default: list all runs)."),
           checkpoint: Optional[str] = _checkpoint_option(),
           json_out: Optional[Path] = json_option("status (a list of them without a run id)")) -> None:
    """Where a run stands: current node, intents done/left, candidates, accepted speedup so far (a served run: asked of its server)."""
    from trainbridge.graph.runs import run_status, summary_line
    from trainbridge.graph.state import runs_root

    url = _checkpoint_url(checkpoint)
    if run_id is None:
        runs = sorted(p.name for p in runs_root().glob("*") if (p / "run.json").is_file())
        if url is not None:  # and the runs checkpointed in the team's database, from wherever they started
            from trainbridge.graph.checkpoints import CheckpointError, database_runs

            try:
                runs = sorted(set(runs) | set(database_runs(url)))
            except CheckpointError as exc:
                _error(str(exc))
                raise typer.Exit(2) from None
        listed = []
        for name in runs:
            try:
                info = served_run_status(name, url) or run_status(name, checkpoint=url)
                listed.append(status_record(info, name))
                if not to_stdout(json_out):
                    print(f"{name}: {run_condition(info, name)}; {summary_line(info['state'])}")
            except Exception as exc:  # one broken run must not hide the others
                listed.append({"run_id": name, "condition": f"unreadable ({exc})"})
                if not to_stdout(json_out):
                    print(f"{name}: unreadable ({exc})")
        if not runs and not to_stdout(json_out):
            print(f"no runs under {runs_root()}")
        write_json(json_out, listed)
        return
    info = _status_of(run_id, url)
    record = status_record(info, run_id)
    write_json(json_out, record)
    if to_stdout(json_out):
        return
    print(f"run {run_id}: {record['condition']}")
    if info.get("server"):
        print(f"served by the LangGraph server at {info['server']} (thread {info['thread_id']})")
    print(summary_line(info["state"]))
    if record["baseline_step_s"]:
        product = record["accepted_ratio_product"]
        print(f"baseline step {record['baseline_step_s'] * 1000:.1f} ms; accepted commits' gate ratios multiply to "
              f"{product:.3f} ({1 / product:.2f}x faster, each measured per commit against the head before it)")


def status_record(info: dict, run_id: str) -> dict:
    """A run's status as one JSON-ready record (`status --json`)."""
    state = info["state"]
    accepted = state.get("accepted") or []
    product = 1.0
    for record in accepted:
        product *= record.get("ratio") or 1.0
    from trainbridge.graph.runs import intents_left

    return {"run_id": run_id, "condition": run_condition(info, run_id), "finished": info.get("finished"),
            "waiting_for_review": info.get("waiting_for_review") is not None, "running_pid": info.get("running_pid"),
            "failure": info.get("failure"), "next": info.get("next"), "node": state.get("node"),
            "baseline_step_s": state.get("baseline_step_s"), "candidates_tried": state.get("candidates_tried") or 0,
            "intents_left": intents_left(state),
            "accepted": [{k: a.get(k) for k in ("candidate", "recipe_id", "sha", "ratio")} for a in accepted],
            "accepted_ratio_product": product}


def _status_of(run_id: str, checkpoint: Optional[str]) -> dict:
    """A run's status: asked of its server when it is served, else read from its checkpoints (the local
    SQLite file, or the Postgres database of --checkpoint / TRAINBRIDGE_CHECKPOINT)."""
    from trainbridge.graph.runs import RunError, run_status

    try:
        return served_run_status(run_id, checkpoint) or run_status(run_id, checkpoint=checkpoint)
    except RunError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None


def review_cmd(
    run_id: str = typer.Argument(..., callback=valid_run_id, help="A run paused for review (with --server: its run id or its server thread id)."),
    action: Optional[str] = typer.Option(None, "--action", help="approve, reject or edit (default: ask)."),
    reason: Optional[str] = typer.Option(None, "--reason", help="Why it is rejected (reaches the coder and the knowledge base)."),
    patch_file: Optional[Path] = typer.Option(None, "--patch", help="For edit: the replacement patch (default: open $EDITOR on the current one)."),
    server: Optional[str] = typer.Option(None, "--server", help="The run is on the LangGraph server at this URL (`trainbridge run --server`, Studio)."),
    checkpoint: Optional[str] = _checkpoint_option(),
    json_out: Optional[Path] = json_option("run's record when the run stops again (as `run --json` writes it; not with --server)"),
    verbose: bool = _verbose_option(),
    quiet: bool = _quiet_option(),
) -> None:
    """Show the patch a paused run waits on, and approve, reject (with a reason) or edit it; then the run continues.

    The same review, payload and answer whether the run is local or on a LangGraph server (--server URL)."""
    level = verbosity(verbose, quiet)
    if server:
        if json_out is not None or level != DEFAULT:
            _error("--json, -v and -q are for a local run's review; a served run's lines come from its server")
            raise typer.Exit(2)
        review_on_server(server, run_id, action, reason, patch_file)
        return
    from trainbridge.graph.runs import RunError, answer_review, run_status

    url = _checkpoint_url(checkpoint)
    try:
        info = run_status(run_id, checkpoint=url)
    except RunError as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    payload = info["waiting_for_review"]
    if payload is None:
        _error(f"run {run_id} is not waiting for a review")
        raise typer.Exit(2)
    show_review(payload, diff_to_stderr=to_stdout(json_out))
    decision = ask_decision(payload, action, reason, patch_file)
    try:
        outcome = answer_review(run_id, decision, say=say_at(level), checkpoint=url)
    except (RunError, ValueError) as exc:
        _error(str(exc))
        raise typer.Exit(2) from None
    _report_outcome(outcome, json_out, level)


def report_cmd(run_id: str = typer.Argument(..., callback=valid_run_id, help="The run."),
               checkpoint: Optional[str] = _checkpoint_option(),
               json_out: Optional[Path] = json_option("run's record (its figures, accepted commits, verdicts and report paths)")) -> None:
    """Print where a finished run's report is, and its markdown."""
    info = _status_of(run_id, _checkpoint_url(checkpoint))
    paths = info["state"].get("report_paths") or []
    if not paths:
        _error(f"run {run_id} has no report yet (it is written when the run ends)")
        raise typer.Exit(1)
    write_json(json_out, run_record(run_id, info["state"], condition=run_condition(info, run_id)))
    if to_stdout(json_out):
        return
    for path in paths:
        console.print(path)
    if not Path(paths[0]).is_file():
        _error(f"the report is on the machine that finished the run ({paths[0]}); this one does not see that path")
        raise typer.Exit(1)
    print(Path(paths[0]).read_text(encoding="utf-8"))


# The loop stops before a typical gate would overrun this; a last gate that takes its second look can still
# run ~1 gate past it, and the closing comparison follows: 13 minutes keep the whole demo under 15.
DEMO_BUDGET_S = 13 * 60


def demo(
    example: str = typer.Argument("llama_pretrain", help="Bundled example to optimise."),
    target: str = typer.Option("cpu", "--target", "-t", help="cpu (measured) or npu (emulated here: numerics only)."),
    rounds: int = typer.Option(8, help="Interleaved A/B rounds per candidate."),
    max_candidates: int = typer.Option(12, help="Stop after this many candidates."),
    kb_dir: Optional[Path] = typer.Option(None, "--kb-dir", help="Knowledge base to use and record the demo's verdicts in (default: a fresh one beside the demo repository, so your own knowledge base is left alone)."),
    kb_url: Optional[str] = typer.Option(None, "--kb-url", help="A Chroma server's knowledge base instead (e.g. http://kb-host:8000)."),
) -> None:
    """Copy a bundled example into a temporary git repository and run the whole loop on it; print where the branch and report are.

    The demo records its verdicts in a knowledge base of its own unless --kb-dir or --kb-url says otherwise."""
    from trainbridge.graph.runs import start_run
    from trainbridge.graph.state import RunConfig
    from trainbridge.tools.git.ops import GitIdentity, run_git

    source = examples_dir() / example
    if not (source / "trainbridge.toml").is_file():
        _error(f"no bundled example {example!r}")
        raise typer.Exit(2)
    folder = Path(tempfile.mkdtemp(prefix=f"trainbridge-demo-{example}-"))
    repo = folder / example
    shutil.copytree(source, repo, ignore=shutil.ignore_patterns("__pycache__"))
    demo_author = GitIdentity(name="TrainBridge demo", email="demo@localhost")
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-qm", f"{example} as shipped")):
        run_git(repo, *args, identity=demo_author)
    run_id = default_run_id(f"demo-{example}".replace("_", "-"))
    started = time.monotonic()
    _say(f"demo repository: {repo}")
    kb = {"kb_url": kb_url} if kb_url else {"kb_dir": str((kb_dir or folder / "kb").expanduser().resolve())}
    _say(f"demo knowledge base: {kb.get('kb_url') or kb['kb_dir']}")
    outcome = start_run(RunConfig(repo=str(repo), run_id=run_id, target=target, gate_rounds=rounds, max_candidates=max_candidates,
                                  budget_s=DEMO_BUDGET_S, **kb), say=_say)
    _report_outcome(outcome)
    coverage = outcome.state.get("intent_coverage") or {}
    reached = ("it reached every intent that has a recipe" if coverage.get("every_intent_with_a_recipe") else
               f"{len(coverage.get('left_with_recipe') or [])} intent(s) with a recipe not reached" if coverage else "")
    console.print(f"demo finished in {time.monotonic() - started:.0f} s{f'; {reached}' if reached else ''}; repository {repo}, "
                  f"branch {outcome.state.get('run_branch')}", soft_wrap=True)


def verify(run_id: str = typer.Argument(..., callback=valid_run_id, help="A run whose NPU candidates wait on trainbridge/<run-id>.pending-npu."),
           json_out: Optional[Path] = json_option("verification's record (every replayed candidate's decision, the run branch before and after)"),
           verbose: bool = _verbose_option(),
           quiet: bool = _quiet_option()) -> None:
    """On an NPU host: replay the pending NPU candidates through the full gate (numerics + timing) and fast-forward the accepted ones onto the run branch.

    Prints each decision as a JSON line on stdout (or, with --json, the whole record there or in a file, and nothing else)."""
    from trainbridge.graph.runs import RunError
    from trainbridge.graph.verify import VerifyError, VerifyRefused, verify_run

    level = verbosity(verbose, quiet)
    try:
        report = verify_run(run_id, say=say_at(level))
    except (VerifyRefused, RunError) as exc:  # no NPU here, or no such run: exit 2 as every command's bad input
        _error(str(exc))
        raise typer.Exit(2) from None
    except VerifyError as exc:
        _error(str(exc))
        raise typer.Exit(1) from None
    write_json(json_out, report.model_dump(mode="json"))
    if json_out is None:
        for outcome in report.outcomes:
            print(json.dumps(outcome.model_dump(mode="json"), default=str))
    console.print(f"run branch {report.run_head_before[:12]} -> {report.run_head_after[:12]}; decisions in {report.record_path}", soft_wrap=True)
