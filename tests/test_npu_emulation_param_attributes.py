"""Parameters keep the Python attributes a program set on them when the module moves to the emulated npu device, as
on an NPU (`param.data` is replaced in place there). The later Modded-NanoGPT records tag their parameters
(`self.qkvo_w.module = 'attn'`, `param.label = ...`) to group them for the optimizers; on the emulated device
record 38 stopped at "AttributeError: 'NpuTensor' object has no attribute 'module'" and record 50 at '... 'label''."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env

_SCRIPT = textwrap.dedent(r"""
    import json, torch, torch_npu
    def tagged():
        m = torch.nn.Sequential(torch.nn.Linear(2, 4), torch.nn.Linear(4, 2))
        m[0].weight.label = "attn"
        m[1].weight.module = "mlp"
        return m
    a, b, c = tagged().npu(), tagged().to("npu"), tagged().npu().bfloat16()
    print("RESULT " + json.dumps({
        "device": str(a[0].weight.device),
        "kept": [getattr(m[0].weight, "label", None) for m in (a, b, c)] + [getattr(m[1].weight, "module", None) for m in (a, b, c)],
        "untagged": hasattr(a[0].bias, "label"), "dtype": str(c[0].weight.dtype)}))
""")


def test_parameter_attributes_survive_the_move_to_the_emulated_npu(tmp_path):
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if k != "TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"})
    env.update({"TRAINBRIDGE_NPU_EMULATION_DEVICE": "backend", "OMP_NUM_THREADS": "1"})
    (tmp_path / "tagged.py").write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(tmp_path / "tagged.py")], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["device"] == "npu:0" and result["dtype"] == "torch.bfloat16"
    assert result["kept"] == ["attn"] * 3 + ["mlp"] * 3
    assert result["untagged"] is False
