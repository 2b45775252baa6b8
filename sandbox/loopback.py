"""The sandbox's loopback: torchrun's rendezvous over 127.0.0.1 inside the sandbox's own network namespace (runs INSIDE the sandbox).

`unshare --net` gives a sandbox child an empty network namespace whose loopback interface is down;
a torch.distributed process group (one torchrun worker: sandbox/script/launcher.py; several ranks:
sandbox/child/rank_supervisor.py) needs it up, and a free port on it for MASTER_PORT. Standard library only.
"""

from __future__ import annotations


def free_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on now (torchrun's MASTER_PORT)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def loopback_up() -> str | None:
    """Bring up the loopback interface of the sandbox's own network namespace (`unshare --net` leaves it down),
    so a process group can form over 127.0.0.1; nothing outside the namespace becomes reachable.
    Returns a note when it could not (then init_process_group waits until the timeout)."""
    import fcntl
    import socket
    import struct

    siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            flags = struct.unpack("16sh", fcntl.ioctl(probe, siocgifflags, struct.pack("16sh", b"lo", 0)))[1]
            if not flags & iff_up:
                fcntl.ioctl(probe, siocsifflags, struct.pack("16sh", b"lo", flags | iff_up))
    except OSError as exc:
        return f"the loopback interface could not be brought up ({exc}): a torchrun process group may not form"
    return None
