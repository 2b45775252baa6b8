"""Inductor evidence: capture a compiled step, parse its output code and traces into fusion groups."""
