"""The loop's typed state, its settings, and where a run keeps its files.

State is one TypedDict of JSON-able values (checkpointed after every node); lists that only grow
(verdicts, accepted commits, finished intents) have an `operator.add` reducer, so a node returns
just what it adds.
"""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from typing_extensions import TypedDict  # pydantic (the LangGraph server's schema export) needs it on Python < 3.12

from trainbridge.tools.git.names import check_run_id
from trainbridge.settings import settings



def gathered(held: list[dict[str, Any]] | None, new: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Reducer of the parallel gates' verdicts: each gate adds its own; None (the merge) empties the list."""
    return [] if new is None else [*(held or []), *new]


def merged(held: dict[str, Any] | None, new: dict[str, Any] | None) -> dict[str, Any]:
    """Reducer of `intent_evidence`: a later analysis adds its intents and updates those it found again."""
    return {**(held or {}), **(new or {})}


class RunConfig(BaseModel):
    """Settings of one run. Unknown keys are rejected so a typo fails at start, not at 3 a.m."""

    model_config = ConfigDict(extra="forbid")

    repo: str = Field(description="the user's repository (never modified)")
    run_id: str
    target: Literal["cpu", "cuda", "npu"] = "cpu"
    budget_s: float = Field(default=8 * 3600, gt=0, description="wall-clock budget of the whole run")
    budget_origin: float | None = Field(default=None, description="set by a resume, never saved: the run's elapsed time "
                                        "counts from this time (the time it was down not counted; `resume --budget` "
                                        "restarts the clock) instead of from started_at")
    max_candidates: int = Field(default=50, ge=1)
    review: bool = False
    reference_pack: str | None = None
    compile_reference: bool = True
    kb_url: str | None = None
    kb_dir: str | None = None
    min_gain: float = Field(default=0.01, ge=0, lt=1, description="smallest accepted step-time gain (0.01 = 1%)")
    gate_rounds: int = Field(default=10, ge=2)
    gate_max_rounds: int | None = Field(default=None, ge=2, description="the gate's last look (its looks run 6, 8, ... up to this; "
                                        "None: twice gate_rounds)")
    low_gain_rounds_to_stop: int = Field(default=2, ge=1)
    final_rounds: int = Field(default=6, ge=0, description="interleaved rounds of the end-to-end comparison (original, final "
                              "head, torch.compile of the original) when something was accepted; 0: one plain measurement")
    categories: list[str] | None = Field(default=None, description="only these intent categories (None: all)")
    recipe_ids: list[str] | None = Field(default=None, description="only these recipes (None: all)")
    extra_recipe_dir: str | None = Field(default=None, description="more recipe files to load (e.g. a team's)")
    launch: str | None = Field(default=None, description="script mode from `run <repo> -- LAUNCH`: this launch line replaces "
                               "trainbridge.toml's launch/entry/command in every worktree (the file, when there is one, gives "
                               "the other keys)")
    checkpoint: str | None = Field(default=None, description="Postgres URL of the checkpoints (no password: PGPASSWORD or "
                                   "~/.pgpass); None: SQLite in the run's folder")
    workspace_dir: str | None = Field(default=None, description="where the run's git worktrees live (None: the run's folder); "
                                      "recorded for a Postgres run so that another machine resumes in the same worktrees")
    devices: str | None = Field(default=None, description="gate slots: cpu:2, cuda:0,1, npu:0-7 (None: one gate at a time)")
    ray: str | None = Field(default=None, description="run the gates as Ray tasks on this cluster: auto or an address")
    unconfined: bool = Field(default=False, description="judge candidates even where the sandbox cannot confine them (no "
                             "bubblewrap, or no user namespaces): without it such a run is refused; with it every gate "
                             "verdict and the report say the candidates ran unconfined")

    def workload(self, root: Path):
        """The workload at `root` (a worktree of the run) as this run runs it."""
        from trainbridge.sandbox.workload import load_workload, workload_for_launch

        return workload_for_launch(root, self.launch) if self.launch else load_workload(root)

    @property
    def gate_rounds_limit(self) -> int:
        return max(self.gate_rounds, self.gate_max_rounds or 2 * self.gate_rounds)

    @field_validator("checkpoint")
    @classmethod
    def _checkpoint(cls, value: str | None) -> str | None:
        from trainbridge.graph.checkpoints import check_checkpoint_url

        return check_checkpoint_url(value)

    @field_validator("devices")
    @classmethod
    def _devices(cls, value: str | None) -> str | None:
        if value is not None:
            from trainbridge.graph.team.devices import parse_devices

            parse_devices(value)  # raises ValueError with the syntax
        return value

    @model_validator(mode="after")
    def _review_one_at_a_time(self) -> "RunConfig":
        from trainbridge.graph.team.devices import slot_count

        if self.review and (self.ray is not None or slot_count(self.devices) > 1):
            raise ValueError("--review pauses at every patch, one at a time: leave out --devices/--ray for a reviewed run")
        return self

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return check_run_id(value)  # the git layer's rule: an id valid here is a valid branch name there


class RunState(TypedDict, total=False):
    run_id: str
    settings: dict[str, Any] | None  # the RunConfig the run started with (another machine reads it from a Postgres checkpoint)
    node: str  # the node that last finished (for `trainbridge status`)
    base_sha: str
    run_branch: str
    started_at: float
    ported: dict[str, Any] | None  # the NPU port commit (target npu), made before the baseline
    baseline_step_s: float | None
    determinism: dict | None  # script mode: sandbox/script_determinism.DeterminismReport of the unmodified program (prepare)
    reference_step_s: float | None  # torch.compile of the original (the line the report draws)
    baseline_kernels: int | None  # NPU kernels per step of the unmodified program, counted on the emulated device (prepare)
    reference_kernels: dict[str, int] | None  # the torch.compile reference's kernels per step by phase (forward, backward)
    eager_ops_before: int | None
    eager_ops_now: int | None
    eager_ops_sha: str | None  # the head the last analysis counted `eager_ops_now` on (the report says "after" only for the final head)
    intents: list[dict[str, Any]]  # ranked Intent dumps from the latest analysis
    intent_evidence: Annotated[dict[str, dict[str, Any]], merged]  # every intent any analysis found: its evidence, by id
    tried_sites: Annotated[list[str], operator.add]  # recipe@site of every verdict (agents/retrieval/sites.py): not tried again
    done_intents: Annotated[list[str], operator.add]
    current_intent: dict[str, Any] | None
    recipe_queue: list[str]  # ranked recipe ids left to try for the current intent
    candidate: dict[str, Any] | None  # name, recipe_id, intent_id, sha, diff, files, site
    review_feedback: str | None
    review_decision: dict[str, Any] | None
    verdict: dict[str, Any] | None  # the gate's verdict on the current candidate
    verdicts: Annotated[list[dict[str, Any]], operator.add]  # every decided candidate, in order
    accepted: Annotated[list[dict[str, Any]], operator.add]
    candidates_tried: int
    analyses: int
    low_gain_rounds: int
    stop_reason: str | None
    report_paths: list[str]
    final_comparison: dict[str, Any] | None  # agents.profiler.final.FinalComparison, written by the report node
    intent_coverage: dict[str, Any] | None  # agents.retrieval.choose.IntentCoverage.as_record(), written by the report node
    # parallel gates (graph/team/fanout.py): the intents being worked, the batch being judged and against which head,
    # the verdicts of its gates (any order; None resets), whether the last merge moved the run branch
    parallel: bool  # gates side by side (--devices with more than one slot, or --ray): the batch path
    lanes: list[dict[str, Any]]
    batch: list[dict[str, Any]]
    batch_head: str | None
    gate_results: Annotated[list[dict[str, Any]], gathered]
    landed: bool
    # wall time of every node run, in order: {"node", "wall_s", "parts": {phase: seconds}} (the loop's own cost)
    phase_times: Annotated[list[dict[str, Any]], operator.add]


def runs_root() -> Path:
    """Per-user home of runs (checkpoints, worktrees, reports); TRAINBRIDGE_HOME overrides."""
    return settings().data_dir("runs")


class RunPaths:
    """Files of one run: its settings, checkpoint database, git workspace and report."""

    def __init__(self, run_id: str, root: Path | None = None):
        self.dir = (root or runs_root()) / run_id

    @property
    def config(self) -> Path:
        return self.dir / "run.json"

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints.sqlite"

    @property
    def workspace(self) -> Path:
        return self.dir / "workspace"

    @property
    def report(self) -> Path:
        return self.dir / "report"
