"""A run's input checked before anything of the run exists (no run record, checkpoint or branch):
the repository, its committed `trainbridge.toml`, the evidence pack, the LLM settings. Every message names the
user's own paths (never a copy in a run's worktree) and says what to do."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from trainbridge.graph.state import RunConfig


class RunInputError(ValueError):
    """The run's input is unusable; the message names the user's path and the fix."""


def check_run_input(config: RunConfig, env: Mapping[str, str] | None = None) -> list[str]:
    """Raise RunInputError for input the run would fail on later; return notes worth showing. `env`:
    where the LLM settings are read (default os.environ, as the run reads them)."""
    from trainbridge.agents.coder.llm.config import LLMConfig, LLMConfigError
    from trainbridge.sandbox.workload import CONFIG_FILE, WorkloadConfigError
    from trainbridge.tools.git.ops import GitOpsError, open_repo, run_git_status

    repo = Path(config.repo).expanduser()
    if not repo.exists():
        raise RunInputError(f"{repo} does not exist: pass the path of your training repository's git checkout")
    if not repo.is_dir():
        raise RunInputError(f"{repo} is not a directory: pass the root of your training repository's git checkout")
    try:
        user = open_repo(repo)
    except GitOpsError as exc:
        raise RunInputError(str(exc)) from None
    toml = user.root / CONFIG_FILE
    committed = run_git_status(user.root, "show", f"HEAD:{CONFIG_FILE}", strip=False)
    if not toml.is_file() and committed[0] != 0 and not config.launch:
        raise RunInputError(f"{toml} does not exist: write one that says how to run one training step (see the "
                            "README's section on trainbridge.toml; `trainbridge init` writes one), commit it, and run "
                            "again; or give the launch line: trainbridge run <repo> -- python train.py ...")
    try:
        workload = config.workload(user.root)  # the user's own file, so errors point at it (file:line)
    except WorkloadConfigError as exc:
        raise RunInputError(str(exc)) from None
    if workload.config.mode == "script":
        from trainbridge.sandbox.script.launch import LaunchError
        from trainbridge.sandbox.script.run import launch_problem

        try:
            problem = launch_problem(workload)
        except LaunchError as exc:
            problem = str(exc)
        if problem:
            raise RunInputError(problem)
    if config.launch and not toml.is_file() and committed[0] != 0:
        pass  # script mode from the command line, no trainbridge.toml: nothing more to check
    elif committed[0] != 0:
        raise RunInputError(f"{toml} is not committed: the run starts from the last commit ({user.head_sha[:12]}), "
                            f"which has no {CONFIG_FILE}. Commit it (`git add {CONFIG_FILE} && git commit`) and run again")
    elif not toml.is_file() or committed[1] != toml.read_text(encoding="utf-8"):
        raise RunInputError(f"{toml} has uncommitted changes (or was deleted): the run starts from the last commit "
                            f"({user.head_sha[:12]}), whose {CONFIG_FILE} differs. Commit the change (or "
                            f"`git stash` it) and run again")
    if config.reference_pack and not Path(config.reference_pack).is_file():
        raise RunInputError(f"evidence pack {config.reference_pack} does not exist: pass the .tar.gz written by "
                            "`trainbridge collect-evidence`, or leave --reference out")
    if config.extra_recipe_dir and not Path(config.extra_recipe_dir).is_dir():
        raise RunInputError(f"recipe folder {config.extra_recipe_dir} does not exist")
    try:
        LLMConfig.from_env(env if env is not None else os.environ)  # half-set LLM variables fail here, not mid-run
    except LLMConfigError as exc:
        raise RunInputError(str(exc)) from None
    return [*confinement_notes(config), *user.notes, *rounds_notes(config), *shown_files_notes(workload, user.root)]


def shown_files_notes(workload, checkout: Path) -> list[str]:
    """Script mode: which files of the checkout outside git every run shows the script, read-only (zero config:
    sandbox/script/ignored.py)."""
    if workload.config.mode != "script":
        return []
    from trainbridge.sandbox.script.ignored import ignored_inputs

    return ignored_inputs(checkout).notes(workload.config.data)


def rounds_notes(config: RunConfig) -> list[str]:
    """A gate that can look at no more than 5 rounds can call nothing faster: its exact signed-rank test's smallest
    p-value over n rounds is 2**-n, above the one-sided 2.5% from n <= 5 on (numerics still decide)."""
    from trainbridge.agents.profiler.sequential import FIRST_LOOK

    if config.gate_rounds_limit >= FIRST_LOOK:
        return []
    return [f"--rounds {config.gate_rounds} lets the gate look at {config.gate_rounds_limit} rounds at most: too few for it to "
            f"call any candidate faster (it needs {FIRST_LOOK}); this run can reject candidates but never accept one"]


def confinement_notes(config: RunConfig) -> list[str]:
    """Refuse a run whose candidates this machine cannot confine (sandbox/confinement.py), unless it asked to run them
    unconfined; the note a run that did so shows."""
    from trainbridge.sandbox.confinement import bubblewrap

    tool = bubblewrap()
    if tool.usable:
        return []
    if not config.unconfined:
        raise RunInputError(
            f"this machine cannot confine the code the gate runs: {tool.reason}. Candidates (recipes from the knowledge base "
            "and LLM patches alike) are untrusted code: install bubblewrap (apt-get install bubblewrap, dnf install "
            "bubblewrap) and allow unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), then run "
            "again; or pass --unconfined (TRAINBRIDGE_UNCONFINED=1) to judge them unconfined, which every verdict and the "
            "report then say")
    return [f"UNCONFINED: candidates run without the sandbox's confinement ({tool.reason}): a candidate can write "
            "wherever you can and see every process of yours (--unconfined)"]
