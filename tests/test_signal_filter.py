"""The system-call filter of forked gate children (sandbox/child/signal_filter.py, issue 24): a child that sends a
stop signal to another process, traces one or reads another's memory is killed by SIGSYS at that call; what a
training program does to itself and its own children still works. Each case runs in a throw-away forked process."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import signal
import subprocess

import pytest

from trainbridge.sandbox.child import signal_filter

needs_filter = pytest.mark.skipif(platform.machine() not in signal_filter.ARCHES, reason="no filter for this architecture")


def _in_filtered_child(action) -> int:
    """Fork, start a session, install the filter, run `action()`; the child's exit status (negative: its signal)."""
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            os.setsid()
            if not signal_filter.install():
                os._exit(4)
            action()
            code = 0
        except BaseException:  # noqa: BLE001 - reported by the exit code
            code = 5
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "30"], start_new_session=True)


@needs_filter
def test_a_stop_signal_to_the_gate_kills_the_child_and_the_gate_runs_on():
    assert _in_filtered_child(lambda: os.kill(os.getppid(), signal.SIGSTOP)) == -signal.SIGSYS
    assert _in_filtered_child(lambda: os.kill(os.getppid(), signal.SIGTSTP)) == -signal.SIGSYS
    assert _in_filtered_child(lambda: os.kill(-os.getpgid(os.getppid()), signal.SIGSTOP)) == -signal.SIGSYS  # its process group
    assert _in_filtered_child(lambda: os.kill(-1, signal.SIGSTOP)) == -signal.SIGSYS  # every process it may signal


@needs_filter
def test_a_stop_signal_to_a_partner_kills_the_child_and_the_partner_never_stops():
    partner = _sleeper()
    try:
        assert _in_filtered_child(lambda: os.kill(partner.pid, signal.SIGSTOP)) == -signal.SIGSYS
        assert _in_filtered_child(lambda: signal.pidfd_send_signal(os.pidfd_open(partner.pid), signal.SIGSTOP)) == -signal.SIGSYS
        with open(f"/proc/{partner.pid}/stat", "rb") as handle:
            assert handle.read().rsplit(b")", 1)[1].split()[0] == b"S"  # sleeping, never stopped
    finally:
        partner.kill()
        partner.wait()


@needs_filter
def test_tracing_or_reading_another_process_kills_the_child():
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    partner = _sleeper()
    try:
        ptrace_attach = 16
        assert _in_filtered_child(lambda: libc.ptrace(ptrace_attach, partner.pid, None, None)) == -signal.SIGSYS

        class IoVec(ctypes.Structure):
            _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

        buffer = ctypes.create_string_buffer(8)
        local, remote = IoVec(ctypes.cast(buffer, ctypes.c_void_p), 8), IoVec(0x400000, 8)
        assert _in_filtered_child(lambda: libc.process_vm_readv(partner.pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)) \
            == -signal.SIGSYS
    finally:
        partner.kill()
        partner.wait()


@needs_filter
def test_what_a_training_program_does_to_itself_and_its_children_still_works():
    def own_business():
        worker = subprocess.Popen(["sleep", "30"])  # a DataLoader worker, say: its own child
        worker.send_signal(signal.SIGTERM)
        assert worker.wait() == -signal.SIGTERM
        os.kill(os.getpid(), signal.SIGCONT)  # continuing is not stopping
        os.kill(0, signal.SIGCONT)  # its own process group
        signal.signal(signal.SIGUSR1, lambda *_: None)
        os.kill(os.getpid(), signal.SIGUSR1)  # any other signal to itself

    assert _in_filtered_child(own_business) == 0


@needs_filter
def test_a_child_may_stop_itself():
    def stop_self_then_exit():
        os.kill(os.getpid(), signal.SIGSTOP)

    pid = os.fork()
    if pid == 0:
        os.setsid()
        signal_filter.install()
        stop_self_then_exit()
        os._exit(0)
    _, status = os.waitpid(pid, os.WUNTRACED)
    assert os.WIFSTOPPED(status) and os.WSTOPSIG(status) == signal.SIGSTOP
    os.kill(pid, signal.SIGCONT)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_an_architecture_without_a_filter_changes_nothing(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "riscv64")
    assert signal_filter.install() is False


def test_every_architecture_s_program_assembles():
    for arch in signal_filter.ARCHES.values():
        code = signal_filter.program(arch, 12345)
        assert len(code) % 8 == 0 and 20 < len(code) // 8 < 256
