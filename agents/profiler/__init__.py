"""The profiler gate: numerics first, then A/B-interleaved timing, then a typed `Verdict`.

Modules: `stats` (paired ratios, bootstrap interval, signed-rank test, the speed decision),
`numerics` (gradient and loss comparison, tolerance calibration), `integrity` (signs that a
candidate games the gate), `verdict` (the record), `gate` (`run_gate`, which runs the children).
"""
