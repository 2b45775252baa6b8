"""A team's engines: gates fanned out over a host's devices and over hosts on Ray, and the rebase
that keeps the run branch one verified commit at a time."""
