"""The loop's own cost, and what it found: a real `trainbridge run` on a git copy of a workload.

`run_loop` copies a workload into a fresh git repository (the user's repository is never the
benchmark's), runs `python -m trainbridge run` on it as a user would (CPU target, a wall-clock
budget and a candidate limit sized for the suite), and reads the run's final state from its
checkpoints. From that state:

- `phase_breakdown`: the run's wall time split by the issue's phases, from the per-node
  `phase_times` the loop records: evidence (the analyst's static scan and eager profile), compile
  (the analyst's torch.compile reference), retrieval, codemod (coder), measurement (baseline,
  gate, final measurement: prepare + profiler + report), and what is left (graph and process
  overhead, decide, knowledge-base opening). A run whose state has no `phase_times` (an older
  loop) gives None for every phase, shown as "n/a".
- `intent_outcomes`: every intent found, the recipes tried for it and their verdicts, and why
  it has no winning recipe (all candidates rejected, no recipe applied, none for the target, or
  not reached within the budget).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

Say = Callable[[str], None]
# issue phase -> (node, analyst part or None for the node's whole wall time)
PHASES: dict[str, list[tuple[str, str | None]]] = {
    "evidence": [("analyst", "static"), ("analyst", "profile")],
    "compile": [("analyst", "reference")],
    "retrieval": [("retrieval", None)],
    "codemod": [("coder", None)],
    "measurement": [("prepare", None), ("profiler", None), ("report", None)],
}
GIT_IDENTITY = ("-c", "user.name=TrainBridge benchmark", "-c", "user.email=bench@localhost", "-c", "commit.gpgsign=false")


def git_copy(source: Path, dest: Path) -> Path:
    """Copy a workload folder to `dest` and make it a git repository with one commit."""
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (dest / ".gitignore").write_text("__pycache__/\n", encoding="utf-8")
    for argv in (["init", "-q"], ["add", "-A"], [*GIT_IDENTITY, "commit", "-qm", f"{source.name} as shipped"]):
        subprocess.run(["git", *argv], cwd=dest, check=True, capture_output=True)
    return dest


def export_branch(repo: Path, branch: str, dest: Path) -> Path:
    """The files of `branch` (no .git) in `dest`: what the speed benchmark builds the branch variants from."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", "--format=tar", branch], cwd=repo, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, capture_output=True)
    return dest


def run_loop(repo: Path, run_id: str, home: Path, *, budget_s: float, max_candidates: int, gate_rounds: int,
             compile_reference: bool = True, say: Say = print, target: str = "cpu",
             extra_args: tuple[str, ...] = ()) -> dict[str, Any]:
    """Run `trainbridge run` on `repo` (runs kept under `home`); returns its wall time, exit code and final state.
    `extra_args`: more of the command's options (e.g. `--category rmsnorm`)."""
    argv = [sys.executable, "-m", "trainbridge", "run", str(repo), "--target", target, "--budget", f"{budget_s:g}",
            "--max-candidates", str(max_candidates), "--rounds", str(gate_rounds), "--run-id", run_id,
            "--kb-dir", str(home / "kb"),
            "--final-rounds", "0"]  # the speedup section measures the branch itself, interleaved with compile
    if not compile_reference:
        argv.append("--no-reference")
    argv += list(extra_args)
    env = {**os.environ, "TRAINBRIDGE_HOME": str(home), "COLUMNS": "160"}
    started = time.monotonic()
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip())
            if _is_progress(line):
                say(f"    | {line.rstrip()[:200]}")
        code = proc.wait()
    wall_s = time.monotonic() - started
    state = _final_state(run_id, home)
    return {"run_id": run_id, "argv": [str(a) for a in argv[1:]], "exit_code": code, "wall_s": wall_s, "state": state,
            "output_tail": list(tail) if code else []}


def _is_progress(line: str) -> bool:
    """The run's timestamped progress lines and its final summary (not the report it prints)."""
    return bool(re.match(r"^\d\d:\d\d:\d\d ", line)) or line.startswith(("run ", "branch:", "error"))


def _final_state(run_id: str, home: Path) -> dict[str, Any]:
    from trainbridge.graph.runs import RunError, run_status

    try:
        return run_status(run_id, root=home / "runs")["state"]
    except RunError:
        return {}


def phase_breakdown(state: dict[str, Any], wall_s: float) -> dict[str, Any]:
    """Seconds per issue phase (None where the loop recorded no phase_times), per node, and the rest."""
    entries = state.get("phase_times")
    per_node: dict[str, float] = {}
    for entry in entries or []:
        per_node[entry["node"]] = per_node.get(entry["node"], 0.0) + float(entry["wall_s"])
    if not entries:
        return {"phases": {name: None for name in PHASES}, "nodes": {}, "other_s": None, "wall_s": wall_s,
                "note": "the run's state has no phase_times: this loop does not record per-node wall times"}
    analyst_entries = [e for e in entries if e["node"] == "analyst"]
    split = all(e.get("parts") for e in analyst_entries)
    phases: dict[str, float | None] = {}
    for name, sources in PHASES.items():
        total = 0.0
        for node, part in sources:
            if part is None:
                total += per_node.get(node, 0.0)
            elif split:
                total += sum(float(e["parts"].get(part, 0.0)) for e in analyst_entries)
            else:
                total = None
                break
        phases[name] = total
    note = None if split else "the analyst recorded no sub-phases: evidence and compile not separable"
    return {"phases": phases, "nodes": per_node, "other_s": wall_s - sum(per_node.values()), "wall_s": wall_s, "note": note}


def candidate_stats(state: dict[str, Any]) -> dict[str, Any]:
    tried = int(state.get("candidates_tried") or 0)
    accepted = len(state.get("accepted") or [])
    refusals = sum(1 for v in state.get("verdicts") or [] if v.get("candidate") is None)
    return {"candidates_tried": tried, "accepted": accepted, "recipes_not_applicable": refusals,
            "candidates_per_accepted": tried / accepted if accepted else None, "stop_reason": state.get("stop_reason"),
            "analyses": state.get("analyses"), "baseline_step_s": state.get("baseline_step_s")}


def _category_of(intent_id: str) -> str:
    return intent_id.rsplit("-", 1)[0] if "-" in intent_id else intent_id


def intent_outcomes(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every intent the run knew of, with the recipes tried and the reason it has (or has no) winner."""
    verdicts = state.get("verdicts") or []
    done = set(state.get("done_intents") or [])
    latest = {i["id"]: i for i in state.get("intents") or []}
    order = list(dict.fromkeys([*(v["intent_id"] for v in verdicts), *sorted(done), *latest]))
    out = []
    for intent_id in order:
        tried = [v for v in verdicts if v.get("intent_id") == intent_id]
        info = latest.get(intent_id) or {}
        category = info.get("category") or next((v.get("category") for v in tried if v.get("category")), None) or _category_of(intent_id)
        winners = [v for v in tried if v.get("accepted")]
        gated = [v for v in tried if v.get("candidate") is not None]
        if winners:
            status = "accepted"
        elif gated:
            status = "no winning recipe: every candidate rejected"
        elif tried:
            status = "no winning recipe: no recipe applied to the code"
        elif intent_id in done:
            status = "no recipe for this target"
        else:
            status = "not reached (budget or candidate limit)"
        evidence = ((state.get("intent_evidence") or {}).get(intent_id) or {}).get("evidence") or info.get("evidence") or {}
        out.append({
            "intent_id": intent_id, "category": category, "status": status,
            "compile_kernels": evidence.get("kernels") or [], "reference_kernels": evidence.get("reference_kernels"),
            "eager_ops": evidence.get("target_ops"),
            "where": ", ".join(f"{s['file']}:{s['line_start']}" for s in info.get("spans") or []) or None,
            "tried": [{"recipe_id": v.get("recipe_id"), "reason": v.get("reason"), "ratio": v.get("ratio"),
                       "ratio_ci": v.get("ratio_ci"), "message": (v.get("message") or "")[:300]} for v in tried],
        })
    return out


def accepted_commits(state: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: a.get(k) for k in ("category", "recipe_id", "ratio", "ratio_ci", "sha", "files", "diff")} for a in state.get("accepted") or []]


def per_candidate_seconds(state: dict[str, Any]) -> dict[str, Any]:
    """Wall time per judged candidate from the run's own phase_times: the profiler node's (region lab and
    gate; `gate_s` without the lab) and the coder node's (writing the patch), each candidate's list and medians."""
    import statistics

    entries = state.get("phase_times") or []
    profiler = [e for e in entries if e.get("node") == "profiler"]
    judge = [float(e["wall_s"]) for e in profiler]
    region = [float((e.get("parts") or {}).get("region", 0.0)) for e in profiler]
    gate = [j - r for j, r in zip(judge, region)]
    coder = [float(e["wall_s"]) for e in entries if e.get("node") == "coder"]

    def median(values: list[float]) -> float | None:
        return statistics.median(values) if values else None

    return {"judge_s": judge, "region_s": region, "gate_s": gate, "coder_s": coder, "judged": len(judge),
            "region_agreement": region_agreement(state),
            "median_judge_s": median(judge), "median_gate_s": median(gate), "median_region_s": median(region),
            "median_coder_s": median(coder)}


def region_agreement(state: dict[str, Any]) -> dict[str, Any]:
    """The region lab's verdict beside the whole-step gate's, per judged candidate whose region was
    timed (the verdict records' "gate" summary): agreement when both say faster, both slower, or the
    region says "same" and the gate finds no significant change."""
    pairs = []
    for v in state.get("verdicts") or []:
        g = v.get("gate") or {}
        region = g.get("region_verdict")
        if region in (None, "unisolated") or v.get("reason") not in ("accepted", "slower", "not_significant", "region_slower"):
            continue  # no region timing, or the gate stopped before speed (numerics, conduct, a crash)
        gate = "faster" if v.get("accepted") else "slower" if v.get("reason") in ("slower", "region_slower") else "same"
        pairs.append({"candidate": v.get("candidate"), "region": region, "region_ratio": g.get("region_ratio"), "gate": gate,
                      "gate_ratio": v.get("ratio"), "agree": region == gate})
    return {"pairs": pairs, "timed": len(pairs), "agree": sum(p["agree"] for p in pairs)}
