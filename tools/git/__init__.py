"""The one git layer: the repository, worktrees, run and candidate branches, commits, ignore rules."""
