"""Script mode: the user's own launch line, run unmodified under a launcher outside the repository
(steps found through the optimizer's step hooks, seeds under the gate's control, overrides)."""
