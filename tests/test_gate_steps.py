"""How many measured steps a gate child runs (agents/profiler/gate.gate_steps), and that the run's baseline step
time reaches the gate from the profiler node's call (agents/profiler/judge.py)."""

from __future__ import annotations

from pathlib import Path

from trainbridge.agents.profiler.gate import MIN_MEASURED_STEPS, gate_steps

TINY = Path(__file__).parent / "fixtures" / "workloads" / "tiny"


def test_long_steps_are_cut_to_a_second_of_measured_time_and_short_or_unknown_ones_are_not():
    assert gate_steps(8, None) == 8  # tests and benchmarks: the workload's own steps
    assert gate_steps(8, 0.0) == 8 and gate_steps(8, float("nan")) == 8
    assert gate_steps(8, 0.01) == 8  # short steps: measured time is cheap, keep every step
    assert gate_steps(8, 0.1) == 8
    assert gate_steps(8, 0.22) == MIN_MEASURED_STEPS == 6  # the llama example on this machine
    assert gate_steps(20, 0.05) == 16  # 0.8 s of measured time
    assert gate_steps(20, 5.0) == MIN_MEASURED_STEPS  # never fewer
    assert gate_steps(4, 5.0) == 4  # never more than the workload asks
    assert gate_steps(20, 0.8 / 6.5) == 8  # cut to an even count (7 would do): alternating steps get their middle


def test_the_judge_sizes_the_gates_children_by_the_runs_baseline_step(monkeypatch, tmp_path):
    import shutil

    from trainbridge.agents.profiler import judge

    root = tmp_path / "tiny"
    shutil.copytree(TINY, root)
    toml = root / "trainbridge.toml"
    toml.write_text(toml.read_text().replace("steps = 3", "steps = 10"), encoding="utf-8")
    seen: list[dict] = []
    monkeypatch.setattr(judge, "run_gate", lambda *args, **kwargs: seen.append(kwargs) or "verdict")
    assert judge.judge_candidate(root, root, target="cpu", rounds=6, max_rounds=12, min_gain=0.01, baseline_step_s=0.3) == "verdict"
    judge.judge_candidate(root, root, target="cpu", rounds=6, max_rounds=12, min_gain=0.01)
    assert [kw["steps_per_round"] for kw in seen] == [MIN_MEASURED_STEPS, 10]
