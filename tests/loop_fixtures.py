"""A small, fast workload for loop tests: a committed git repository and a planted wrong recipe.

The repository (tests/fixtures/loop/repo) is a wide MLP whose hand-written tanh GELU dominates the
step, so the seed recipe `gelu-tanh-functional` gives a large, reliably measurable gain; its
hand-written RMSNorm is the target of the test-only recipe `rmsnorm-as-l2-normalize`
(tests/fixtures/loop/recipes), whose replacement changes the math and must be rejected with
numerics_mismatch. With `loop_config`, those two recipes are the only ones tried, so every decision
in a run is deterministic: one accept (the step about halves, against a 5% `min_gain`), one
numerics rejection. No closing three-arm comparison (`final_rounds=0`: one plain measurement of the
final head; tests/test_final_comparison.py covers the comparison). Eight gate rounds of ten steps: with six, the signed-rank test needs every
round to agree, and one round hit by another process's load on a shared machine flips the verdict.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from trainbridge.graph.state import RunConfig
from trainbridge.sandbox.confinement import bubblewrap

LOOP_FIXTURES = Path(__file__).parent / "fixtures" / "loop"
REPO_FIXTURE = LOOP_FIXTURES / "repo"
RECIPES_FIXTURE = LOOP_FIXTURES / "recipes"
GOOD_RECIPE = "gelu-tanh-functional"  # seed recipe: rewrites model.py's gelu
WRONG_RECIPE = "rmsnorm-as-l2-normalize"  # planted: rewrites RMSNorm.forward into different math
# What every uninterrupted run of this workload decides, as (category, recipe, accepted, reason) in
# sorted order (tests/team_support.py's outcome_view): numerics decide the planted recipe, GELU halves the step.
DECISIONS = sorted([("gelu", GOOD_RECIPE, True, "accepted"), ("rmsnorm", WRONG_RECIPE, False, "numerics_mismatch")])
# The verdicts of a speed comparison whose numerics passed. The runs that test something other than the gate's power
# (two gates at once on two cores, a run killed and resumed elsewhere) hold GELU to one of these, not to "accepted":
# the same sequential gate read its ratio at 0.42, 0.44, 0.57 and 0.77 on a quiet machine and 0.99 once in a full
# suite, each with a tight interval (the allocator's state differs between the gate's processes: an open gate
# problem), and CI read it not significant or slower twice. tests/test_loop.py's reference run holds it to DECISIONS.
TIMING_REASONS = ("accepted", "not_significant", "slower")


def decided_by_construction(view: list[tuple]) -> bool:
    """`view` (team_support.outcome_view) decides what the workload decides by construction: the planted recipe
    rejected for its numerics, and GELU judged on speed with its numerics passed (accepted or not, consistently)."""
    return (len(view) == 2 and view[1] == DECISIONS[1] and view[0][:2] == DECISIONS[0][:2]
            and view[0][3] in TIMING_REASONS and view[0][2] == (view[0][3] == "accepted"))
USER_NAME, USER_EMAIL = "Loop Tester", "loop-tester@example.com"


def git(repo: Path, *args: str) -> str:
    """Run git in `repo` (argument list, no shell) and return its stripped stdout."""
    done = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}: {done.stderr.strip()}")
    return done.stdout.strip()


def make_loop_repo(path: Path, *, branch: str = "main") -> Path:
    """Copy the loop workload to `path`, make it a git repository with one commit, return `path`."""
    shutil.copytree(REPO_FIXTURE, path, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    git(path, "init", "-q", f"--initial-branch={branch}")
    git(path, "config", "user.name", USER_NAME)
    git(path, "config", "user.email", USER_EMAIL)
    (path / ".gitignore").write_text("__pycache__/\n", encoding="utf-8")
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "wide MLP with a hand-written GELU and RMSNorm")
    return path


def add_user_changes(repo: Path) -> dict[str, str]:
    """Uncommitted work of the user (a modified tracked file and an untracked one); returns the
    expected file contents so a test can check TrainBridge left them alone."""
    readme = repo / "NOTES.md"
    readme.write_text("my notes, not committed\n", encoding="utf-8")
    train = repo / "train.py"
    train.write_text(train.read_text(encoding="utf-8") + "\n# local experiment, not committed\n", encoding="utf-8")
    return {"NOTES.md": readme.read_text(encoding="utf-8"), "train.py": train.read_text(encoding="utf-8")}


def write_wrong_recipe(directory: Path) -> Path:
    """Put the planted wrong recipe in `directory` (a RunConfig's extra_recipe_dir); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for recipe in RECIPES_FIXTURE.glob("*.yaml"):
        shutil.copy(recipe, directory / recipe.name)
    return directory


def loop_config(repo: Path, run_id: str, tmp: Path, **overrides) -> RunConfig:
    """Settings that make a loop run short and its decisions deterministic (see the module doc)."""
    settings = dict(
        repo=str(repo), run_id=run_id, target="cpu", compile_reference=False,
        kb_dir=str(tmp / "kb"), extra_recipe_dir=str(write_wrong_recipe(tmp / "recipes")),
        recipe_ids=[GOOD_RECIPE, WRONG_RECIPE], gate_rounds=8, min_gain=0.05, low_gain_rounds_to_stop=5,
        max_candidates=10, budget_s=1800, final_rounds=0, unconfined=not bubblewrap().usable,
    )
    settings.update(overrides)
    return RunConfig(**settings)
