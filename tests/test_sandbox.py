"""The sandbox runner on real child processes: no mocks of the sandbox."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from trainbridge.sandbox import confinement
from trainbridge.sandbox.isolation import NetworkIsolation, network_isolation
from trainbridge.sandbox.results import FailureKind
from trainbridge.sandbox.runner import run_workload
from trainbridge.sandbox.workload import WorkloadConfigError, load_workload
from trainbridge.tests.host import env_probe_report

WORKLOADS = Path(__file__).parent / "fixtures" / "workloads"


def run(name: str, **kwargs):
    return run_workload(load_workload(WORKLOADS / name), **kwargs)


def test_successful_run_reports_times_losses_memory_and_versions():
    result = run("tiny")
    assert result.ok, result.failure
    assert len(result.warmup_times_s) == 1 and len(result.step_times_s) == 3
    assert all(t > 0 for t in result.step_times_s)
    assert len(result.losses) == 4 and all(math.isfinite(v) for v in result.losses)
    assert result.peak_memory_bytes and result.peak_memory_bytes > 10 * 1024**2
    assert result.versions["torch"].startswith("2.")
    assert result.median_step_s() == sorted(result.step_times_s)[1]


def test_same_seed_gives_identical_losses_and_other_seed_differs(tmp_path):
    first, second = run("tiny"), run("tiny")
    assert first.losses == second.losses
    other = run_workload(load_workload(WORKLOADS / "tiny").with_overrides(seed=7))
    assert other.ok and other.losses != first.losses


def test_hanging_workload_is_killed_with_its_process_group_within_the_timeout():
    started = time.monotonic()
    result = run("hang")
    elapsed = time.monotonic() - started
    assert result.failure is not None and result.failure.kind == FailureKind.timeout
    assert "4 s limit" in result.failure.message
    assert elapsed < 4 + 10, f"took {elapsed:.1f}s for a 4s timeout"
    time.sleep(0.5)
    sleepers = subprocess.run(["pgrep", "-f", "time.sleep(600)"], capture_output=True, text=True).stdout.split()
    assert sleepers == [], "the grandchild in the workload's process group survived the kill"


def test_exception_returns_class_and_traceback_tail_and_step():
    result = run("raises")
    assert result.failure is not None and result.failure.kind == FailureKind.exception
    assert result.failure.exception_type == "ValueError"
    assert "shapes cannot be multiplied at step 1" in result.failure.message
    assert "shape_check" in result.failure.traceback_tail and "step.py" in result.failure.traceback_tail
    assert result.failure.step == 1
    assert len(result.losses) == 1  # the step before the failure was kept


def test_allocation_past_the_memory_cap_is_reported_as_out_of_memory():
    result = run("oom")
    assert result.failure is not None and result.failure.kind == FailureKind.oom, result.failure
    assert result.memory_limit_mb == 2048


def test_nan_loss_is_reported_with_its_step():
    result = run("nan")
    assert result.failure is not None and result.failure.kind == FailureKind.nonfinite_loss
    assert result.failure.step == 2
    assert result.losses[:2] == [1.0, 0.5] and math.isnan(result.losses[2])


def test_import_error_and_contract_violations_are_classified():
    missing = run("import_error")
    assert missing.failure.kind == FailureKind.import_error
    assert "flash_attn_that_is_not_installed" in missing.failure.message
    bad = run("bad_parts")
    assert bad.failure.kind == FailureKind.bad_workload
    assert "optimizer" in bad.failure.message and "train_step" in bad.failure.message


def test_secrets_do_not_reach_the_child_and_network_is_isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    monkeypatch.setenv("HF_TOKEN", "hf-should-not-leak")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-should-not-leak")
    monkeypatch.setenv("SOME_HARMLESS_SETTING", "also-dropped")
    result = run("env_probe", extra_env={"GITHUB_TOKEN": "ghp-should-not-leak"})
    assert result.ok, result.failure
    seen = env_probe_report(result)
    leaked = [name for name, value in seen["env"].items() if "should-not-leak" in value]
    assert leaked == []
    assert "SOME_HARMLESS_SETTING" not in seen["env"]
    assert seen["env"]["OMP_NUM_THREADS"] == "2"
    host_interfaces = sorted(name for _, name in socket.if_nameindex())
    isolation = network_isolation()
    assert result.network_isolated == isolation.isolated  # the run reports what the host allows
    if result.confined:  # bubblewrap's namespaces, the network's among them
        assert seen["interfaces"] == ["lo"], seen["interfaces"]
        assert result.network_isolated and result.isolation_notes[0].startswith("confined by bubblewrap")
    elif result.network_isolated:
        # a new, empty network namespace: only its own loopback, none of the host's interfaces
        assert seen["interfaces"] == ["lo"], seen["interfaces"]
        assert any("network isolated" in note for note in result.isolation_notes)
    else:
        # the host refuses namespaces: the child still runs, in the host's namespace, and the result
        # says so with the host's reason, so nobody mistakes the run for an isolated one
        assert seen["interfaces"] == host_interfaces
        assert isolation.prefix == () and any(note.startswith("network not isolated: ") and
                                              ("refuses" in note or "not installed" in note) for note in result.isolation_notes)


def test_a_host_that_refuses_namespaces_still_runs_the_child_and_says_so(tmp_path, monkeypatch):
    """What holds on such a host, checked on every host: the refusal is planted."""
    refused = NetworkIsolation((), False, ["network not isolated: this host refuses new network namespaces "
                                           "(unshare: unshare failed: Operation not permitted)"])
    monkeypatch.setattr(confinement, "bubblewrap", lambda: confinement.Tool(None, False, "bubblewrap is not installed"))
    monkeypatch.setattr(confinement, "network_isolation", lambda: refused)
    monkeypatch.setenv("OPENAI_API_KEY", "sk-should-not-leak")
    result = run("env_probe")
    assert result.ok, result.failure
    assert result.network_isolated is False and not result.confined
    assert result.isolation_notes == ["not confined: bubblewrap is not installed; the child can write wherever TrainBridge can",
                                      *refused.notes]
    seen = env_probe_report(result)
    assert seen["interfaces"] == sorted(name for _, name in socket.if_nameindex())  # the host's own namespace
    assert "OPENAI_API_KEY" not in seen["env"]  # the other protections do not depend on the namespace


def test_malformed_config_names_the_bad_key_and_line():
    with pytest.raises(WorkloadConfigError) as error:
        load_workload(WORKLOADS / "bad_key")
    message = str(error.value)
    assert "unknown key 'setps'" in message and "trainbridge.toml:3" in message


def test_config_errors_for_values_modes_and_missing_file(tmp_path):
    (tmp_path / "trainbridge.toml").write_text('entry = "train:build"\ncommand = "python train.py"\n')
    with pytest.raises(WorkloadConfigError, match="exactly one of"):
        load_workload(tmp_path)
    (tmp_path / "trainbridge.toml").write_text('entry = "train.build"\n')
    with pytest.raises(WorkloadConfigError, match=r"trainbridge.toml:1: entry: .*module:function"):
        load_workload(tmp_path)
    (tmp_path / "trainbridge.toml").write_text('entry = "train:build"\nsteps = -1\n')
    with pytest.raises(WorkloadConfigError, match=r":2: steps: "):
        load_workload(tmp_path)
    (tmp_path / "trainbridge.toml").write_text('entry = [\n')
    with pytest.raises(WorkloadConfigError, match="not valid TOML"):
        load_workload(tmp_path)
    (tmp_path / "trainbridge.toml").unlink()
    with pytest.raises(WorkloadConfigError, match="not found"):
        load_workload(tmp_path)


def test_command_mode_reads_step_times_and_losses_from_output():
    result = run("command_mode")
    assert result.ok, result.failure
    assert len(result.losses) == 5 and len(result.warmup_times_s) == 1 and len(result.step_times_s) == 4
    assert result.losses == sorted(result.losses, reverse=True)  # gradient descent on a convex loss


def test_progress_callback_reaches_the_total():
    seen: list[tuple[int, int]] = []
    run("tiny", on_progress=lambda done, total: seen.append((done, total)))
    assert seen[-1] == (4, 4)
    assert all(total == 4 for _, total in seen)


def test_the_parent_environment_is_untouched():
    before = dict(os.environ)
    run("tiny")
    assert dict(os.environ) == before
