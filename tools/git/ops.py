"""Git operations for a TrainBridge run: run branch, candidate branches, worktrees.

The user's repository is never modified where they can see it: their working tree, index,
current branch, other branches and config stay byte-identical. TrainBridge only
- reads the user's checkout (plumbing, and `status` with `--no-optional-locks` so that not even
  the index's stat cache is rewritten),
- creates, moves and deletes refs under ``refs/heads/trainbridge/`` (every write is checked
  against that prefix, so nothing else can be reset, deleted or rewritten),
- adds linked worktrees under a workspace directory the caller gives, outside the user's tree
  (git keeps their admin files in ``.git/worktrees/``).

Branch names and the run-id rule: tools/git/names.py (re-exported here).

Every git call is an argument list through GitPython, with a fixed identity in the environment
and ``-c`` (CI has no global identity; the user's config is never written), hooks off, commit
signing off and automatic gc/maintenance off (our commands never run housekeeping on the user's
repository).

Crash-safety (a process killed at any point; calling the same operation again completes it):
- One TrainBridge process at a time per workspace: an ``flock`` on ``<workspace>/.git-ops.lock``
  (released by the kernel when the holder dies). Holding it, any ``index.lock``/``HEAD.lock``
  in the git admin folder of one of *our* worktrees, or a ``.lock`` of one of this run's refs,
  was left by a killed git and is removed once it is ``stale_lock_age_s`` old (a git child of a
  killed parent may still be finishing). Lock files anywhere else are never touched.
- Commits carry the trailers ``TrainBridge-Candidate: <name>`` and ``TrainBridge-Run: <id>``.
  `commit_candidate` stages everything, writes the tree, and reuses the candidate's existing
  commit when it has the same parent and tree (killed after the commit: no duplicate); it
  otherwise squashes its own earlier commits into one (killed between ``reset --soft`` and
  ``commit``: the next call commits once). A previous attempt's commit is remembered by
  `start_candidate`, so redoing the same edit after a restart gives back the same SHA.
- `accept_candidate` moves the run ref with a compare-and-swap ``update-ref`` and then deletes
  the candidate; a candidate already reachable from the run head, or already deleted but found
  by its trailer in the run's history, is reported as already accepted.
- `push_to_branch` finds an earlier push by the trailer on the side branch.
- Worktrees left half-made (locked "initializing", directory deleted, wrong branch) are removed
  and re-added; interrupted cherry-picks in our worktrees are reset.
"""

from __future__ import annotations

# The git layer's public API, from its one-concern modules: names (git_names), errors (git_errors),
# the one runner (git_runner), the user's repository (git_repo), results (git_records) and the run
# workspace (git_workspace; its folders, lock and recovery in git_worktrees).
from trainbridge.tools.git.errors import (  # noqa: F401
    CandidateConflict,
    CandidateNotFound,
    GitCommandFailed,
    GitOpsError,
    NotFastForward,
    NothingToAccept,
    UnsafeReason,
    UnsafeRepoState,
    WorkspaceBusy,
)
from trainbridge.tools.git.names import (  # noqa: F401
    BRANCH_PREFIX,
    RUN_ID_RULE,
    TRAILER_CANDIDATE,
    TRAILER_RUN,
    candidate_branch_name,
    check_name,
    check_run_id,
    run_branch_name,
    side_branch_name,
    valid_run_id,
)
from trainbridge.tools.git.records import (  # noqa: F401
    AcceptResult,
    CandidateWorkspace,
    CleanupResult,
    CommitResult,
    PushResult,
    RejectResult,
    RunInfo,
)
from trainbridge.tools.git.repo import UserRepo, open_repo  # noqa: F401
from trainbridge.tools.git.runner import Commit, GitIdentity, commits, ref_sha, run_git, run_git_status  # noqa: F401
from trainbridge.tools.git.workspace import RunWorkspace  # noqa: F401
