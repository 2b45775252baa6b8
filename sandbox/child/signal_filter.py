"""A forked gate child that stops, traces or writes into another process is killed (child side; a seccomp filter).

A fork server's children stay the gate's own children (sandbox/child/fork_server.py), so they are not in a
PID namespace of their own the way an exec'd child under bubblewrap is (sandbox/confinement.py): they see the
gate and the other side's child in /proc, with the same uid. Before any workload code runs, `install()` gives
the child a seccomp filter (inherited by everything it starts, kept across exec) that kills it (the whole
process, by SIGSYS: `KILLED_BY`) at the first attempt of:

- a stop signal (SIGSTOP, SIGTSTP, SIGTTIN, SIGTTOU) sent anywhere but to the child itself or its own
  process group (`kill`, `tkill`, `tgkill`, `rt_sigqueueinfo`, `rt_tgsigqueueinfo`; through a pidfd, whose
  target the filter cannot read, never): freezing the gate while the other side's reply waits in its pipe,
  or the other side while it is timed, makes that side's steps read late;
- `ptrace`, `process_vm_readv` and `process_vm_writev`: reading or rewriting another process's memory (the
  gate's clocks, the partner's loss);
- any system call of another ABI than the host's own (on x86-64: i386's `int 0x80`, and the x32 numbers), whose
  numbers the checks above would not see.

Every other call is allowed: the filter takes nothing a training program does away (its own signals, its
DataLoader workers' SIGTERM/SIGKILL, its threads). A child killed by SIGSYS is reported as such
(sandbox/runner.py, `FailureKind.forbidden_call`), and a candidate's is rejected as tampered_resources. The filter is built for x86-64 and aarch64 (Ascend's hosts);
elsewhere `install` returns False and changes nothing. The gate still watches for what the filter does not
stop (proc_watch, the partner's `waitid` events, the tamper hashes of agents/profiler/tamper.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import signal
import struct
from dataclasses import dataclass

STOP_SIGNALS = (signal.SIGSTOP, signal.SIGTSTP, signal.SIGTTIN, signal.SIGTTOU)
KILLED_BY = signal.SIGSYS  # what the kernel kills a filtered process with
WHAT_IT_FORBIDS = ("a stop signal to another process, ptrace, or reading or writing another process's memory "
                   "(sandbox/child/signal_filter.py)")


@dataclass(frozen=True)
class Arch:
    audit: int  # AUDIT_ARCH_* as seccomp_data.arch carries it
    kill: int
    tkill: int
    tgkill: int
    rt_sigqueueinfo: int
    rt_tgsigqueueinfo: int
    pidfd_send_signal: int
    ptrace: int
    process_vm_readv: int
    process_vm_writev: int
    x32_bit: int | None = None  # numbers at or past this are another ABI's (x86-64's x32)


ARCHES = {
    "x86_64": Arch(audit=0xC000003E, kill=62, tkill=200, tgkill=234, rt_sigqueueinfo=129, rt_tgsigqueueinfo=297,
                   pidfd_send_signal=424, ptrace=101, process_vm_readv=310, process_vm_writev=311, x32_bit=0x40000000),
    "aarch64": Arch(audit=0xC00000B7, kill=129, tkill=130, tgkill=131, rt_sigqueueinfo=138, rt_tgsigqueueinfo=240,
                    pidfd_send_signal=424, ptrace=117, process_vm_readv=270, process_vm_writev=271),
}

# classic BPF, as seccomp reads it
_LD_ABS, _JEQ, _JGE, _RET = 0x20, 0x15, 0x35, 0x06
_ALLOW, _DENY = 0x7FFF0000, 0x80000000  # SECCOMP_RET_ALLOW; SECCOMP_RET_KILL_PROCESS
_NR, _ARCH = 0, 4  # offsets in struct seccomp_data


def _arg(index: int) -> int:
    return 16 + 8 * index  # the low 32 bits of args[index] (little-endian hosts)


_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


class _Program:
    """A tiny assembler: instructions with forward jumps to named labels."""

    def __init__(self) -> None:
        self.code: list[tuple] = []
        self.labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def load(self, offset: int) -> None:
        self.code.append((_LD_ABS, None, None, offset))

    def jump_if(self, op: int, value: int, target: str, otherwise: str | None = None) -> None:
        self.code.append((op, target, otherwise, value & 0xFFFFFFFF))

    def ret(self, action: int) -> None:
        self.code.append((_RET, None, None, action))

    def assemble(self) -> bytes:
        out = b""
        for here, (op, true, false, k) in enumerate(self.code):
            jt = self.labels[true] - here - 1 if true else 0
            jf = self.labels[false] - here - 1 if false else 0
            if not (0 <= jt < 256 and 0 <= jf < 256):
                raise ValueError("a jump of the signal filter does not fit")
            out += struct.pack("=HBBI", op, jt, jf, k)
        return out


def program(arch: Arch, own_pid: int) -> bytes:
    """The filter's instructions for a child whose pid (and process group) is `own_pid`."""
    p = _Program()
    p.load(_ARCH)
    p.jump_if(_JEQ, arch.audit, "native", "deny")  # another ABI (i386's int 0x80 on x86-64) has other numbers: never
    p.label("native")
    p.load(_NR)
    if arch.x32_bit is not None:
        p.jump_if(_JGE, arch.x32_bit, "deny")
    for number in (arch.ptrace, arch.process_vm_readv, arch.process_vm_writev):
        p.jump_if(_JEQ, number, "deny")
    # (syscall, argument holding the signal, argument holding the target, targets that are the child's own)
    checks = [("kill", arch.kill, 1, 0, (own_pid, 0, -own_pid)), ("rt_sigqueueinfo", arch.rt_sigqueueinfo, 1, 0, (own_pid, 0, -own_pid)),
              ("tkill", arch.tkill, 1, 0, (own_pid,)), ("tgkill", arch.tgkill, 2, 0, (own_pid,)),
              ("rt_tgsigqueueinfo", arch.rt_tgsigqueueinfo, 2, 0, (own_pid,)), ("pidfd", arch.pidfd_send_signal, 1, None, ())]
    for name, number, _, _, _ in checks:
        p.jump_if(_JEQ, number, name)
    p.ret(_ALLOW)
    for name, _, sig_arg, target_arg, own in checks:
        p.label(name)
        p.load(_arg(sig_arg))
        for number in STOP_SIGNALS:
            p.jump_if(_JEQ, int(number), f"{name}-stop")
        p.ret(_ALLOW)
        p.label(f"{name}-stop")
        if target_arg is not None:
            p.load(_arg(target_arg))
            for target in own:
                p.jump_if(_JEQ, target, "allow")
        p.ret(_DENY)
    p.label("deny")
    p.ret(_DENY)
    p.label("allow")
    p.ret(_ALLOW)
    return p.assemble()


def install() -> bool:
    """Give this process (and what it starts) the filter; False, with nothing changed, where the host has no
    seccomp or its architecture is not one the filter is written for."""
    arch = ARCHES.get(platform.machine())
    if arch is None:
        return False
    code = program(arch, os.getpid())
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        buffer = ctypes.create_string_buffer(code, len(code))

        class SockFprog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        fprog = SockFprog(len(code) // 8, ctypes.cast(buffer, ctypes.c_void_p))
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return False
        return libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) == 0
    except (OSError, AttributeError):
        return False
