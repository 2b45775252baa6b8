"""The region lab (agents/profiler/region_lab.py, sandbox/region_bench.py) on the small workload of
tests/fixtures/region_lab/base: a method region (Norm.forward) and a function region (mix).

Each test copies the workload into a baseline and a candidate folder and plants the candidate's
rewrite in its text. Planted effects are large (a region repeated 20 times), so decisions hold on a
loaded machine; every child is a real sandboxed process.
"""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest

from trainbridge.agents.profiler import judge as judge_module
from trainbridge.agents.profiler.judge import judge_candidate
from trainbridge.agents.profiler.region_lab import (RegionTiming, classify, clearly_slower, lab_enabled, rank, region_verdict,
                                                    time_region)
from trainbridge.agents.profiler.verdict import Verdict, VerdictReason
from trainbridge.records import SourceSpan
from trainbridge.sandbox import confinement
from trainbridge.sandbox.child import self_confinement
from trainbridge.sandbox.isolation import network_isolation
from trainbridge.sandbox.region_bench import median_interval
from trainbridge.sandbox.region_capture import Unisolated, qualname_for

FIXTURE = Path(__file__).parent / "fixtures" / "region_lab" / "base"
NORM = SourceSpan(file="model.py", line_start=22, line_end=23, function="forward")
MIX = SourceSpan(file="model.py", line_start=8, line_end=9, function="mix")
UNUSED = SourceSpan(file="model.py", line_start=13, line_end=13, function="unused_helper")
NORM_BODY = """        variance = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(variance + 1e-6) * self.scale"""
MIX_BODY = """    gate = torch.sigmoid(x @ weight)
    return x * gate"""
FAST = {"budget_s": 1.0, "max_reps": 200, "min_reps": 20}


def _pair(tmp_path: Path, old: str | None = None, new: str | None = None, file: str = "model.py") -> tuple[Path, Path]:
    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    shutil.copytree(FIXTURE, baseline)
    shutil.copytree(FIXTURE, candidate)
    if old is not None:
        text = (candidate / file).read_text(encoding="utf-8")
        assert old in text
        (candidate / file).write_text(text.replace(old, new), encoding="utf-8")
    return baseline, candidate


def _repeated(body: str, indent: str, times: int = 20) -> str:
    """`body` (ending in a return) run `times` times: the same result, `times` the work."""
    lines = body.splitlines()
    *work, last = lines
    value = last.strip().removeprefix("return ")
    inner = "\n".join("    " + line for line in work)
    return f"{indent}for _ in range({times}):\n{inner}\n{indent}    out = {value}\n{indent}return out"


def test_qualname_from_the_site_function_or_line(tmp_path):
    assert qualname_for(FIXTURE / "model.py", "forward", 22) == "Norm.forward"  # the def enclosing the line among three
    assert qualname_for(FIXTURE / "model.py", "forward", 34) == "Block.forward"
    assert qualname_for(FIXTURE / "model.py", None, 9) == "mix"
    assert qualname_for(FIXTURE / "model.py", "mix", 999) == "mix"  # one def of that name: lines need not match
    with pytest.raises(Unisolated, match="no def named 'nowhere'"):
        qualname_for(FIXTURE / "model.py", "nowhere", 1)
    (tmp_path / "nested.py").write_text("def outer():\n    def inner(x):\n        return x\n    return inner\n")
    with pytest.raises(Unisolated, match="inside another function"):
        qualname_for(tmp_path / "nested.py", "inner", 3)


def test_rules_are_conservative():
    def timing(interval, verdict=None, match=True):
        return RegionTiming(verdict=verdict or classify(interval), message="", ratio=sum(interval) / 2, interval=interval,
                            outputs_match=match)

    assert classify((1.02, 1.3)) == "slower" and classify((0.7, 0.95)) == "faster" and classify((0.9, 1.2)) == "same"
    assert clearly_slower(timing((1.2, 3.0)))
    assert not clearly_slower(timing((1.05, 3.0)))  # slower, but not surely by 10%
    assert not clearly_slower(timing((1.2, 3.0), match=False)) and not clearly_slower(timing((1.2, 3.0), match=None))
    assert not clearly_slower(timing((0.5, 0.8))) and not clearly_slower(RegionTiming(verdict="unisolated", message="x"))
    assert region_verdict(timing((1.05, 3.0)), backend="cpu") is None
    low, high = median_interval([float(v) for v in range(1, 101)])
    assert 40 <= low < 50.5 < high <= 61  # order statistics around the median of 1..100
    assert lab_enabled({}) and not lab_enabled({"TRAINBRIDGE_REGION_LAB": "off"})
    timings = {"a": timing((1.2, 1.4)), "b": RegionTiming(verdict="unisolated", message="x"), "c": timing((0.5, 0.7))}
    assert rank(timings) == ["c", "a", "b"]


def test_method_region_twenty_times_slower_is_skipped_without_the_gate(tmp_path, monkeypatch):
    baseline, candidate = _pair(tmp_path, NORM_BODY, _repeated(NORM_BODY, "        "))

    def no_gate(*args, **kwargs):
        raise AssertionError("the whole-step gate ran for a clearly slower region")

    monkeypatch.setattr(judge_module, "run_gate", no_gate)
    monkeypatch.setattr(judge_module, "time_region", lambda *a, **k: time_region(*a, **{**k, **FAST}))
    verdict = judge_candidate(baseline, candidate, target="cpu", rounds=6, max_rounds=None, min_gain=0.01, sites=[NORM])
    assert verdict.reason == VerdictReason.region_slower and not verdict.accepted and verdict.phase == "region"
    region = RegionTiming.model_validate(verdict.region)
    assert region.qualname == "Norm.forward" and region.module_path == "blocks.0.norm"
    assert region.shapes == {"x": "(32, 16, 64) float32"}  # the real input of the step, not a guess
    assert region.ratio > 3 and region.interval[0] > 1.1 and region.reps >= 20 and region.outputs_match is True
    assert len(region.baseline_times_s) == len(region.candidate_times_s) == region.reps
    assert "Norm.forward" in verdict.message and "ratio" in verdict.message


def test_equivalent_function_region_is_not_skipped_and_the_gate_decides(tmp_path, monkeypatch):
    baseline, candidate = _pair(tmp_path, MIX_BODY, "    return x * torch.sigmoid(x @ weight)")
    gate_calls = []

    def gate(base, cand, **kwargs):
        gate_calls.append((base.root, cand.root))
        return Verdict(accepted=False, reason=VerdictReason.not_significant, message="planted gate", backend="cpu", phase="done",
                       phase_seconds={"numerics": 1.0})

    monkeypatch.setattr(judge_module, "run_gate", gate)
    monkeypatch.setattr(judge_module, "time_region", lambda *a, **k: time_region(*a, **{**k, **FAST}))
    verdict = judge_candidate(baseline, candidate, target="cpu", rounds=6, max_rounds=None, min_gain=0.01, sites=[MIX])
    assert len(gate_calls) == 1 and verdict.reason == VerdictReason.not_significant and verdict.message == "planted gate"
    region = RegionTiming.model_validate(verdict.region)
    assert region.qualname == "mix" and region.module_path is None and region.verdict != "unisolated"
    assert region.shapes == {"x": "(32, 16, 64) float32 grad", "weight": "(64, 64) float32 grad"}
    assert not clearly_slower(region) and 0.5 < region.ratio < 1.5 and region.outputs_match is True
    assert set(verdict.phase_seconds) == {"region", "numerics"}


def test_function_region_slower_is_called_slower(tmp_path):
    baseline, candidate = _pair(tmp_path, MIX_BODY, _repeated(MIX_BODY, "    "))
    timing = time_region(baseline, candidate, [MIX], **FAST)
    assert timing.verdict == "slower" and clearly_slower(timing), timing.message


def test_a_slower_region_with_other_math_goes_to_the_gate(tmp_path):
    """Twenty times the work and another epsilon: slower, but the outputs differ, so no skip (the gate's
    numerics check is what names such a fault)."""
    other = _repeated(NORM_BODY, "        ").replace("1e-6", "1e-1")
    baseline, candidate = _pair(tmp_path, NORM_BODY, other)
    timing = time_region(baseline, candidate, [NORM], **FAST)
    assert timing.verdict == "slower" and timing.outputs_match is False and "outputs differ" in timing.message
    assert not clearly_slower(timing) and region_verdict(timing, backend="cpu") is None


def test_region_not_called_in_the_step_is_unisolated_and_the_gate_runs(tmp_path, monkeypatch):
    baseline, candidate = _pair(tmp_path, "    return x * 2", "    return x + x")
    timing = time_region(baseline, candidate, [UNUSED], **FAST)
    assert timing.verdict == "unisolated" and "not called during the training step" in timing.message
    assert region_verdict(timing, backend="cpu") is None  # never a rejection
    ran = []
    monkeypatch.setattr(judge_module, "run_gate", lambda *a, **k: ran.append(1) or Verdict(
        accepted=False, reason=VerdictReason.slower, message="gate", backend="cpu", phase="done"))
    monkeypatch.setattr(judge_module, "time_region", lambda *a, **k: timing)
    verdict = judge_candidate(baseline, candidate, target="cpu", rounds=6, max_rounds=None, min_gain=0.01, sites=[UNUSED])
    assert ran == [1] and verdict.reason == VerdictReason.slower and verdict.region["verdict"] == "unisolated"


def test_switch_off_skips_the_lab(tmp_path, monkeypatch):
    baseline, candidate = _pair(tmp_path)
    monkeypatch.setenv("TRAINBRIDGE_REGION_LAB", "off")
    monkeypatch.setattr(judge_module, "time_region", lambda *a, **k: pytest.fail("the lab ran while switched off"))
    monkeypatch.setattr(judge_module, "run_gate", lambda *a, **k: Verdict(
        accepted=False, reason=VerdictReason.slower, message="gate", backend="cpu", phase="done"))
    verdict = judge_candidate(baseline, candidate, target="cpu", rounds=6, max_rounds=None, min_gain=0.01, sites=[NORM])
    assert verdict.region is None and verdict.reason == VerdictReason.slower


def test_a_changed_signature_is_unisolated(tmp_path):
    baseline, candidate = _pair(tmp_path, "def mix(x, weight):", "def mix(x, weight, scale=1.0):")
    timing = time_region(baseline, candidate, [MIX], **FAST)
    assert timing.verdict == "unisolated" and "signature differs" in timing.message


@pytest.mark.parametrize("spawn", ["fork-server", "exec"])
def test_the_region_child_is_sandboxed(tmp_path, monkeypatch, spawn):
    """A candidate region that reaches for the network, a secret and its own worktree: the network is
    not there (where the host allows isolation), the secret is not, and the write is caught as gate-gaming;
    alike for a child forked from the warm server (the CPU's default) and an exec'd one; where children are
    confined (bubblewrap, or a forked child's own confinement) the write is refused instead."""
    monkeypatch.setenv("TRAINBRIDGE_GATE_SPAWN", spawn)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(4)
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[int] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(1)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    monkeypatch.setenv("REGION_LAB_TEST_API_KEY", "must-not-leak")
    probe = ("    import os, socket, pathlib\n"
             "    seen = {'secret': os.environ.get('REGION_LAB_TEST_API_KEY'), 'net': None}\n"
             "    try:\n"
             f"        socket.create_connection(('127.0.0.1', {port}), timeout=0.5).close(); seen['net'] = 'reached'\n"
             "    except OSError as exc:\n"
             "        seen['net'] = type(exc).__name__\n"
             "    try:\n"
             "        pathlib.Path(__file__).with_name('leak.txt').write_text(repr(seen))\n"
             "    except OSError as exc:  # confined: its worktree is read-only; its side's TMPDIR is its own\n"
             "        seen['worktree'] = type(exc).__name__\n"
             "        pathlib.Path(os.environ['TMPDIR'], 'leak.txt').write_text(repr(seen))\n")
    baseline, candidate = _pair(tmp_path, "def mix(x, weight):\n", "def mix(x, weight):\n" + probe)
    try:
        timing = time_region(baseline, candidate, [MIX], **FAST)
    finally:
        stop.set()
        thread.join(timeout=2)
        server.close()
    confined = confinement.bubblewrap().usable if spawn == "exec" else self_confinement.probe([str(tmp_path)]) is None
    leak_file = confinement.cache_dir(candidate) / "tmp" / "leak.txt" if confined else candidate / "leak.txt"
    leak = leak_file.read_text(encoding="utf-8")
    assert "must-not-leak" not in leak and "'secret': None" in leak  # the scrubbed environment
    if network_isolation().isolated or confined:
        assert accepted == [] and "reached" not in leak
    assert timing.spawn == spawn
    if confined:  # under bubblewrap, or confined by itself when forked, the write into its worktree is refused
        assert "'worktree': 'OSError'" in leak and not (candidate / "leak.txt").exists() and timing.written == []
        return
    assert timing.written == ["candidate/leak.txt"] and timing.verdict == "unisolated"
    verdict = region_verdict(timing, backend="cpu")
    assert verdict is not None and verdict.reason == VerdictReason.tampered_harness and not verdict.accepted


@pytest.mark.parametrize("spawn", ["fork-server", "exec"])
def test_a_hanging_region_is_killed_at_the_timeout(tmp_path, monkeypatch, spawn):
    monkeypatch.setenv("TRAINBRIDGE_GATE_SPAWN", spawn)
    baseline, candidate = _pair(tmp_path, "def mix(x, weight):\n", "def mix(x, weight):\n    import time\n    time.sleep(600)\n")
    timing = time_region(baseline, candidate, [MIX], timeout_s=15, **FAST)
    assert timing.verdict == "unisolated" and "killed" in timing.message and timing.wall_s < 40 and timing.spawn == spawn


def test_a_function_region_taking_the_model_gets_the_candidates_twin(tmp_path):
    """train_step(model, optimizer, batch) as the region: the candidate's side runs on the candidate's own
    model and optimizer (same paths in the model), not on the baseline's objects captured from the step."""
    check = ("    assert '/candidate/' in type(model.blocks[0].norm).forward.__code__.co_filename, 'got the baseline model'\n"
             "    assert all(p is q for p, q in zip(optimizer.param_groups[0]['params'], model.parameters()))\n")
    baseline, candidate = _pair(tmp_path, "def train_step(model, optimizer, batch):\n",
                                "def train_step(model, optimizer, batch):\n" + check, file="train.py")
    site = SourceSpan(file="train.py", line_start=14, line_end=18, function="train_step")
    timing = time_region(baseline, candidate, [site], **FAST)
    assert timing.verdict != "unisolated", timing.message
    assert timing.qualname == "train_step" and "model" not in timing.shapes and not clearly_slower(timing)
