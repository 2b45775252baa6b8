"""Facts about the host the tests run on, for tests whose expectation depends on it."""

from __future__ import annotations

import importlib.util

import pytest

# find_spec only looks: importing a real torch_npu without CANN's environment breaks `import torch`.
REAL_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None

needs_no_torch_npu = pytest.mark.skipif(
    REAL_TORCH_NPU,
    reason="a real torch_npu is installed on this host: this test checks what a host without one does "
           "(refusals that name 'torch_npu is not installed'); on an Ascend host `trainbridge verify` and the "
           "NPU profile capture run instead of refusing",
)


def env_probe_report(result) -> dict:
    """What the env_probe workload (tests/fixtures/workloads/env_probe) printed: its environment and interfaces."""
    import json

    lines = [line for line in result.stdout_tail.splitlines() if line.startswith("TB-ENV-PROBE ")]
    assert lines, f"the env probe printed nothing: {result.stdout_tail[-500:]} {result.stderr_tail[-500:]}"
    return json.loads(lines[-1][len("TB-ENV-PROBE "):])
