"""The gate's conduct checks and drift tolerances as pure functions, and the kernel-side watch on real processes.

(The red team, tests/test_gate_red_team.py, runs them end to end on planted candidates.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from trainbridge.agents.profiler import conduct
from trainbridge.agents.profiler import drift as caps
from trainbridge.agents.profiler.drift import (DriftCache, GateDrift, TimedDrift, capped_note, capped_widening, not_repeating, timed_drift,
                                               widen_for_drift)
from trainbridge.agents.profiler.integrity import FindingKind, check_timed_deltas
from trainbridge.agents.profiler.numerics import NumericsResult, NumericsTolerance, ParamGradDiff
from trainbridge.sandbox import proc_watch
from trainbridge.sandbox.results import ChildWatch, RunResult


def run(step_s: float, inner_s: float, *, n: int = 8, span: tuple[float, float] | None = None, **watch) -> RunResult:
    parent_span = step_s * (n - 1)
    return RunResult(mode="entry", backend="cpu", device="cpu", seed=1, threads=1, warmup_steps=0, timing_source="parent",
                     step_times_s=[step_s] * n, inner_step_times_s=[inner_s] * n,
                     clock_span_s=span if span is not None else (parent_span, parent_span * inner_s / step_s),
                     watch=ChildWatch(**watch))


def kinds(findings) -> list[str]:
    return [f.kind.value for f in findings]


def test_clock_check_flags_a_slow_or_fast_child_clock_but_not_scheduling_delays():
    assert conduct.check_clock(run(0.020, 0.0195), "r") == []
    # a busy machine: the parent waits ~4 ms for a core around every step; the child's clock is right
    assert conduct.check_clock(run(0.012, 0.0075, span=(0.084, 0.0835)), "r") == []
    assert kinds(conduct.check_clock(run(0.020, 0.010), "r")) == ["tampered_timing"]  # rate 0.5
    assert kinds(conduct.check_clock(run(0.020, 0.030), "r")) == ["tampered_timing"]  # a clock that runs fast
    # a clock slowed only inside the step, its rate kept: the per-step comparison sees it
    finding, = conduct.check_clock(run(0.040, 0.012, span=(0.28, 0.28)), "r")
    assert finding.kind == FindingKind.tampered_timing and "12.00 ms" in finding.message
    child_timed = run(0.020, 0.010)
    child_timed.timing_source = "child"
    assert conduct.check_clock(child_timed, "r") == []  # nothing to compare against


def test_replaced_names_count_only_beyond_the_baselines():
    base = run(0.02, 0.02, replaced=["torch.manual_seed"])  # torch itself rebinds this on first optimizer step
    assert conduct.check_replaced(base, run(0.02, 0.02, replaced=["torch.manual_seed"]), "r") == []
    found = conduct.check_replaced(base, run(0.02, 0.02, replaced=["time.perf_counter", "trainbridge.sandbox.numerics_probe.run_numerics",
                                                                   "torch.Tensor.item"]), "r")
    assert kinds(found) == ["tampered_timing", "tampered_harness", "tampered_harness"]
    assert "time.perf_counter" in found[0].message and "run_numerics" in found[1].message


def test_resource_checks_name_what_was_taken():
    base = run(0.02, 0.02, cores_used=0.98, wall_s=1.0, helper_cpu_s=0.0, threads_in_use=1)
    assert conduct.check_resources(base, run(0.02, 0.02, cores_used=1.1, wall_s=1.0, helper_cpu_s=0.0, threads_in_use=1), 1, "r") == []
    cores, = conduct.check_resources(base, run(0.02, 0.02, cores_used=1.9, wall_s=1.0, helper_cpu_s=0.0, threads_in_use=1), 1, "r")
    assert cores.kind == FindingKind.tampered_resources and "1.90 cores" in cores.message
    threads, = conduct.check_resources(base, run(0.02, 0.02, cores_used=1.0, wall_s=1.0, threads_in_use=2), 1, "r")
    assert "2 threads" in threads.message
    helpers = conduct.check_resources(base, run(0.02, 0.02, cores_used=1.0, wall_s=1.0, helper_cpu_s=0.5, extra_processes=[4]), 1, "r")
    assert "helper processes" in helpers[0].message
    raised, = conduct.check_resources(base, run(0.02, 0.02, raised_priority=["a thread of the child runs at nice -5"]), 1, "r")
    assert "nice -5" in raised.message
    left, = conduct.check_resources(base, run(0.02, 0.02, survivors=["pid 7 (session 7, process group 7)"]), 1, "r")
    assert "left processes running" in left.message
    # a baseline that uses two cores itself (its own helper processes) allows the candidate as much
    busy = run(0.02, 0.02, cores_used=1.95, wall_s=1.0, helper_cpu_s=0.9, threads_in_use=1)
    assert conduct.check_resources(busy, run(0.02, 0.02, cores_used=1.9, wall_s=1.0, helper_cpu_s=0.9, threads_in_use=1), 1, "r") == []


def test_protocol_and_written_files(tmp_path):
    assert conduct.check_protocol(run(0.02, 0.02), "r") == []
    assert kinds(conduct.check_protocol(run(0.02, 0.02, protocol_violations=["extra line"]), "r")) == ["tampered_harness"]
    (tmp_path / "a.py").write_text("x")
    before = conduct.snapshot_tree(tmp_path)
    (tmp_path / ".runs").write_text("1")
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "index").write_text("ignored")
    written = conduct.changed_files(before, conduct.snapshot_tree(tmp_path))
    assert written == [".runs"]
    assert kinds(conduct.check_written_files(set(), written, "r")) == ["tampered_harness"]
    assert conduct.check_written_files({".runs"}, written, "r") == []  # the baseline writes it too


def test_timed_deltas_catch_skipped_and_different_updates():
    base = {"w": torch.tensor([1.0, -2.0, 0.5]), "b": torch.tensor([0.1])}
    same = {"w": torch.tensor([1.0, -2.0, 0.5000001]), "b": torch.tensor([0.1])}
    assert check_timed_deltas(1, [], [], base, same, 0.99, 0.1) == []
    skipped, = check_timed_deltas(1, [], ["w"], base, {"w": torch.zeros(3), "b": base["b"]}, 0.99, 0.1)
    assert skipped.kind == FindingKind.skipped_work and "left 1 parameter(s) unchanged" in skipped.message
    turned, = check_timed_deltas(1, [], [], base, {"w": torch.tensor([1.0, 2.0, 0.5]), "b": base["b"]}, 0.99, 0.1)
    assert "'w' differently" in turned.message
    halved, = check_timed_deltas(1, [], [], base, {"w": base["w"] / 2, "b": base["b"]}, 0.99, 0.1)
    assert "size differs by 50.00%" in halved.message


def test_drift_widens_tolerances_to_ten_times_the_baselines_own_and_never_tightens():
    drift = timed_drift([1.0, 0.9], [1.0, 0.9 * (1 + 1e-7)], {"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([1.0, 0.0])})
    assert drift.loss_max_rel_diff == pytest.approx(1e-7) and drift.delta_cosine_min == pytest.approx(1.0)
    probe = NumericsResult(passed=True, message="", seed=1, batch_indices=[0], tolerance=NumericsTolerance(), baseline_losses=[1.0],
                           candidate_losses=[1.0], baseline_grad_loss=1.0, candidate_grad_loss=1.0, loss_max_rel_diff=0.0)
    base = NumericsTolerance()
    stable = widen_for_drift(base, probe, drift)
    assert stable.timed_loss_rtol == base.timed_loss_rtol and stable.timed_delta_cosine_min == base.timed_delta_cosine_min
    chaotic = widen_for_drift(base, probe, TimedDrift(loss_max_rel_diff=0.002, delta_cosine_min=0.995, delta_norm_max_rel_diff=0.02))
    assert chaotic.timed_loss_rtol == pytest.approx(0.02) and chaotic.timed_delta_cosine_min == pytest.approx(0.95)
    assert chaotic.timed_delta_norm_rtol == pytest.approx(0.2)


def test_no_drift_widens_a_check_past_its_cap_and_the_verdict_says_so():
    def probe(loss: float, params: list) -> NumericsResult:
        return NumericsResult(passed=True, message="", seed=1, batch_indices=[0], tolerance=NumericsTolerance(), baseline_losses=[1.0],
                              candidate_losses=[1.0 + loss], baseline_grad_loss=1.0, candidate_grad_loss=1.0 + loss, loss_max_rel_diff=loss,
                              params=params)

    quiet = probe(6e-6, [ParamGradDiff(name="w", shape=[2], cosine=1 - 1e-9, max_abs_diff=1e-7, baseline_max_abs=1.0, passed=True)])
    wild = probe(0.03, [ParamGradDiff(name="w", shape=[2], cosine=0.5, max_abs_diff=0.5, baseline_max_abs=1.0, passed=False)])
    resnet = TimedDrift(loss_max_rel_diff=0.0165, delta_cosine_min=0.984, delta_norm_max_rel_diff=0.01)  # the honest drift
    forged = TimedDrift(loss_max_rel_diff=0.3, delta_cosine_min=0.0, delta_norm_max_rel_diff=0.5)  # evidence copied over the reference's
    base = NumericsTolerance()
    widened, capped = capped_widening(base, quiet, resnet)
    assert widened.timed_loss_rtol == caps.TIMED_LOSS_RTOL_CAP and widened.timed_delta_cosine_min == caps.TIMED_DELTA_COSINE_FLOOR
    assert (widened.loss_rtol, widened.grad_rtol, widened.grad_cosine_min) == (base.loss_rtol, base.grad_rtol, base.grad_cosine_min)
    assert widened.timed_delta_norm_rtol == pytest.approx(0.1)
    assert capped == ["timed_loss_rtol 0.165 capped at 0.05", "timed_delta_cosine_min 0.84 capped at 0.9"]
    worst, capped_worst = capped_widening(base, wild, forged)
    assert (worst.loss_rtol, worst.grad_rtol, worst.grad_cosine_min) == (caps.LOSS_RTOL_CAP, caps.GRAD_RTOL_CAP, caps.GRAD_COSINE_FLOOR)
    assert worst.timed_delta_cosine_min == caps.TIMED_DELTA_COSINE_FLOOR and worst.timed_delta_norm_rtol == caps.TIMED_DELTA_NORM_RTOL_CAP
    assert worst.timed_loss_rtol == caps.TIMED_LOSS_RTOL_CAP and len(capped_worst) == 6
    probe = quiet
    recipe = NumericsTolerance(loss_rtol=0.08, grad_rtol=0.05, grad_cosine_min=0.99)  # a recipe's own wider tolerances stand
    kept = widen_for_drift(recipe, wild, forged)
    assert (kept.loss_rtol, kept.grad_rtol, kept.grad_cosine_min, kept.timed_loss_rtol) == (0.08, 0.05, 0.99, 0.08)
    gate_drift = GateDrift(perturbation="threads=2 vs 1", probe=probe, timed=resnet, margin=caps.MARGIN, tolerance=widened, capped=capped)
    note = capped_note(gate_drift)
    assert "threads=2 vs 1" in note and "timed_loss_rtol 0.165 capped at 0.05" in note
    assert capped_note(gate_drift.model_copy(update={"capped": []})) == ""
    cache = DriftCache()
    cache.put("key", gate_drift)
    assert cache.get("key", base).capped == capped  # a reused drift is capped the same way


def test_a_probe_drift_beyond_rounding_says_the_baseline_does_not_repeat_itself():
    def probe(base: list[float], other: list[float]) -> NumericsResult:
        rel = max(abs(b - o) / abs(b) for b, o in zip(base, other))
        return NumericsResult(passed=True, message="", seed=1, batch_indices=[0, 1, 2], tolerance=NumericsTolerance(),
                              baseline_losses=base, candidate_losses=other, baseline_grad_loss=base[0],
                              candidate_grad_loss=other[0], loss_max_rel_diff=rel)

    assert not_repeating(probe([1.0, 0.9, 0.8], [1.0, 0.9 * (1 + 6e-6), 0.8]), "threads=1 vs 2") is None  # resnet's drift
    assert not_repeating(probe([1.0, 0.9, 0.8], [1.0, 0.9, 0.8 * 1.04]), "threads=1 vs 2") is None  # four percent: still rounding
    other_order = not_repeating(probe([19.2, 10.9, 8.6], [7.6, 15.2, 9.2]), "threads=1 vs 2")
    assert other_order is not None and "differ by up to 60.4% over 3 steps" in other_order and "threads=1 vs 2" in other_order


@pytest.mark.skipif(not proc_watch.available(), reason="needs Linux /proc")
def test_watch_finds_a_process_that_escaped_its_process_group_and_reads_cpu_and_priority():
    assert proc_watch.become_subreaper()
    script = ("import os, subprocess, sys, time\n"
              "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'], start_new_session=True)\n"
              "time.sleep(0.5)\n")
    child = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    since = proc_watch.read_stat(child.pid).start_ticks
    child.wait(timeout=30)  # the parent of the sleeper is gone: the sleeper is orphaned, in its own session
    time.sleep(0.2)
    escaped = proc_watch.descendants(child.pid, reaper_pid=os.getpid(), since_ticks=since)
    assert escaped and all(s.sid != child.pid and s.ppid == os.getpid() for s in escaped)  # handed to us, the subreaper
    proc_watch.kill_all(escaped)
    for stat in escaped:
        os.waitpid(stat.pid, 0)
    # busy until it has used 0.3 s of CPU, however loaded the machine (a wall-clock loop got 32 ms of a 0.5 s wait on a
    # host at load 6), then alive and idle while it is sampled
    busy = subprocess.Popen([sys.executable, "-c", "import time\nwhile time.process_time() < 0.3: pass\n"
                             "print('ready', flush=True)\ntime.sleep(30)"], stdout=subprocess.PIPE, text=True)
    assert busy.stdout.readline().strip() == "ready"
    sample = proc_watch.sample_tree(busy.pid, base_nice=os.getpriority(os.PRIO_PROCESS, 0), reaper_pid=None, since_ticks=None)
    busy.kill()
    busy.wait()
    assert sample is not None and sample.cpu_ns > 0.1e9 and sample.raised_priority == []
