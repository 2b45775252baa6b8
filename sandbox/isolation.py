"""How a sandbox child is confined: scrubbed environment, memory cap, process group, no network."""

from __future__ import annotations

import functools
import os
import re
import resource
import shutil
import subprocess
from dataclasses import dataclass, field

# Only these variables pass from the parent's environment; everything else (API keys, tokens,
# cloud credentials, proxies) is dropped. The harness adds what the run needs.
PASSED_THROUGH = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "TZ", "USER", "LOGNAME")
_SECRET_NAME = re.compile(r"(KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH|COOKIE|SESSION)", re.IGNORECASE)
MAX_DEFAULT_MEMORY_MB = 16 * 1024


def scrubbed_env(extra: dict[str, str] | None = None, *, threads: int, seed: int) -> dict[str, str]:
    """The child's whole environment. Names that look like secrets never pass, not even in `extra`."""
    env = {name: os.environ[name] for name in PASSED_THROUGH if name in os.environ}
    env.update(
        {
            "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads),
            "PYTHONHASHSEED": str(seed),
            "PYTHONDONTWRITEBYTECODE": "1",  # no __pycache__ inside the worktree under test
            "PYTHONUNBUFFERED": "1",
            "NO_PROXY": "*",
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
        }
    )
    env.update(extra or {})
    return {name: value for name, value in env.items() if not _SECRET_NAME.search(name)}


def default_memory_limit_mb() -> int:
    total_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)
    return int(min(MAX_DEFAULT_MEMORY_MB, total_mb * 3 // 4))


def limit_memory(limit_mb: int | None):
    """A preexec function that caps the child's address space (allocations past it fail)."""

    def apply() -> None:
        if limit_mb is not None:
            limit = limit_mb * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return apply


@dataclass(frozen=True)
class NetworkIsolation:
    prefix: tuple[str, ...]
    isolated: bool
    notes: list[str] = field(default_factory=list)


@functools.cache
def network_isolation() -> NetworkIsolation:
    """Run children in a new, empty network namespace when the host allows it; otherwise say so."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return NetworkIsolation((), False, ["network not isolated: `unshare` (util-linux) is not installed"])
    attempts = [(unshare, "--net", "--"), (unshare, "--map-root-user", "--net", "--")]
    errors = []
    for prefix in attempts:
        try:
            probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired) as exc:
            errors.append(str(exc))
            continue
        if probe.returncode == 0:
            return NetworkIsolation(tuple(prefix), True, ["network isolated: new empty network namespace"])
        errors.append(probe.stderr.strip() or f"exit {probe.returncode}")
    return NetworkIsolation((), False, [f"network not isolated: this host refuses new network namespaces ({'; '.join(errors)})"])
