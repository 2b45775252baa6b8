"""The benchmark suite's machinery: interleaving order, the persistent sandboxed workers measuring a
real workload, ratio aggregation, loop-cost and intent accounting, depth scaling, report rendering."""

from __future__ import annotations

import importlib
import itertools
import json
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest

from trainbridge.agents.profiler.sequential import replay

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
MLP = BENCH / "workloads" / "mlp"


def bench(name: str):
    """A module of benchmarks/ (a folder of scripts, not a package), imported the way the suite does."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def planted(tmp: Path, slowdown: float):
    return bench("gate_calibration").planted_variant(MLP, tmp / f"slow_{slowdown:g}", slowdown)


# --- interleaving ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_williams_orders_balance_positions_and_neighbours(n):
    rows = bench("speedup").williams_rows(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(row) == list(range(n)) for row in rows)
    for position in range(n):  # every variant in every position equally often
        assert set(Counter(row[position] for row in rows).values()) == {len(rows) // n}
    pairs = Counter((a, b) for row in rows for a, b in itertools.pairwise(row))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert len(set(pairs.values())) == 1  # every ordered neighbour pair equally often


def test_round_orders_cycle_and_differ_from_round_to_round():
    orders = bench("speedup").round_orders(["eager", "trainbridge", "compile", "trainbridge+compile"], 6)
    assert len(orders) == 6
    assert orders[0] != orders[1] and orders[4] == orders[0]
    assert [o[0] for o in orders[:4]] == ["eager", "trainbridge", "compile", "trainbridge+compile"]


# --- workers on a real workload ------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlp_measurement(tmp_path_factory):
    """Eager MLP against a copy with a planted 2x slowdown, in two persistent workers, 3 rounds."""
    from trainbridge.sandbox.workload import load_workload

    speedup = bench("speedup")
    slow = planted(tmp_path_factory.mktemp("planted"), 1.0)
    messages: list[str] = []
    measured = speedup.measure_variants({speedup.EAGER: (load_workload(MLP), False), speedup.BRANCH: (slow, False)},
                                        rounds=3, steps=5, warmup_steps=2, say=messages.append)
    return measured, messages


def test_workers_measure_every_round_in_rotating_order(mlp_measurement):
    measured, messages = mlp_measurement
    assert measured["orders"] == [["eager", "trainbridge"], ["trainbridge", "eager"], ["eager", "trainbridge"]]
    for name in ("eager", "trainbridge"):
        assert len(measured["samples"][name]) == 3
        assert all(len(r) == 5 and all(0 < t < 5 for t in r) for r in measured["samples"][name])
        assert len(measured["build"][name]["warmup_times_s"]) == 2
    assert measured["versions"]["torch"]
    assert any("round 3/3" in m for m in messages)


def test_planted_slowdown_shows_in_the_paired_ratio(mlp_measurement):
    summary = bench("speedup").summarise(mlp_measurement[0]["samples"])
    ratio = summary["ratios"]["trainbridge / eager"]
    assert ratio["rounds"] == 3 and len(ratio["round_ratios"]) == 3
    assert ratio["ci"][0] <= ratio["ratio"] <= ratio["ci"][1]
    assert ratio["ratio"] > 1.3, ratio  # planted: each step spins as long again as its real work
    assert summary["median_step_s"]["trainbridge"] > summary["median_step_s"]["eager"]


def test_aliased_variants_are_the_measured_ones(mlp_measurement):
    speedup = bench("speedup")
    samples = {"eager": mlp_measurement[0]["samples"]["eager"]}
    summary = speedup.summarise(samples, aliases={speedup.BRANCH: speedup.EAGER})
    assert summary["ratios"]["trainbridge / eager"]["ratio"] == 1.0
    assert summary["ratios"]["trainbridge / eager"]["ci"] == [1.0, 1.0]
    assert summary["median_step_s"]["trainbridge"] == summary["median_step_s"]["eager"]


def _tiny_workload(root: Path, body: str) -> Path:
    root.mkdir()
    (root / "trainbridge.toml").write_text('entry = "step:build"\nwarmup_steps = 1\nsteps = 2\nthreads = 1\ntimeout_s = 120\n')
    (root / "step.py").write_text(body)
    return root


def test_worker_runs_in_the_sandbox_environment_and_reports_workload_errors(tmp_path, monkeypatch):
    from trainbridge.sandbox.workload import load_workload

    speedup = bench("speedup")
    monkeypatch.setenv("TB_BENCH_TEST_API_TOKEN", "must-not-leak")
    source = (MLP / "step.py").read_text()
    spy = source.replace("def build(device: str, seed: int) -> dict:\n",
                         "def build(device: str, seed: int) -> dict:\n"
                         "    import json, os, sys\n"
                         "    open('env.json', 'w').write(json.dumps(sorted(os.environ)))\n"
                         "    print('user output on stdout must not break the protocol')\n")
    root = _tiny_workload(tmp_path / "spy", spy)
    measured = speedup.measure_variants({"eager": (load_workload(root), False)}, rounds=1, steps=2, warmup_steps=1, say=lambda m: None)
    assert len(measured["samples"]["eager"][0]) == 2
    names = json.loads((root / "env.json").read_text())
    assert "TB_BENCH_TEST_API_TOKEN" not in names and "OMP_NUM_THREADS" in names

    broken = _tiny_workload(tmp_path / "broken", "def build(device, seed):\n    raise ValueError('no data here')\n")
    with pytest.raises(speedup.WorkerError, match="no data here"):
        speedup.measure_variants({"eager": (load_workload(broken), False)}, rounds=1, steps=1, say=lambda m: None)


@pytest.mark.slow
def test_compiled_worker_compiles_once_and_times_warm_steps(tmp_path):
    from trainbridge.sandbox.workload import load_workload

    speedup = bench("speedup")
    measured = speedup.measure_variants({speedup.EAGER: (load_workload(MLP), False), speedup.COMPILE: (load_workload(MLP), True)},
                                        rounds=2, steps=4, warmup_steps=2, say=lambda m: None,
                                        extra_env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")})
    build = measured["build"][speedup.COMPILE]
    assert build["graphs"] >= 1
    assert build["warmup_times_s"][0] > 5 * max(max(r) for r in measured["samples"][speedup.COMPILE])  # the compile step
    assert measured["recompiled_during_timing"] == []
    summary = speedup.summarise(measured["samples"])
    assert set(summary["ratios"]) == {"compile / eager"}


# --- loop cost and intents -------------------------------------------------------------------------


def _state(with_phase_times: bool) -> dict:
    span = {"file": "model.py", "line_start": 30, "line_end": 31}
    verdict = lambda intent, recipe, accepted, reason, cand=True, ratio=None: {  # noqa: E731
        "intent_id": intent, "category": intent.rsplit("-", 1)[0], "recipe_id": recipe, "candidate": f"c-{recipe}" if cand else None,
        "accepted": accepted, "reason": reason, "message": reason, "ratio": ratio, "ratio_ci": [ratio * 0.98, ratio * 1.02] if ratio else None}
    state = {
        "candidates_tried": 3, "stop_reason": "time budget spent", "analyses": 2, "baseline_step_s": 0.12,
        "intents": [{"id": "rope-1", "category": "rope", "spans": [span]}, {"id": "gelu-2", "category": "gelu", "spans": [span]}],
        "done_intents": ["attention-3", "rmsnorm-4", "layernorm-5", "silu-6"],
        "verdicts": [verdict("attention-3", "attention-sdpa-causal", True, "accepted", ratio=0.8),
                     verdict("rmsnorm-4", "rmsnorm-f-rms-norm", False, "not_significant", ratio=0.995),
                     verdict("rmsnorm-4", "x", False, "numerics_mismatch"),
                     verdict("layernorm-5", "layernorm-f-layer-norm", False, "not_applicable", cand=False)],
        "accepted": [verdict("attention-3", "attention-sdpa-causal", True, "accepted", ratio=0.8)],
    }
    if with_phase_times:
        state["phase_times"] = [
            {"node": "prepare", "wall_s": 5.0, "parts": {"baseline": 4.5}},
            {"node": "analyst", "wall_s": 50.0, "parts": {"static": 0.2, "profile": 4.0, "reference": 45.0}},
            {"node": "retrieval", "wall_s": 1.0, "parts": {}},
            {"node": "coder", "wall_s": 2.0, "parts": {}},
            {"node": "profiler", "wall_s": 80.0, "parts": {"numerics": 10.0, "timing": 70.0}},
            {"node": "decide", "wall_s": 0.5, "parts": {}},
            {"node": "analyst", "wall_s": 5.0, "parts": {"static": 0.2, "profile": 4.5}},
            {"node": "report", "wall_s": 6.0, "parts": {}},
        ]
    return state


def test_phase_breakdown_maps_nodes_to_the_issue_phases():
    loop_cost = bench("loop_cost")
    b = loop_cost.phase_breakdown(_state(True), wall_s=160.0)
    assert b["phases"]["evidence"] == pytest.approx(0.2 + 4.0 + 0.2 + 4.5)
    assert b["phases"]["compile"] == pytest.approx(45.0)
    assert b["phases"]["retrieval"] == 1.0 and b["phases"]["codemod"] == 2.0
    assert b["phases"]["measurement"] == pytest.approx(5.0 + 80.0 + 6.0)
    assert b["other_s"] == pytest.approx(160.0 - 149.5)
    missing = loop_cost.phase_breakdown(_state(False), wall_s=160.0)
    assert set(missing["phases"].values()) == {None} and "no phase_times" in missing["note"]


def test_intent_outcomes_say_why_an_intent_has_no_winner():
    loop_cost = bench("loop_cost")
    by_id = {i["intent_id"]: i for i in loop_cost.intent_outcomes(_state(True))}
    assert by_id["attention-3"]["status"] == "accepted"
    assert by_id["rmsnorm-4"]["status"] == "no winning recipe: every candidate rejected"
    assert [t["reason"] for t in by_id["rmsnorm-4"]["tried"]] == ["not_significant", "numerics_mismatch"]
    assert by_id["layernorm-5"]["status"] == "no winning recipe: no recipe applied to the code"
    assert by_id["silu-6"]["status"] == "no recipe for this target" and by_id["silu-6"]["category"] == "silu"
    assert by_id["rope-1"]["status"].startswith("not reached") and by_id["rope-1"]["where"] == "model.py:30"
    stats = loop_cost.candidate_stats(_state(True))
    assert stats["candidates_per_accepted"] == 3.0 and stats["recipes_not_applicable"] == 1


def test_git_copy_and_branch_export(tmp_path):
    loop_cost = bench("loop_cost")
    repo = loop_cost.git_copy(MLP, tmp_path / "repo")
    exported = loop_cost.export_branch(repo, "HEAD", tmp_path / "out")
    assert (exported / "step.py").read_text() == (MLP / "step.py").read_text()
    assert not (exported / ".git").exists()


# --- analysis scaling ------------------------------------------------------------------------------


def test_llama_copy_has_the_requested_depth(tmp_path):
    scaling = bench("analysis_scaling")
    repo = scaling.llama_at_depth(tmp_path / "l16", 16)
    text = (repo / "model.py").read_text()
    assert re.search(r"^\s*n_layers: int = 16$", text, re.M)
    original = (scaling.LLAMA / "model.py").read_text()
    assert len(text.splitlines()) == len(original.splitlines())  # line numbers (intent spans) unchanged


def test_linearity_verdicts():
    scaling = bench("analysis_scaling")
    depths = [2, 4, 8, 16]
    linear = scaling.linearity(depths, [20 + 8 * d for d in depths])
    assert linear["verdict"] == "linear" and linear["slope"] == pytest.approx(8) and linear["r2"] == pytest.approx(1)
    assert scaling.linearity(depths, [20 + d * d for d in depths])["verdict"] == "superlinear"
    assert scaling.linearity(depths, [20 + 30 * d ** 0.5 for d in depths])["verdict"] == "sublinear"


# --- rendering ---------------------------------------------------------------------------------------


def test_fresh_arms_run_each_arm_in_a_new_child_and_find_a_planted_slowdown(tmp_path):
    """Every arm of every round is its own sandboxed child, the A/A control reads about 1, and a branch
    with a planted 2x slowdown reads about 2."""
    from trainbridge.sandbox.child import fork_server
    from trainbridge.sandbox.workload import load_workload

    fresh = bench("fresh_arms")
    slow = planted(tmp_path, 1.0)
    children: list[str] = []
    real = fresh.run_workload

    def counted(workload, **kwargs):
        pool = fork_server.active()
        before = pool.forked if pool is not None else None
        result = real(workload, **kwargs)
        children.append("forked" if pool is not None and pool.forked == before + 1 else "exec'd" if result.failure is None else "failed")
        return result

    fresh.run_workload = counted
    try:
        measured = fresh.measure_fresh(load_workload(MLP), slow, rounds=2, steps=3, say=lambda m: None)
    finally:
        fresh.run_workload = real
    assert len(children) == 2 * 5 and "failed" not in children  # one new child per arm and round
    assert children.count("forked") == 10  # each forked anew from the warm server, never a worker reused
    assert [sorted(o) for o in measured["orders"]] == [sorted(fresh.ARMS)] * 2 and measured["orders"][0] != measured["orders"][1]
    summary = fresh.summarise(measured)
    assert summary["ratios"]["trainbridge / eager"]["ratio"] > 1.5
    assert 0.7 < summary["ratios"]["eager (A/A) / eager"]["ratio"] < 1.4


def test_gap_closed_is_the_share_of_the_compile_gap_and_undefined_without_one():
    fresh = bench("fresh_arms")
    eager = [[1.0, 1.0]] * 6
    compiled = [[0.6, 0.6]] * 6
    half = fresh.gap_closed(eager, [[0.8, 0.8]] * 6, compiled)
    assert half["share"] == pytest.approx(0.5) and half["ci"] == [pytest.approx(0.5), pytest.approx(0.5)]
    assert fresh.gap_closed(eager, [[0.5, 0.5]] * 6, compiled)["share"] == pytest.approx(1.25)  # past compile
    assert fresh.gap_closed(eager, [[0.8, 0.8]] * 6, [[1.1, 1.1]] * 6) is None  # compile slower: no gap to close
    summary = fresh.summarise({"samples": {"eager": eager, "eager (A/A)": eager, "compile": compiled}, "branch_is_original": True})
    assert summary["gap_closed"]["share"] == 0.0 and summary["ratios"]["trainbridge / compile"]["ratio"] == pytest.approx(1 / 0.6)


def test_report_renders_measured_figures_and_na_for_missing_phases(mlp_measurement, tmp_path):
    report, loop_cost, fresh = bench("report"), bench("loop_cost"), bench("fresh_arms")
    measured = {"samples": {**mlp_measurement[0]["samples"], "eager (A/A)": mlp_measurement[0]["samples"]["eager"]}}
    summary = fresh.summarise(measured)
    workload = {"workload": "mlp", "measured": measured, "summary": summary, "accepted": [], "intents": loop_cost.intent_outcomes(_state(True)),
                "run": {"run_id": "r", "wall_s": 100.0, "exit_code": 0, "stop_reason": "no intents left"},
                "coverage": {"reached": 2, "left_with_recipe": [], "left_without": 0, "every_intent_with_a_recipe": True},
                "per_candidate": {"judge_s": [30.0, 50.0], "judged": 2, "median_judge_s": 40.0}}
    record = {"date": "2026-01-01", "status": "complete", "command": "python benchmarks/suite.py --quick",
              "machine": {"cpus": 2, "loadavg_start": [0.5]}, "versions": {"torch": "x"},
              "sections": {"speedup": {"status": "ok", "settings": {"rounds": 3, "steps": 5}, "workloads": [workload]},
                           "loop_cost": {"status": "ok", "workloads": [
                               {"workload": "mlp", "breakdown": loop_cost.phase_breakdown(_state(False), 100.0),
                                "candidates": loop_cost.candidate_stats(_state(False))}]}}}
    charts = report.write_charts(record, tmp_path / "2026-01-01")
    assert [p.name for p in charts] == ["2026-01-01.png"] and charts[0].read_bytes()[:4] == b"\x89PNG"
    text = report.render_markdown(record, [str(p) for p in charts])
    eager_ms = f"{1000 * summary['median_step_s']['eager']:.1f}"
    row = next(line for line in text.splitlines() if line.startswith("| mlp | "))
    assert eager_ms in row and row.startswith("| mlp | 2, all with a recipe | none |") and row.endswith("| 1.00 [1.00, 1.00] | 40.0 |")
    assert "median 40.0 s per judged candidate over 2 candidates" in text
    assert "| mlp | 100 | n/a | n/a | n/a | n/a | n/a | n/a | 3 | 1 | 3.0 |" in text
    assert "no winning recipe: every candidate rejected" in text
    assert "not run (excluded with --only)" in text  # calibration, kb, scaling absent
    assert "![2026-01-01](2026-01-01.png)" in text


def test_suite_cli_settings_and_section_names():
    suite = bench("suite")
    quick = suite.parse_args(["--quick", "--only", "speedup,calibration", "--rounds", "4"])
    assert quick.sections == ["speedup", "calibration"] and quick.settings["rounds"] == 4
    assert quick.settings["workloads"] == ["llama_pretrain"]
    full = suite.parse_args([])
    assert full.sections == list(suite.SECTIONS) and full.settings["depths"] == [2, 4, 8, 16]
    plan = suite.estimate_s(full.settings, full.sections)  # the whole suite is over 45 min: its sections say their own times
    assert set(plan) == {"runs", "speedup", "calibration", "kb_latency", "analysis_scaling", "ranks"} and all(v > 0 for v in plan.values())
    with pytest.raises(SystemExit):
        suite.parse_args(["--only", "speed"])


# --- gate calibration decides as the gate does -------------------------------------------------------


def test_a_page_takes_a_rerun_workload_in_place_of_its_own_and_says_where_it_came_from():
    suite, report = bench("suite"), bench("report")

    def entries(run_id: str, *names: str) -> dict:
        return {"speedup": {"workloads": [{"workload": n, "run": {"run_id": run_id}} for n in names]},
                "loop_cost": {"workloads": [{"workload": n, "breakdown": {"wall_s": 1.0}, "candidates": {}} for n in names]}}

    record = {"command": "python benchmarks/suite.py", "sections": entries("first", "llama_pretrain", "gpt2_pretrain")}
    other = {"command": "python benchmarks/suite.py --workloads gpt2_pretrain", "started": "2026-12-02T00:23:15",
             "versions": {"trainbridge": "abc"}, "sections": entries("again", "gpt2_pretrain")}
    assert suite.merge(record, other, "after a fix") == ["gpt2_pretrain"]
    llama, gpt2 = record["sections"]["speedup"]["workloads"]
    assert llama == {"workload": "llama_pretrain", "run": {"run_id": "first"}}  # the others stay as measured
    assert gpt2["run"]["run_id"] == "again" and gpt2["rerun"]["why"] == "after a fix"
    assert record["sections"]["loop_cost"]["workloads"][1]["rerun"]["command"] == other["command"]
    notes = "\n".join(report._speedup_notes(record["sections"]["speedup"]))
    assert "gpt2_pretrain: from a separate run, after a fix (`python benchmarks/suite.py --workloads gpt2_pretrain`" in notes
    with pytest.raises(SystemExit, match="none of this page's workloads"):
        suite.merge(record, {"sections": entries("x", "clip_pretrain")}, "why")


def test_calibration_blocks_are_decided_with_the_gates_sequential_rule():
    from types import SimpleNamespace

    calibration = bench("gate_calibration")
    # 20 rounds: the 5%-gain condition (slow_0.05 as baseline, base as candidate) is 3% faster, but three of the
    # first ten rounds go the other way (a close call: later looks decide); the +10% condition is twice as slow
    cand = [0.097] * 5 + [0.101] * 3 + [0.097] * 2 + [0.097] * 10
    rounds = [{"samples": {"base": [c], "base_again": [0.1], "slow_0.02": [0.1], "slow_0.05": [0.1], "slow_0.1": [0.2]}} for c in cand]
    args = SimpleNamespace(min_gain=0.01, confidence=0.95, rounds=10, max_rounds=20)
    decided = calibration.decide_blocks(rounds, 20, args, [0.02, 0.05, 0.1], sliding=False)
    gain = decided["-4.8% (5% gain)"][0]
    assert gain["outcome"] == "accepted" and gain["looks"] > 2 and 10 < gain["rounds_used"] <= 20
    slower = decided["+10% slower"][0]  # every round agrees: decided at the first look (6 rounds), the rest is not read
    assert slower["rounds_used"] == 6 and slower["looks"] == 1 and slower["outcome"] == "slower" and slower["stopped"] == "decided"
    # exactly what the gate's own rule says on the same rounds
    expected = replay([[0.1]] * 20, [[c] for c in cand], None, rounds=10, max_rounds=20)
    assert gain["rounds_used"] == len(expected.baseline_rounds) and gain["ratio"] == expected.decision.ratio
    one = calibration.decide_blocks(rounds[:10], 10, args, [0.02, 0.05, 0.1], sliding=False, sequential=False)
    assert one["-4.8% (5% gain)"][0]["outcome"] == "not_significant" and one["-4.8% (5% gain)"][0]["rounds_used"] == 10
    rows = {r["condition"]: r for r in calibration.summarise(decided)}
    assert rows["+10% slower"]["mean_rounds"] == 6 and rows["-4.8% (5% gain)"]["mean_rounds"] == gain["rounds_used"]


def test_paired_calibration_rounds_pair_each_condition_within_its_own_pair_and_leave_busy_rounds_out():
    from types import SimpleNamespace

    calibration = bench("gate_calibration")
    # paired rounds: base beside base_again in one pair, beside slow_0.05 in another; round 3's A/A pair ran on a
    # busy machine (the baseline got 0.9 cores of 2) and its ratio is wild: the gate would measure it again
    rounds = []
    for i in range(10):
        busy = i == 3
        rounds.append({"pairs": {
            "base_again": {"base": [0.1], "base_again": [0.3 if busy else 0.1], "cores": {"base": 0.9 if busy else 1.95, "base_again": 1.9}},
            "slow_0.05": {"base": [0.1], "slow_0.05": [0.105], "cores": {"base": 1.95, "slow_0.05": 1.95}},
        }})
    args = SimpleNamespace(min_gain=0.01, confidence=0.95, rounds=10, max_rounds=10)
    decided = calibration.decide_blocks(rounds, 10, args, [0.05], sliding=False)
    aa = decided["A/A"][0]  # no change at all: stopped for futility at the first look, 6 kept rounds (7 measured)
    assert aa["busy_rounds"] == [3] and aa["rounds_used"] == 7 and aa["ratio"] == pytest.approx(1.0) and aa["stopped"] == "futility"
    slow = decided["+5% slower"][0]
    assert slow["busy_rounds"] == [] and slow["ratio"] == pytest.approx(1.05) and slow["outcome"] == "slower"
    gain = decided["-4.8% (5% gain)"][0]  # the same pair with roles swapped: slow_0.05's cores were recorded too
    assert gain["ratio"] == pytest.approx(1 / 1.05) and gain["outcome"] == "accepted"


def test_shifted_calibration_scales_only_the_candidate_side_of_the_recorded_aa_rounds():
    from types import SimpleNamespace

    calibration = bench("gate_calibration")
    # A/A rounds whose two sides differ by a little noise either way: as recorded, no direction; scaled by the
    # exact factors, the slowdown is called slower and the gain accepted, each on the same resampled rounds
    noise = [1.0 + 0.004 * ((i * 7) % 5 - 2) for i in range(30)]
    rounds = [{"samples": {"base": [0.1], "base_again": [0.1 * n]}} for n in noise]
    args = SimpleNamespace(min_gain=0.01, confidence=0.95, rounds=10, max_rounds=20)
    decided = calibration.decide_shifted(rounds, args, gates=20)
    slow, gain = (decided[label] for _, label in calibration.SHIFTS)
    assert {d["outcome"] for d in slow} == {"slower"} and {d["outcome"] for d in gain} == {"accepted"}
    assert all(d["ratio"] == pytest.approx(1.05, rel=0.02) for d in slow) and all(d["truth"] == 1.05 for d in slow)
    assert rounds[0]["samples"]["base_again"] == [0.1 * noise[0]]  # the recorded samples are left as they were


@pytest.mark.slow
def test_a_slowdown_is_planted_in_any_entry_workload(tmp_path):
    """Workloads without a SLOWDOWN knob get a wrapper around their entry; the copy is really slower."""
    from trainbridge.sandbox.runner import run_workload

    source = tmp_path / "plain"
    source.mkdir()
    (source / "trainbridge.toml").write_text('entry = "train:entry"\nwarmup_steps = 1\nsteps = 6\nthreads = 1\n')
    (source / "train.py").write_text(
        "import torch\n\n"
        "def entry(device, seed):\n"
        "    torch.manual_seed(seed)\n"
        "    model = torch.nn.Linear(512, 512)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    def batch(i):\n"
        "        return torch.randn(256, 512, generator=torch.Generator().manual_seed(i))\n"
        "    def loss_fn(m, b):\n"
        "        return m(b).pow(2).mean()\n"
        "    def train_step(m, o, b):\n"
        "        o.zero_grad(); loss = loss_fn(m, b); loss.backward(); o.step(); return loss\n"
        "    return {'model': model, 'optimizer': opt, 'batch': batch, 'loss_fn': loss_fn, 'train_step': train_step}\n")
    slow = bench("gate_calibration").planted_variant(source, tmp_path / "slow", 1.0)
    assert slow.config.entry == "tb_planted_slowdown:entry" and (source / "trainbridge.toml").read_text().startswith('entry = "train:entry"')
    plain = bench("gate_calibration").load_workload(source)
    # interleaved A B B A: two sequential runs each saw a different machine load (the band flaked on a
    # loaded 2-core machine); each pair's ratio sees the same moment, and the median of the two pairs
    # is what is checked
    runs = [run_workload(w, mode="measure") for w in (plain, slow, slow, plain)]
    assert all(r.failure is None for r in runs), [r.failure for r in runs]
    assert runs[0].losses == runs[1].losses  # the same work, only slower
    medians = [statistics.median(r.step_times_s) for r in runs]
    ratio = statistics.median([medians[1] / medians[0], medians[2] / medians[3]])
    # the plant doubles train_step; the parent-timed step also holds batch(i) (a 256x512 randn, about a
    # millisecond) and the control channel's round trip, which it does not slow: so less than 2x here
    assert 1.3 < ratio < 2.6, (ratio, medians)
    inner = [statistics.median(r.inner_step_times_s) for r in runs]
    assert statistics.median([inner[1] / inner[0], inner[2] / inner[3]]) > ratio * 0.9  # the child's clock agrees


def test_region_agreement_and_per_candidate_seconds_come_from_the_runs_own_records():
    loop_cost = bench("loop_cost")

    def record(name, reason, accepted, region, ratio=None):
        return {"candidate": name, "reason": reason, "accepted": accepted, "ratio": ratio,
                "gate": {"region_verdict": region, "region_ratio": 0.5 if region == "faster" else 1.0}}

    state = {"verdicts": [record("a", "accepted", True, "faster", 0.9), record("b", "not_significant", False, "faster"),
                          record("c", "not_significant", False, "same"), record("d", "numerics_mismatch", False, "same"),
                          record("e", "accepted", True, "unisolated", 0.95), {"candidate": None, "reason": "not_applicable"}],
             "phase_times": [{"node": "profiler", "wall_s": 30.0, "parts": {"region": 5.0, "timing": 20.0}},
                             {"node": "coder", "wall_s": 0.4}, {"node": "profiler", "wall_s": 50.0, "parts": {}}]}
    agreement = loop_cost.region_agreement(state)
    assert (agreement["timed"], agreement["agree"]) == (3, 2)  # d stopped at numerics, e had no region timing
    assert [p["candidate"] for p in agreement["pairs"] if not p["agree"]] == ["b"]
    per = loop_cost.per_candidate_seconds(state)
    assert per["judge_s"] == [30.0, 50.0] and per["gate_s"] == [25.0, 50.0] and per["median_judge_s"] == 40.0
    assert per["median_coder_s"] == 0.4 and per["region_agreement"]["agree"] == 2
