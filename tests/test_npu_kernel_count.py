"""NPU kernels per step on the emulated device (issue 25, item 4): what counts as one kernel
(sandbox/npu_emulation/torch_npu/_kernel_count.py), in a child process with the device registered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env

_SCRIPT = textwrap.dedent("""
    import json
    import torch
    import torch_npu

    count = torch_npu.__trainbridge_kernels_launched__
    r = {}

    def kernels(fn):
        before = count()
        fn()
        return count() - before

    x = torch.randn(4, 8, 64).npu()
    w = torch.ones(64).npu()
    r["views"] = kernels(lambda: (x.view(32, 64).t(), x.transpose(0, 1), x[:, :2], x.unsqueeze(0), x.detach(), x.expand(2, 4, 8, 64)))
    r["copies"] = kernels(lambda: (x.cpu(), torch.randn(3).npu(), x.sum().item()))  # sum: one kernel; the copies none
    r["add"] = kernels(lambda: x + x)
    r["cast"] = kernels(lambda: x.half())  # a cast on the device is a kernel
    r["fused_rms_norm"] = kernels(lambda: torch_npu.npu_rms_norm(x, w))
    r["eager_rms_norm"] = kernels(lambda: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w)

    xg = x.clone().requires_grad_()
    wg = w.clone().requires_grad_()
    y = torch_npu.npu_rms_norm(xg, wg)[0].sum()
    grad = torch.ones((), device="npu")
    r["fused_backward"] = kernels(lambda: torch.autograd.grad(y, (xg, wg), grad))
    y = (xg * torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + 1e-6) * wg).sum()
    r["eager_backward"] = kernels(lambda: torch.autograd.grad(y, (xg, wg), grad))
    r["host_ops"] = kernels(lambda: torch.randn(8, 8) @ torch.randn(8, 8))  # the CPU's work is not the NPU's
    print("RESULT " + json.dumps(r))
""")


def _run(tmp_path: Path) -> dict:
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if not k.startswith("TRAINBRIDGE_NPU_EMULATION")})
    path = tmp_path / "child.py"
    path.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(path)], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_kernels_are_device_ops_and_a_fused_api_is_one_each_way(tmp_path):
    r = _run(tmp_path)
    assert r["views"] == 0  # views, detach, expand: metadata only
    assert r["copies"] == 1  # host <-> device copies are memory copies; the sum before .item() is the one kernel
    assert r["add"] == 1 and r["cast"] == 1
    assert r["fused_rms_norm"] == 1  # several host ops inside, one kernel on an NPU
    assert r["eager_rms_norm"] == 6  # pow, mean, add, rsqrt, mul, mul
    # backward: the fused API's backward is one kernel (plus the sum's and the seed's), the eager chain one per op
    assert r["fused_backward"] < r["eager_backward"] and r["fused_backward"] <= 3
    assert r["host_ops"] == 0
