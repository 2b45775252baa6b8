"""A ported program's own torch.compile under the NPU emulation (issue 25, item 1): Dynamo traces on the
emulated npu device, the captured graph runs there (no Inductor for npu here, said once on stderr), with the
numerics of eager, the device check and the kernel count; `trainbridge measure` runs such a script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env

NOTE = "emulated npu: torch.compile runs the captured graph without Inductor (no NPU compiler here)"

_CHILD = textwrap.dedent(r"""
    import json, torch, torch_npu
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, d, heads, seq):
            super().__init__()
            self.heads = heads
            self.qkv = nn.Linear(d, 3 * d, bias=False)
            self.o = nn.Linear(d, d, bias=False)
            self.up = nn.Linear(d, 4 * d)
            self.down = nn.Linear(4 * d, d)
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.register_buffer("mask", torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1))

        def forward(self, x, buffer_mask):
            b, t, d = x.shape
            q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            scores = (q @ k.transpose(-2, -1)) / (d // self.heads) ** 0.5
            if buffer_mask:  # a mask buffer moved with the model
                mask = self.mask[:t, :t]
            else:  # made on the device inside forward, as examples/llama_pretrain/model.py does
                mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=q.device), diagonal=1)
            x = x + self.o((scores.masked_fill(mask, float("-inf")).softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.down(F.gelu(self.up(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self, vocab=64, d=32, heads=4, seq=16):
            super().__init__()
            self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
            self.blocks = nn.ModuleList([Block(d, heads, seq), Block(d, heads, seq)])
            self.head = nn.Linear(d, vocab, bias=False)
            self.head.weight = self.wte.weight  # tied

        def forward(self, idx, targets):
            x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
            for i, block in enumerate(self.blocks):
                x = block(x, buffer_mask=i == 0)
            return F.cross_entropy(self.head(x).view(-1, self.head.out_features), targets.view(-1), ignore_index=-1)

    def train(how):
        torch.manual_seed(0)
        model = GPT().to("npu")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        run = {"eager": model, "compiled": torch.compile(model) if how == "compiled" else None,
               "static": torch.compile(model, dynamic=False) if how == "static" else None}[how]
        g = torch.Generator().manual_seed(1)
        losses, kernels = [], []
        for _ in range(3):
            idx = torch.randint(0, 64, (2, 16), generator=g).npu()
            targets = torch.randint(0, 64, (2, 16), generator=g).npu()
            before = torch_npu.__trainbridge_kernels_launched__()
            loss = run(idx, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            kernels.append(torch_npu.__trainbridge_kernels_launched__() - before)
            losses.append(loss.item())
        params = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
        return run, losses, kernels, params

    r = {}
    # factories PyTorch builds by resizing an empty tensor report the size of their values
    r["factories"] = [list(torch.arange(5, device="npu").shape), list(torch.arange(1, 7, 2, device="npu").view(3, 1).shape),
                      list(torch.eye(2, 3, device="npu").shape), torch.arange(4, device="npu").view(2, 2).sum(0).tolist()]
    _, r["eager"], r["eager_kernels"], eager_params = train("eager")
    compiled, r["compiled"], r["compiled_kernels"], params = train("compiled")
    r["compiled_param_diff"] = (params - eager_params).abs().max().item()
    _, r["static"], _, static_params = train("static")
    r["static_param_diff"] = (static_params - eager_params).abs().max().item()
    # an OptimizedModule behaves as one: attributes, .to, state_dict, the device of its parameters
    r["module"] = [type(compiled).__name__, type(compiled._orig_mod).__name__, compiled.head.out_features,
                   str(compiled.to("npu").wte.weight.device), sorted(compiled.state_dict())[0]]

    @torch.compile
    def swish_scale(x, w):
        return F.silu(x) * w + torch.ones(x.shape[-1], device=x.device)

    x, w = torch.randn(4, 8), torch.randn(8, requires_grad=True)
    xn, wn = x.npu(), w.detach().npu().requires_grad_()
    out = swish_scale(xn, wn)
    out.sum().backward()
    expected = F.silu(x) * w + 1
    expected.sum().backward()
    r["decorated"] = [str(out.device), (out.cpu() - expected.detach()).abs().max().item(),
                      (wn.grad.cpu() - w.grad).abs().max().item()]

    # in-place work on a tensor the traced code made on the device; new shapes and a sliced view re-trace
    @torch.compile
    def rms(t):
        buf = torch.zeros(t.shape, device=t.device)
        buf.add_(t)
        return F.rms_norm(buf, (t.size(-1),))

    base = torch.randn(1, 8, 12)
    views = [base, base[:, 1:], base.view(1, 8, 3, 4), torch.randn(2, 3, 5)]
    r["views"] = max((rms(v.npu()).cpu() - F.rms_norm(v, (v.size(-1),))).abs().max().item() for v in views)

    # the device check still holds in compiled code: a host tensor next to a device tensor raises
    try:
        torch.compile(lambda a, b: a + b)(torch.ones(3).npu(), torch.ones(3))
        r["mixed"] = "no error"
    except RuntimeError as e:
        r["mixed"] = str(e)

    # a fused torch_npu API is one call in the captured graph: counted once, as in eager
    def fused(x, w):
        return torch_npu.npu_rms_norm(x, w)[0].sum()

    compiled_fused = torch.compile(fused)
    xf, wf = torch.randn(4, 8).npu(), torch.ones(8).npu()
    compiled_fused(xf, wf)
    counts = []
    for f in (fused, compiled_fused):
        before = torch_npu.__trainbridge_kernels_launched__()
        value = f(xf, wf).item()
        counts.append(torch_npu.__trainbridge_kernels_launched__() - before)
    r["fused_kernels"] = counts
    print("RESULT " + json.dumps(r))
""")


def _run_child(tmp_path: Path, script: str) -> tuple[dict, str]:
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    base = {k: v for k, v in os.environ.items()
            if k not in ("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP", "TRAINBRIDGE_NPU_EMULATION_DEVICE")}
    env = selection_env(selection, base)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    path = tmp_path / "child.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:]), proc.stderr


def test_a_program_compiling_its_model_on_the_emulated_npu_trains_like_eager(tmp_path):
    r, stderr = _run_child(tmp_path, _CHILD)
    assert r["factories"] == [[5], [3, 1], [2, 3], [2, 4]]
    eager = r["eager"]
    assert eager[-1] < eager[0]
    for how in ("compiled", "static"):  # torch.compile(model) and torch.compile(model, dynamic=False)
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(r[how], eager, strict=True)), (how, r[how], eager)
    assert r["compiled_param_diff"] < 1e-5 and r["static_param_diff"] < 1e-5
    assert r["module"] == ["OptimizedModule", "GPT", 64, "npu:0", "_orig_mod.blocks.0.down.bias"]
    device, out_diff, grad_diff = r["decorated"]
    assert device == "npu:0" and out_diff < 1e-6 and grad_diff < 1e-6
    assert r["views"] < 1e-5
    assert "Expected all tensors to be on the same device" in r["mixed"] and "npu:0 and cpu" in r["mixed"]
    # the graph's ops ran on the device (counted), the trace itself launched none: the first step counts
    # what eager's first step adds (AdamW's state) over the next ones, no more
    compiled, eager_kernels = r["compiled_kernels"], r["eager_kernels"]
    assert compiled[1] == compiled[2] and abs(compiled[1] - eager_kernels[1]) <= 0.1 * eager_kernels[1]
    assert compiled[0] - compiled[1] == eager_kernels[0] - eager_kernels[1]
    assert r["fused_kernels"][0] == r["fused_kernels"][1]
    assert stderr.count(NOTE) == 1, stderr[-2000:]


_SCRIPT = textwrap.dedent('''
    """A ported script: imports torch_npu, moves its model to npu and compiles it itself."""
    import torch
    import torch_npu
    from torch import nn


    class Block(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.qk = nn.Linear(width, 2 * width)
            self.proj = nn.Linear(width, width)

        def forward(self, x):
            q, k = self.qk(x).chunk(2, dim=-1)
            mask = torch.triu(torch.ones(x.size(1), x.size(1), dtype=torch.bool, device=x.device), diagonal=1)
            scores = (q @ k.transpose(-2, -1)).masked_fill(mask, float("-inf"))
            return x + self.proj(torch.softmax(scores, dim=-1) @ x)


    torch.manual_seed(0)
    model = Block(16).npu()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model = torch.compile(model)
    data = torch.randn(4, 8, 16).npu()
    for step in range(50):
        loss = model(data).pow(2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.5f}", flush=True)
''')


def test_measure_runs_a_ported_script_that_compiles_its_model(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(_SCRIPT)
    (repo / "trainbridge.toml").write_text('launch = "python train.py"\nwarmup_steps = 1\nsteps = 2\ntimeout_s = 120\n')
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "-m", "trainbridge", "measure", str(repo), "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    payload = json.loads(out.read_text())
    assert payload["backend"] == "npu" and payload["mode"] == "script" and payload["failure"] is None
    assert payload["versions"]["torch_npu_mode"] == "emulated"
    assert NOTE in payload["stderr_tail"]
    assert len(payload["step_times_s"]) == 2 and payload["losses"][-1] < payload["losses"][0]
    assert all(k > 0 for k in payload["device_kernels_per_step"])


_EMPTY = textwrap.dedent(r"""
    import json, torch, torch_npu

    def boundaries(docs):  # a ported FlexAttention document mask: a host read, then nonzero over the device tensor
        if bool((docs[1:] < docs[:-1]).any()):
            raise ValueError("decreasing")
        return torch.nonzero(docs[1:] != docs[:-1]).flatten() + 1

    @torch.compile
    def step(tokens, bos):
        starts = boundaries((tokens == bos).cumsum(0))
        return starts.numel(), starts.device.type

    tokens = torch.tensor([1, 2, 3, 1, 2, 3]).npu()
    empty = torch.zeros(0, 1).npu()
    add = torch.compile(lambda e, x: x + e.numel())
    print("RESULT " + json.dumps({"one_document": step(tokens, 7), "three_documents": step(tokens, 3),
                                  "empty_input": add(empty, torch.ones(2).npu()).tolist()}))
""")


def test_an_empty_device_tensor_enters_a_compiled_frame(tmp_path):
    """An empty NpuTensor (torch.nonzero finding no document boundary) as the input of a compiled frame: Dynamo's
    fake copy of a zero-byte storage resized the fake's storage, which a Python backend cannot ("register
    PrivateUse1HooksInterface ... resizePrivateUse1Bytes"; Modded-NanoGPT record 12's ported document mask)."""
    r, _ = _run_child(tmp_path, _EMPTY)
    assert r["one_document"] == [0, "npu"] and r["three_documents"] == [2, "npu"]
    assert r["empty_input"] == [1.0, 1.0]
