"""`trainbridge port --to npu` on FP8 matmul custom ops written the way the Modded-NanoGPT records write them
(a `torch.library.custom_op` around `torch._scaled_mm` with float8_e4m3fn/e5m2 casts and scales, a backward op,
`register_fake`, `register_autograd`): the port makes them bf16 matmuls, keeps the ops' signatures and autograd,
reports each change as a precision change, and the ported program runs under the emulated torch_npu with outputs
and gradients matching the FP8 op's math carried out in bf16 (and the full-precision product within bf16 error),
and the original FP8 op (run on the host, where torch._scaled_mm runs) within FP8 error.
The program is our own, in the records' style; no record code is in this repository."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from trainbridge.tools.porting import ChangeKind, SkipCategory, port_source
from trainbridge.tools.porting.fp8 import PRECISION_REVIEW

PROGRAM = textwrap.dedent('''\
    """A GPT head whose training matmul runs in FP8 (record style)."""
    import os

    import torch
    import torch.nn.functional as F
    from torch import Tensor, nn

    device = "cuda"


    @torch.library.custom_op("tbtest::fp8_matmul", mutates_args=())
    def fp8_matmul(x: Tensor, w: Tensor, x_scale: float, w_scale: float, g_scale: float) -> tuple[Tensor, Tensor, Tensor]:
        def quantized(x: Tensor, w: Tensor):
            xq = x.div(x_scale).to(torch.float8_e4m3fn)
            wq = w.div(w_scale).to(torch.float8_e4m3fn)
            y = torch._scaled_mm(
                xq,
                wq.T,
                out_dtype=torch.bfloat16,
                scale_a=x.new_tensor(x_scale, dtype=torch.float32),
                scale_b=x.new_tensor(w_scale, dtype=torch.float32),
                use_fast_accum=True,
            )
            return y, xq, wq

        return quantized(x, w)


    @fp8_matmul.register_fake
    def _(x: Tensor, w: Tensor, *_):
        return x @ w.T, x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)


    @torch.library.custom_op("tbtest::fp8_matmul_grad", mutates_args=())
    def fp8_matmul_grad(g: Tensor, xq: Tensor, wq: Tensor, x_scale: float, w_scale: float,
                        g_scale: float) -> tuple[Tensor, Tensor]:
        sx = g.new_tensor(x_scale, dtype=torch.float32)
        sw = g.new_tensor(w_scale, dtype=torch.float32)
        sg = g.new_tensor(g_scale, dtype=torch.float32)
        gq = g.div(g_scale).to(torch.float8_e5m2)
        grad_x = torch._scaled_mm(gq, wq.T.contiguous().T, sg, sw, out_dtype=torch.bfloat16)
        grad_w = torch._scaled_mm(xq.T.contiguous(), gq.T.contiguous().T, out_dtype=torch.float32,
                                  scale_a=sx, scale_b=sg).T
        return grad_x, grad_w


    @fp8_matmul_grad.register_fake
    def _(g: Tensor, xq: Tensor, wq: Tensor, *_):
        return xq.to(torch.bfloat16), wq.T.contiguous().T.to(torch.float32)


    def _backward(ctx, grad_y: Tensor, *_):
        xq, wq = ctx.saved_tensors
        grad_x, grad_w = torch.ops.tbtest.fp8_matmul_grad(grad_y, xq, wq, *ctx.scales)
        return grad_x, grad_w, None, None, None


    def _setup(ctx, inputs, output):
        *_, x_scale, w_scale, g_scale = inputs
        _, xq, wq = output
        ctx.save_for_backward(xq, wq)
        ctx.scales = x_scale, w_scale, g_scale


    fp8_matmul.register_autograd(_backward, setup_context=_setup)


    class Head(nn.Linear):
        def __init__(self, dim: int, vocab: int, fp8: bool = True):
            super().__init__(dim, vocab, bias=False)
            self.fp8, self.scales = fp8, (dim ** 0.5 / 448, 2 ** -9, 1 / 448)

        def forward(self, x: Tensor) -> Tensor:
            if self.fp8 and self.training:
                flat = x.flatten(0, -2)
                return torch.ops.tbtest.fp8_matmul(flat, self.weight, *self.scales)[0].view(*x.shape[:-1], -1)
            return F.linear(x, self.weight.type_as(x))
    ''')

# The child: the ported program on the emulated NPU; saves what the parent checks.
CHILD = textwrap.dedent('''\
    import sys
    import torch, torch_npu
    assert torch_npu.__trainbridge_emulated__
    import program
    assert program.device == "npu", program.device
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 64, generator=gen)
    w = torch.randn(96, 64, generator=gen) * 0.05
    g = torch.randn(4, 8, 96, generator=gen)
    head = program.Head(64, 96).to(program.device)
    with torch.no_grad():
        head.weight.copy_(w)
    xd = x.to(program.device).requires_grad_()
    y = head(xd)
    y.backward(g.to(program.device))
    # the original FP8 op, on the host (torch._scaled_mm runs on the CPU), under another op namespace
    original = {}
    exec(open("original.py").read().replace("tbtest", "tborig"), original)
    xo = x.clone().requires_grad_()
    wo = w.clone().requires_grad_()
    yo = torch.ops.tborig.fp8_matmul(xo.flatten(0, -2), wo, *head.scales)[0].view(4, 8, -1)
    yo.backward(g)
    torch.save({"y": y.detach().cpu(), "grad_x": xd.grad.cpu(), "grad_w": head.weight.grad.cpu(),
                "x": x, "w": w, "g": g, "scales": head.scales, "y_dtype": str(y.dtype),
                "grad_w_dtype": str(head.weight.grad.dtype),
                "fp8": {"y": yo.detach(), "grad_x": xo.grad, "grad_w": wo.grad}}, sys.argv[1])
    ''')


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _reference(x, w, g, scales):
    """The FP8 op's math with its operands in bf16: y = (x/sx)(w/sw)^T sx sw, grad_x = (g/sg)(w/sw) sg sw,
    grad_w = ((x/sx)^T (g/sg))^T sx sg."""
    sx, sw, sg = scales
    x2, g2 = x.flatten(0, -2), g.flatten(0, -2)
    xq, wq, gq = _bf16(x2 / sx), _bf16(w / sw), _bf16(g2 / sg)
    y = (xq @ wq.T) * (sx * sw)
    grad_x = (gq @ wq) * (sg * sw)
    grad_w = (xq.T @ gq).T * (sx * sg)
    return y.view(*x.shape[:-1], -1), grad_x.view_as(x), grad_w


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp8_ops_become_bf16_matmuls_reported_as_precision_changes():
    result = port_source(PROGRAM, "program.py")
    kinds = [c.kind for c in result.changes]
    assert kinds.count(ChangeKind.fp8_matmul) == 3 and kinds.count(ChangeKind.fp8_dtype) == 5
    for change in result.changes:
        if change.kind in (ChangeKind.fp8_matmul, ChangeKind.fp8_dtype):
            assert change.review == PRECISION_REVIEW and change.review.startswith("precision change")
    assert not [s for s in result.skipped if s.category == SkipCategory.fp8]
    source = result.source
    assert "float8" not in source and "_scaled_mm" not in source
    # the ops keep their names, signatures and autograd registration: callers are untouched
    for kept in ('@torch.library.custom_op("tbtest::fp8_matmul", mutates_args=())', "@fp8_matmul.register_fake",
                 "fp8_matmul.register_autograd(_backward, setup_context=_setup)",
                 "torch.ops.tbtest.fp8_matmul(flat, self.weight, *self.scales)[0]"):
        assert kept in source
    # positional scales are read as scale_a, scale_b; out_dtype and the scales are kept
    assert "grad_x = (torch.mm(gq, wq.T.contiguous().T).to(torch.bfloat16) * (sg * sw))" in source
    assert "(torch.mm(xq.T.contiguous(), gq.T.contiguous().T).to(torch.float32) * (sx * sg)).T" in source
    assert port_source(source, "program.py").changes == []  # idempotent


def test_fp8_outside_a_scaled_mm_op_and_fp8_outputs_stay_reported():
    code = textwrap.dedent('''\
        import torch

        def quantize(w):
            return w.to(torch.float8_e4m3fn)

        def fp8_out(a, b, s):
            return torch._scaled_mm(a, b, scale_a=s, scale_b=s, scale_result=s, out_dtype=torch.float8_e4m3fn)
        ''')
    result = port_source(code, "q.py")
    assert {(s.line, s.category) for s in result.skipped} == {(4, SkipCategory.fp8), (7, SkipCategory.fp8)}
    assert any("scale_result" in s.reason for s in result.skipped if s.line == 7)
    # neither is touched: half a port of fp8_out would mix dtypes
    assert result.source == code and result.changes == []


def test_ported_fp8_program_runs_on_the_npu_emulation_and_matches_the_ops_math(tmp_path):
    from trainbridge.sandbox.npu_emulation import emulation_path

    result = port_source(PROGRAM, "program.py")
    (tmp_path / "program.py").write_text(result.source)
    (tmp_path / "child.py").write_text(CHILD)
    (tmp_path / "original.py").write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env.update(OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=str(emulation_path()))
    out = tmp_path / "out.pt"
    proc = subprocess.run([sys.executable, "child.py", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = torch.load(out)
    assert got["y_dtype"] == "torch.bfloat16" and got["grad_w_dtype"] == "torch.float32"
    y, grad_x, grad_w = _reference(got["x"], got["w"], got["g"], got["scales"])
    # against the op's math in bf16: only the rounding of the bf16 product and of its scaling differ
    assert _relative(got["y"], y) < 1e-2
    assert _relative(got["grad_x"], grad_x) < 1e-2
    assert _relative(got["grad_w"], grad_w) < 1e-2
    # and the full-precision product within bf16 error (FP8's e4m3 alone is ~3e-2 off)
    x2, g2 = got["x"].flatten(0, -2), got["g"].flatten(0, -2)
    assert _relative(got["y"], (x2 @ got["w"].T).view_as(got["y"])) < 1e-2
    assert _relative(got["grad_x"], (g2 @ got["w"]).view_as(got["grad_x"])) < 1e-2
    assert _relative(got["grad_w"], g2.T @ x2) < 1e-2
    # the original FP8 op on the host computes the same products, coarser: the port moved them toward the exact ones
    exact = {"y": (x2 @ got["w"].T).view_as(got["y"]), "grad_x": (g2 @ got["w"]).view_as(got["grad_x"]),
             "grad_w": g2.T @ x2}
    for name, fp8 in got["fp8"].items():
        assert _relative(fp8, got[name]) < 0.15, name
        assert _relative(got[name], exact[name]) < 0.5 * _relative(fp8, exact[name]), name


@pytest.mark.skipif(not hasattr(torch, "float8_e4m3fn"), reason="this torch has no float8 dtypes")
def test_fp8_rounding_is_coarser_than_the_bf16_port():
    """Why it is a precision change: e4m3 rounding alone moves a product by percents, bf16 by a fraction of one."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(64, 64, generator=gen), torch.randn(64, 64, generator=gen)
    exact = x @ w.T
    fp8 = x.to(torch.float8_e4m3fn).float() @ w.to(torch.float8_e4m3fn).float().T
    bf16 = _bf16(x) @ _bf16(w).T
    assert _relative(bf16, exact) < 0.25 * _relative(fp8, exact)
