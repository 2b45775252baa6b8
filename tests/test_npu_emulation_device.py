"""The emulated npu device, in child processes as the sandbox runs it: the real `npu` device type
(TRAINBRIDGE_NPU_EMULATION_DEVICE=backend, the default) and the npu -> cpu mapping (map).

Ported-program checks mirror what a real NPU does: transfers copy, a tensor left on the host next to
device tensors raises "Expected all tensors to be on the same device", torch.npu answers memory and
stream queries, DDP(model, device_ids=[local_rank]) trains, fused ops take device tensors.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env

DEVICE_ENV = "TRAINBRIDGE_NPU_EMULATION_DEVICE"

_DEVICE_SCRIPT = textwrap.dedent(r"""
    import json, math, torch, torch_npu
    import torch.nn.functional as F
    r = {"emulated": torch_npu.__trainbridge_emulated__, "version": torch_npu.__version__,
         "torch_npu_is_torch_npu": torch.npu is torch_npu.npu,
         "device_module": torch.get_device_module("npu") is torch_npu.npu}
    r["factories"] = sorted({str(t.device) for t in (
        torch.zeros(2, device="npu"), torch.ones(2, device="npu:0"), torch.randn(2, device=torch.device("npu", 0)),
        torch.arange(3, device="npu"), torch.tensor([1.0], device="npu"), torch.empty_like(torch.ones(1), device="npu"),
        torch.ones(1).to("npu"), torch.ones(1).to(torch.device("npu:0"), torch.float16), torch.ones(1).npu(),
        torch.ones(1).to(device="npu", non_blocking=True), torch.ones(1, device=0), torch.ones(1).to(0))})
    with torch.device("npu"):
        r["ctx"] = str(torch.zeros(1).device)
    with torch.autocast("npu", dtype=torch.bfloat16):
        r["autocast"] = str(torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype)
    r["pinned_loader"] = [str(b[0].device) for b in torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2, pin_memory=True)]

    class Block(torch.nn.Module):
        def __init__(self, npu):
            super().__init__()
            self.npu_ops = npu
            self.qkv = torch.nn.Linear(16, 48)
            self.up = torch.nn.Linear(16, 64)
            self.down = torch.nn.Linear(32, 16)
            self.norm = torch.nn.Parameter(torch.ones(16))
        def forward(self, x):
            b, s, _ = x.shape
            if self.npu_ops:
                h = torch_npu.npu_rms_norm(x, self.norm)[0]
                q, k, v = self.qkv(h).view(b, s, 3, 2, 8).unbind(2)
                mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device="npu"), diagonal=1)
                a = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", atten_mask=mask, scale=1 / math.sqrt(8),
                                                   sparse_mode=2)[0].reshape(b, s, 16)
                x = x + a
                return x + self.down(torch_npu.npu_swiglu(self.up(x)))
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm
            q, k, v = (t.transpose(1, 2) for t in self.qkv(h).view(b, s, 3, 2, 8).unbind(2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 16)
            x = x + a
            g, u = self.up(x).chunk(2, -1)
            return x + self.down(F.silu(g) * u)

    losses, params, grads = {}, {}, {}
    for name, npu in (("npu", True), ("cpu", False)):
        torch.manual_seed(0)
        model = Block(npu)
        x = torch.randn(2, 5, 16)
        if npu:
            model = model.to("npu")
            x = x.to("npu")
            opt = torch_npu.optim.NpuFusedAdamW(model.parameters(), lr=1e-2, eps=1e-4)
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, foreach=False)
        loss = model(x).pow(2).mean()
        loss.backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()]).cpu()
        opt.step()
        opt.zero_grad()
        losses[name] = (loss.item(), model(x).pow(2).mean().item())
        params[name] = torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()
        r[name + "_param_device"] = str(next(model.parameters()).device)
    r["losses"] = losses
    r["max_param_diff"] = (params["npu"] - params["cpu"]).abs().max().item()
    r["max_grad_diff"] = (grads["npu"] - grads["cpu"]).abs().max().item()
    r["accelerator"] = str(torch.accelerator.current_accelerator())
    print("RESULT " + json.dumps(r))
""")


def _run_child(tmp_path: Path, script: str, mode: str | None, timeout: int = 240, extra_env=None) -> dict:
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    base = {k: v for k, v in os.environ.items() if k not in ("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP", DEVICE_ENV)}
    env = selection_env(selection, base)
    if mode is not None:
        env[DEVICE_ENV] = mode
    env.update(extra_env or {})
    path = tmp_path / "child.py"
    path.write_text(script)
    proc = subprocess.run([sys.executable, str(path)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])


@pytest.mark.parametrize("mode", ["backend", "map", None])
def test_the_emulated_device_trains_a_tiny_model_with_fused_ops(tmp_path, mode):
    r = _run_child(tmp_path, _DEVICE_SCRIPT, mode)
    effective = mode or "backend"  # the default
    assert r["emulated"] is True and r["version"] == f"{torch.__version__.split('+')[0]}+trainbridge.{effective}"
    assert r["torch_npu_is_torch_npu"] and r["device_module"]
    device = "npu:0" if effective == "backend" else "cpu"
    assert r["factories"] == [device] and r["ctx"] == device and r["npu_param_device"] == device
    # autocast("npu") leaves host tensors alone on a real device; the mapping runs CPU autocast on them
    assert r["autocast"] == ("torch.float32" if effective == "backend" else "torch.bfloat16")
    assert r["pinned_loader"] == ["cpu", "cpu"]
    assert r["accelerator"] == "npu"
    (npu_before, npu_after), (cpu_before, cpu_after) = r["losses"]["npu"], r["losses"]["cpu"]
    assert npu_after < npu_before
    assert abs(npu_before - cpu_before) < 1e-5 and abs(npu_after - cpu_after) < 1e-5
    assert r["max_grad_diff"] < 1e-5 and r["max_param_diff"] < 1e-5


def test_an_unknown_device_mode_is_refused(tmp_path):
    with pytest.raises(AssertionError, match="TRAINBRIDGE_NPU_EMULATION_DEVICE must be one of backend, map"):
        _run_child(tmp_path, "import torch_npu\n", "gpu")


# --- a ported program on the real device type ------------------------------------------------------

_PORTED_SCRIPT = textwrap.dedent(r"""
    import json, torch, torch_npu
    r = {}
    def error(fn):
        try:
            fn()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return None

    # transfers copy
    x = torch.ones(3)
    y = x.npu(); y.add_(1)
    z = x.to("npu"); z.mul_(5)
    a = torch.zeros(2)
    b = a.npu().requires_grad_()
    r["host_after_device_mutation"] = x.tolist()
    r["device_values"] = [y.cpu().tolist(), z.cpu().tolist()]
    r["device_types"] = [y.device.type, z.device.type, str(torch.zeros(1, device="npu").device)]
    r["host_requires_grad"] = a.requires_grad
    r["device_requires_grad"] = b.requires_grad
    r["back_on_host"] = [str(y.cpu().device), str(y.to("cpu").device), type(y.cpu()).__name__]
    r["is_npu"] = [y.is_npu, x.is_npu]

    # a tensor left on the host next to device tensors: the NPU's error
    model = torch.nn.Linear(4, 2).npu()
    r["host_input_error"] = error(lambda: model(torch.randn(3, 4)))
    r["mixed_add_error"] = error(lambda: y + torch.ones(3))
    r["host_scalar_ok"] = error(lambda: y * torch.tensor(2.0)) is None
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)  # forgot .npu()
    q = torch.randn(1, 2, 4, 8).npu()
    r["fused_host_mask_error"] = error(lambda: torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD", atten_mask=mask,
                                                                               sparse_mode=2))
    r["fused_device_mask_ok"] = error(lambda: torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD",
                                                                              atten_mask=mask.npu(), sparse_mode=2)) is None
    r["fused_host_gamma_error"] = error(lambda: torch_npu.npu_rms_norm(q, torch.ones(8)))
    r["numpy_error"] = error(lambda: y.numpy())

    # torch.npu memory / stream / event APIs answer
    npu = torch.npu
    s = npu.Stream()
    with npu.stream(s):
        w = torch.ones(4, device="npu") * 2
    s.synchronize(); npu.synchronize()
    e1, e2 = npu.Event(enable_timing=True), npu.Event(enable_timing=True)
    e1.record(); e2.record()
    r["apis"] = {"memory_allocated": npu.memory_allocated() > 0, "max_memory_allocated": npu.max_memory_allocated() > 0,
                 "mem_get_info": npu.mem_get_info()[0] > 0, "current_stream": str(npu.current_stream().device),
                 "elapsed": e1.elapsed_time(e2) >= 0, "device_count": npu.device_count(),
                 "is_available": npu.is_available(), "w": w.cpu().tolist(),
                 "allow_internal_format": npu.config.allow_internal_format}
    npu.set_compile_mode(jit_compile=False)
    r["jit_compile_false"] = npu.is_jit_compile_false()

    # the emulated NPU generator: seed/offset of fusion-attention dropout, the host stream untouched
    torch.npu.manual_seed(7)
    host_state = torch.get_rng_state()
    outs = [torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD", keep_prob=0.5) for _ in range(3)]
    r["seed_offsets"] = [[o[4], o[5]] for o in outs]
    r["host_generator_untouched"] = torch.equal(host_state, torch.get_rng_state())
    torch.npu.manual_seed(7)
    again = torch_npu.npu_fusion_attention(q, q, q, 2, "BNSD", keep_prob=0.5)
    r["replayed"] = torch.equal(again[0].cpu(), outs[0][0].cpu())
    state = torch.npu.get_rng_state()
    r["state_bytes"] = state.numel()
    torch.npu.set_rng_state(state)

    # ordinary random ops on device tensors use the device stream too (as on an NPU), and
    # activation checkpointing replays them from torch.npu.get_rng_state()
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint
    x = torch.randn(4, 8).npu()
    torch.npu.manual_seed(3)
    host_state = torch.get_rng_state()
    d1 = F.dropout(x, 0.5)
    r["dropout_host_untouched"] = torch.equal(host_state, torch.get_rng_state())
    torch.npu.manual_seed(3)
    r["dropout_replayed"] = torch.equal(d1.cpu(), F.dropout(x, 0.5).cpu())
    lin = torch.nn.Linear(8, 8).npu()
    f = lambda t: F.dropout(lin(t), 0.3, training=True).sum()
    w = torch.randn(4, 8).npu().requires_grad_()
    torch.npu.manual_seed(5); f(w).backward(); g_plain = w.grad.cpu().clone(); w.grad = None
    torch.npu.manual_seed(5); checkpoint(f, w, use_reentrant=False).backward()
    r["checkpoint_replays_dropout"] = torch.equal(g_plain, w.grad.cpu())
    r["versions"] = torch_npu.__version__
    print("RESULT " + json.dumps(r))
""")


def test_a_ported_program_sees_npu_device_semantics(tmp_path):
    r = _run_child(tmp_path, _PORTED_SCRIPT, "backend")
    assert r["host_after_device_mutation"] == [1.0, 1.0, 1.0]  # y = x.npu(); y.add_(1) copies
    assert r["device_values"] == [[2.0, 2.0, 2.0], [5.0, 5.0, 5.0]]
    assert r["device_types"] == ["npu", "npu", "npu:0"] and r["is_npu"] == [True, False]
    assert r["host_requires_grad"] is False and r["device_requires_grad"] is True
    assert r["back_on_host"] == ["cpu", "cpu", "Tensor"]
    same = "RuntimeError: Expected all tensors to be on the same device, but found at least two devices, npu:0 and cpu!"
    assert r["host_input_error"].startswith(same), r["host_input_error"]
    assert r["mixed_add_error"].startswith(same) and r["host_scalar_ok"]
    assert r["fused_host_mask_error"].startswith(same) and r["fused_device_mask_ok"]
    assert r["fused_host_gamma_error"].startswith(same)
    assert r["numpy_error"].startswith("TypeError: can't convert npu:0 device type tensor to numpy")
    assert r["apis"] == {"memory_allocated": True, "max_memory_allocated": True, "mem_get_info": True,
                         "current_stream": "npu:0", "elapsed": True, "device_count": 1, "is_available": True,
                         "w": [2.0, 2.0, 2.0, 2.0], "allow_internal_format": False}
    assert r["jit_compile_false"] is True
    # philox_engine_inputs(10) per call: the offset advances by 12 (rounded up to a multiple of 4)
    assert r["seed_offsets"] == [[7, 0], [7, 12], [7, 24]]
    assert r["host_generator_untouched"] and r["replayed"] and r["state_bytes"] > 16
    assert r["dropout_host_untouched"] and r["dropout_replayed"] and r["checkpoint_replays_dropout"]
    assert r["versions"].endswith("+trainbridge.backend")


_DDP_SCRIPT = textwrap.dedent(r"""
    import json, os, torch, torch_npu, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.npu.set_device(local_rank)
    dist.init_process_group("hccl")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).npu()
    ddp = DDP(model, device_ids=[local_rank])
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(rank + 1)
    loss = ddp(torch.randn(4, 8).npu()).pow(2).mean()
    loss.backward()
    grad = model[0].weight.grad.detach().cpu().flatten()
    opt.step()
    flat = torch.cat([p.detach().cpu().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat)
    grads = [torch.zeros_like(grad) for _ in range(2)]
    dist.all_gather(grads, grad)
    print("RESULT " + json.dumps({"rank": rank, "device": str(next(model.parameters()).device), "loss": loss.item(),
                                  "same_params": torch.equal(gathered[0], gathered[1]),
                                  "same_grads": torch.equal(grads[0], grads[1]),
                                  "current_device": torch.npu.current_device()}), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # gloo's worker threads can abort at interpreter finalization (pytorch/pytorch#179291): gloo's, not the emulation's
""")


def test_ddp_with_device_ids_trains_on_the_emulated_npu(tmp_path):
    """DDP(model, device_ids=[local_rank]) as NPU scripts write it, under torchrun with 'hccl' (gloo here)."""
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    env = selection_env(selection, {k: v for k, v in os.environ.items() if k != "TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP"})
    env.update({DEVICE_ENV: "backend", "TRAINBRIDGE_EMULATED_NPU_COUNT": "2", "OMP_NUM_THREADS": "1"})
    (tmp_path / "ddp.py").write_text(_DDP_SCRIPT)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(tmp_path / "ddp.py")], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    # the two ranks share one stdout: their lines can run together, so each flat RESULT object is read by itself
    results = sorted((json.loads(found) for found in re.findall(r"RESULT (\{[^{}]*\})", proc.stdout)), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["loss"] != results[1]["loss"]  # different data per rank ...
    assert all(r["same_grads"] and r["same_params"] for r in results)  # ... gradients averaged by DDP
    assert [r["current_device"] for r in results] == [0, 1]
    assert all(r["device"] == "npu:0" for r in results)  # known deviation: one npu:0 per process


_CONJ_SCRIPT = textwrap.dedent(r"""
    import json, torch, torch_npu
    angles = torch.tensor([0.5, 1.0, 2.0])
    a = torch.polar(torch.ones(3), angles)
    d = a.to("npu")
    r = {"conj_product": (d * d.conj()).cpu().real.tolist(), "host_product": (a * a.conj()).real.tolist()}
    x = torch.randn(2, 6, 2, 8)
    f = torch.polar(torch.ones(6, 4), torch.rand(6, 4) * 6.28)
    g = torch.randn(2, 6, 2, 8)

    def rotate(t, freqs):  # complex-multiply rotary: its backward conjugates
        c = torch.view_as_complex(t.reshape(*t.shape[:-1], -1, 2))
        return torch.view_as_real(c * freqs.view(1, 6, 1, 4)).flatten(3)

    grads = []
    for device in ("cpu", "npu"):
        t = x.to(device).detach().requires_grad_(True)
        rotate(t, f.to(device)).backward(g.to(device))
        grads.append(t.grad.cpu())
    r["grad_diff"] = (grads[0] - grads[1]).abs().max().item()
    print("RESULT " + json.dumps(r))
""")


def test_lazy_conj_views_keep_their_values_on_the_emulated_device(tmp_path):
    """a.conj() on a device tensor is a lazy view whose bit the wrapper did not carry: the next op read
    the plain values (a * a.conj() was a * a) and complex autograd, which conjugates, got wrong gradients."""
    r = _run_child(tmp_path, _CONJ_SCRIPT, "backend")
    assert r["conj_product"] == pytest.approx(r["host_product"], abs=1e-6) == [1.0, 1.0, 1.0]
    assert r["grad_diff"] < 1e-6
