"""Confinement of exec'd sandbox children by bubblewrap (sandbox/confinement.py, issue 24): a child's code cannot
write outside its own scratch and compile cache, cannot see or signal TrainBridge's processes, and trains as before;
a child forked from a warm server confines itself to the same places (sandbox/child/self_confinement.py); without
bubblewrap the result says it was not confined."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

import trainbridge
from trainbridge.sandbox import confinement
from trainbridge.sandbox.child import fork_server, self_confinement
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.workload import load_workload

TINY = Path(__file__).parent / "fixtures" / "workloads" / "tiny"
MARK = "ESCAPE-PROBE "
# appended to the tiny workload's module: runs at import, in the child, before the first step
PROBE = '''

def _escape_probe():
    import json, os, signal, tempfile
    from pathlib import Path

    def attempt(what, action):
        try:
            action()
            return "done"
        except Exception as exc:
            return type(exc).__name__

    here = Path(__file__).resolve().parent
    outside = Path(os.environ["TB_TEST_OUTSIDE"])
    parent = int(os.environ["TB_TEST_PARENT_PID"])
    report = {
        "own_worktree": attempt("w", lambda: (here / "planted.txt").write_text("x")),
        "own_pycache": attempt("p", lambda: ((here / "__pycache__").mkdir(exist_ok=True), (here / "__pycache__" / "step.cpython-311.pyc").write_bytes(b"x"))),
        "installed_tool": attempt("t", lambda: (Path(os.environ["TB_TEST_PACKAGE"]) / "planted_by_child.py").write_text("x")),
        "other_folder": attempt("o", lambda: (outside / "planted.txt").write_text("x")),
        "signal_parent": attempt("s", lambda: os.kill(parent, signal.SIGCONT)),
        "parent_memory": attempt("m", lambda: open(f"/proc/{parent}/mem", "rb").close()),
        "temp_file": attempt("f", lambda: tempfile.mkstemp()),
        "home_file": attempt("h", lambda: (Path.home() / "note").write_text("x")),
        "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()),
        "uid": os.getuid(),
    }
    print("ESCAPE-PROBE " + json.dumps(report), flush=True)


_escape_probe()
'''


def _probe_workload(tmp_path: Path) -> Path:
    root = tmp_path / "wl"
    shutil.copytree(TINY, root)
    with (root / "step.py").open("a", encoding="utf-8") as handle:
        handle.write(PROBE)
    return root


def _report(result) -> dict:
    line = next(x for x in result.stdout_tail.splitlines() if x.startswith(MARK))
    return json.loads(line[len(MARK):])


def _env(tmp_path: Path, package: Path | None = None) -> dict[str, str]:
    outside = tmp_path / "outside"
    outside.mkdir(exist_ok=True)
    return {"TB_TEST_OUTSIDE": str(outside), "TB_TEST_PARENT_PID": str(os.getpid()),
            "TB_TEST_PACKAGE": str(package or Path(trainbridge.__file__).resolve().parent)}


needs_bubblewrap = pytest.mark.skipif(not confinement.bubblewrap().usable,
                                      reason=f"no confinement here: {confinement.bubblewrap().reason}")


@needs_bubblewrap
def test_an_execd_child_writes_only_its_scratch_and_sees_no_process_of_ours(tmp_path):
    root = _probe_workload(tmp_path)
    result = run_workload(load_workload(root), mode="measure", extra_env=_env(tmp_path))

    assert result.failure is None, result.stderr_tail
    assert result.confined and result.network_isolated and "confined by bubblewrap" in result.isolation_notes[0]
    report = _report(result)
    for place in ("own_worktree", "own_pycache", "installed_tool", "other_folder"):
        assert report[place] == "OSError", (place, report)  # EROFS: the filesystem is read-only to it
    assert report["signal_parent"] == "ProcessLookupError", report  # our pid names nothing in its namespace
    assert report["parent_memory"] == "FileNotFoundError", report
    assert report["temp_file"] == "done" and report["home_file"] == "done", report  # its own TMPDIR and HOME
    assert len(report["pids"]) < 10, report  # its own PID namespace: bubblewrap's init and itself, not the host's
    assert report["uid"] == confinement.SANDBOX_UID
    assert not (root / "planted.txt").exists() and not (root / "__pycache__").exists()
    assert not (Path(trainbridge.__file__).resolve().parent / "planted_by_child.py").exists()
    assert not (tmp_path / "outside" / "planted.txt").exists()
    assert len(result.step_times_s) == 3  # and it trained as before


def test_a_forked_child_confines_itself_to_the_same_places(tmp_path):
    refused = self_confinement.probe([str(tmp_path)])
    if refused is not None:
        pytest.skip(f"this host does not let a process confine itself: {refused}")
    root = _probe_workload(tmp_path)
    with fork_server.serving("fork-server") as pool:
        result = run_workload(load_workload(root), mode="measure", extra_env=_env(tmp_path))
        assert pool.forked == 1 and not pool.fallbacks, pool.fallbacks

    assert result.failure is None, result.stderr_tail
    assert result.confined and result.isolation_notes[0].startswith("forked from a warm server, confined by itself")
    report = _report(result)
    for place in ("own_worktree", "own_pycache", "installed_tool", "other_folder"):
        assert report[place] == "OSError", (place, report)  # EROFS, as under bubblewrap
    assert report["parent_memory"] == "PermissionError", report  # another user namespace's process: no access
    assert report["temp_file"] == "done" and report["home_file"] == "done", report
    assert report["uid"] == confinement.SANDBOX_UID
    assert not (root / "planted.txt").exists() and not (root / "__pycache__").exists()
    assert not (Path(trainbridge.__file__).resolve().parent / "planted_by_child.py").exists()
    assert not (tmp_path / "outside" / "planted.txt").exists()
    assert len(result.step_times_s) == 3


@needs_bubblewrap
def test_a_server_whose_children_cannot_confine_themselves_hands_them_to_bubblewrap(tmp_path):
    root = _probe_workload(tmp_path)
    with fork_server.serving("fork-server") as pool:
        run_workload(load_workload(root), mode="measure", extra_env=_env(tmp_path))  # starts the server
        (server,) = pool.servers.values()
        server.confine_error = "planted: no user namespaces"  # what a host without them answers at the server's start
        results = [run_workload(load_workload(root), mode="measure", extra_env=_env(tmp_path)) for _ in range(2)]
        assert pool.forked == 1 and pool.cannot_confine and "planted: no user namespaces" in pool.cannot_confine
        assert len(pool.fallbacks) == 2 and len(pool.servers) == 1  # asked once: the server is kept, not restarted
    for result in results:
        assert result.failure is None, result.stderr_tail
        assert result.confined and "confined by bubblewrap" in result.isolation_notes[0]  # exec'd, confined
        assert len(_report(result)["pids"]) < 10


@needs_bubblewrap
def test_the_compile_cache_is_the_sides_own_and_outlives_its_rounds(tmp_path):
    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    assert confinement.cache_dir(baseline) != confinement.cache_dir(candidate)
    assert confinement.cache_dir(baseline) == confinement.cache_dir(baseline)
    first = confinement.child_sandbox(tmp_path / "scratch-1", root=baseline)
    again = confinement.child_sandbox(tmp_path / "scratch-2", root=baseline)  # another round of the same side
    assert first.env == again.env  # nothing in its environment tells one round from another
    assert all(value.startswith(str(confinement.cache_dir(baseline))) for value in first.env.values())
    assert str(tmp_path / "scratch-1") in first.prefix and str(confinement.cache_dir(baseline)) in first.prefix


def test_without_bubblewrap_the_child_runs_unconfined_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv(confinement.CONFINE_ENV, "0")
    confinement.bubblewrap.cache_clear()
    try:
        root = _probe_workload(tmp_path)
        stand_in = tmp_path / "package"  # unconfined, the probe would really write into the installed tool
        stand_in.mkdir()
        result = run_workload(load_workload(root), mode="measure", extra_env=_env(tmp_path, stand_in))
    finally:
        monkeypatch.delenv(confinement.CONFINE_ENV)
        confinement.bubblewrap.cache_clear()
    assert result.failure is None, result.stderr_tail
    assert not result.confined and result.isolation_notes[0].startswith("not confined: TRAINBRIDGE_CONFINE=0")
    report = _report(result)
    assert report["own_worktree"] == "done" and report["installed_tool"] == "done"  # what confinement prevents


def test_a_judged_candidates_folder_is_removed_and_the_baselines_kept(tmp_path, monkeypatch):
    """judge_candidate removes the candidate's side folder (its HOME, TMPDIR, compile caches) once it is judged,
    whatever the verdict; the baseline's stays for the next gate."""
    from trainbridge.agents.profiler import judge

    baseline, candidate = tmp_path / "baseline", tmp_path / "candidate"
    for root in (baseline, candidate):
        shutil.copytree(TINY, root)
        (confinement.cache_dir(root) / "inductor" / "entry").mkdir(parents=True)

    def failing_gate(*args, **kwargs):
        raise RuntimeError("the gate broke")

    monkeypatch.setattr(judge, "run_gate", failing_gate)
    with pytest.raises(RuntimeError):
        judge.judge_candidate(baseline, candidate, target="cpu", rounds=2, max_rounds=2, min_gain=0.01)
    assert not confinement.side_folder(candidate).exists()
    assert (confinement.cache_dir(baseline) / "inductor" / "entry").is_dir()


@needs_bubblewrap
def test_probing_bubblewrap_as_a_subreaper_leaves_no_zombie_behind():
    """bubblewrap's inner process outlives the outer one, so a subreaper (the gate's process) receives it: the probe
    reaps it, as a long-lived process (the server, a test session) probing again must not collect zombies."""
    from trainbridge.sandbox import proc_watch

    assert proc_watch.become_subreaper()
    before = {s.pid for s in proc_watch.all_stats() if s.ppid == os.getpid() and s.state == "Z"}
    for _ in range(3):
        confinement.bubblewrap.cache_clear()
        assert confinement.bubblewrap().usable
    confinement.bubblewrap.cache_clear()
    zombies = [s.pid for s in proc_watch.all_stats() if s.ppid == os.getpid() and s.state == "Z" and s.pid not in before]
    assert zombies == []
