"""A host tensor asked for in pinned memory (`torch.empty(n, dtype=torch.uint16, pin_memory=True)`, the later
Modded-NanoGPT records' shard loader) is an ordinary host tensor on the emulated npu, as `Tensor.pin_memory()` is
there: the records stopped at "NotImplementedError: ... implement `getPinnedMemoryAllocator` ... for PrivateUse1"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env

_SCRIPT = textwrap.dedent(r"""
    import json, torch, torch_npu
    tokens = torch.empty(6, dtype=torch.uint16, pin_memory=True)
    tokens.copy_(torch.arange(6).to(torch.uint16))
    on_device = tokens.to("npu", non_blocking=True).to(torch.int64)
    made = [torch.zeros(2, pin_memory=True), torch.ones(2, pin_memory=True), torch.full((2,), 3.0, pin_memory=True),
            torch.tensor([1, 2], pin_memory=True), torch.empty(2)]
    print("RESULT " + json.dumps({"host": str(tokens.device), "device": str(on_device.device),
                                  "values": on_device.cpu().tolist(), "made": [str(t.device) for t in made],
                                  "name": torch.empty.__name__}))
""")


@pytest.mark.parametrize("mode", ["backend", "map"])
def test_pinned_host_factories_make_host_tensors(tmp_path, mode):
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if k != "TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"})
    env.update({"TRAINBRIDGE_NPU_EMULATION_DEVICE": mode, "OMP_NUM_THREADS": "1"})
    (tmp_path / "pinned.py").write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "pinned.py")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["host"] == "cpu" and result["made"] == ["cpu"] * 5 and result["name"] == "empty"
    assert result["values"] == [0, 1, 2, 3, 4, 5]
    assert result["device"] == ("npu:0" if mode == "backend" else "cpu")
