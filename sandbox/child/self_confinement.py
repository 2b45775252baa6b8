"""A forked gate child confines itself as bubblewrap confines an exec'd one (child side; Linux).

A fork server's child must stay the gate's own child (sandbox/child/fork_server.py: the gate waits for it, sees it
stop, kills its group), so it cannot be started under bubblewrap (sandbox/confinement.py). Before any workload code
runs, `confine(writable)` makes it, in its own process:

- a user namespace of its own, in which it is `SANDBOX_UID` ('nobody', bubblewrap's --uid) mapped to TrainBridge's
  own uid, then holds no capability at all: the kernel refuses it every ptrace-style access to a process outside
  its namespace (opening `/proc/<gate>/mem` or the partner's, reading their environment, ptrace, process_vm_*),
  since none of those processes is in its user namespace and it has no CAP_SYS_PTRACE over theirs;
- a mount namespace of its own in which every mount is read-only (the installed tool, the virtual environment,
  site-packages, the user's checkout, every worktree including the baseline's, the other side's scratch, the run's
  state and knowledge base, /tmp) except the folders it is given (`writable`: its side's folder and its evidence
  folders, the same set an exec'd child gets bound writable), plus its own empty /dev/shm;
- no capability left to undo any of it (the namespace's mounts are locked below it, and remounting needs
  CAP_SYS_ADMIN, which it dropped); exec cannot give them back (its uid is not 0 in its namespace, and the seccomp
  filter the child installs next sets no_new_privs).

What it does not get that bubblewrap gives: a PID namespace (it still sees the other processes in /proc, and
sandbox/child/signal_filter.py stops it signalling or tracing them) and a network namespace of its own (it is in
its server's, which has no network: sandbox/isolation.py). `probe` tells whether this host allows it (user
namespaces and `mount_setattr`, Linux 5.12+); a server that cannot confine its children does not fork them where
bubblewrap confines exec'd ones (fork_server.ForkPool.fork).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Sequence

from trainbridge.sandbox.confinement import SANDBOX_UID

_CLONE_NEWNS, _CLONE_NEWUSER = 0x00020000, 0x10000000
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_AT_FDCWD, _AT_RECURSIVE = -100, 0x8000
_MOUNT_ATTR_RDONLY = 0x1
_SYS_MOUNT_SETATTR = 442  # the same number on x86-64 and aarch64 (the generic table)
_CAP_VERSION_3 = 0x20080522


class ConfinementError(OSError):
    """The host refused a step of the confinement (the child must not run its workload then)."""


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64), ("propagation", ctypes.c_uint64),
                ("userns_fd", ctypes.c_uint64)]


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise ConfinementError(errno, f"{what}: {os.strerror(errno)}")


def _write(path: str, text: str) -> None:
    try:
        with open(path, "w", encoding="ascii") as handle:
            handle.write(text)
    except OSError as exc:
        raise ConfinementError(exc.errno, f"writing {path}: {exc.strerror}") from exc


def _mount_attr(libc: ctypes.CDLL, path: str, *, set_: int = 0, clear: int = 0) -> None:
    attr = _MountAttr(set_, clear, 0, 0)
    _check(libc.syscall(_SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), _AT_RECURSIVE, ctypes.byref(attr),
                        ctypes.sizeof(attr)), f"mount_setattr {path}")


def confine(writable: Sequence[str]) -> None:
    """Confine this process (single-threaded: just forked) as the module doc says; ConfinementError, with the
    step that failed, where the host refuses one (the process is then half-confined: it must exit)."""
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(user, mount namespaces)")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{SANDBOX_UID} {uid} 1")
    _write("/proc/self/gid_map", f"{SANDBOX_UID} {gid} 1")
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "making the mounts private")
    _mount_attr(libc, "/", set_=_MOUNT_ATTR_RDONLY)
    _check(_own_shm(libc), "an own /dev/shm")
    for folder in dict.fromkeys(os.path.realpath(f) for f in writable):
        _check(libc.mount(folder.encode(), folder.encode(), None, _MS_BIND | _MS_REC, None), f"binding {folder}")
        _mount_attr(libc, folder, clear=_MOUNT_ATTR_RDONLY)
    header, data = _CapHeader(_CAP_VERSION_3, 0), (_CapData * 2)()
    _check(libc.capset(ctypes.byref(header), data), "dropping capabilities")


def _own_shm(libc: ctypes.CDLL) -> int:
    """Mount an empty tmpfs on /dev/shm (in a mount namespace of this process's own); 0 when done."""
    return libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=1777")


def private_shm() -> bool:
    """Only a mount namespace of its own with an empty /dev/shm (a forked child that is not confined: a file one child
    leaves there never reaches another; needs CAP_SYS_ADMIN, e.g. root); False, and nothing changed, where the host
    refuses."""
    try:
        libc = _libc()
        if libc.unshare(_CLONE_NEWNS) != 0 or libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
            return False
        return _own_shm(libc) == 0
    except (OSError, AttributeError):
        return False


def probe(writable: Sequence[str]) -> str | None:
    """Whether `confine(writable)` works here: tried in a throw-away forked process. None when it does, else why not
    (the failing step)."""
    return in_throwaway(lambda: confine(writable))


def in_throwaway(attempt) -> str | None:
    """Run `attempt` in a throw-away forked process (what it changes dies with it): None when it returned a true or
    None value, else why not (its exception, or that it returned false)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        code = 0
        try:
            if attempt() is False:
                os.write(write_end, b"the host refused")
                code = 1
        except Exception as exc:  # noqa: BLE001 - any refusal is the answer
            os.write(write_end, str(exc).encode()[:500])
            code = 1
        os._exit(code)
    os.close(write_end)
    why = b""
    while chunk := os.read(read_end, 512):
        why += chunk
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return why.decode(errors="replace") or f"the probe exited with {os.waitstatus_to_exitcode(status)}"
