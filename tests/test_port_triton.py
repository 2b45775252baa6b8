"""`trainbridge port --to npu` on Triton kernels written the way the Modded-NanoGPT records write them (symmetric
matmuls for a Newton-Schulz orthogonalisation, launched from Python launchers through autotuned @triton.jit
kernels with a jit helper), plus an elementwise kernel. Names differ from the records' on purpose: the port reads
what each kernel does. The ported program imports without Triton, runs under the emulated torch_npu, and each
ported launcher's output matches a reference written here from the kernel's math. Kernels the port cannot derive
stay, reported at their launch with why. The programs are our own; no record code is in this repository."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch

from trainbridge.tools.porting import ChangeKind, SkipCategory, port_source

KERNELS = textwrap.dedent('''\
    """Orthogonalised updates with symmetric-matmul Triton kernels (record style)."""
    import torch
    import triton
    import triton.language as tl

    device = "cuda"


    def _tile_configs():
        return [triton.Config({"BM": bm, "BN": bm, "BK": 32, "GROUP": 4}, num_warps=4) for bm in (32, 64)]


    @triton.jit
    def _tile_origin(pid, M, BM: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr):
        per_matrix = tl.cdiv(M, BM) * tl.cdiv(M, BN)
        batch = pid // per_matrix
        pid = pid % per_matrix
        row, col = tl.swizzle2d(pid // tl.cdiv(M, BN), pid % tl.cdiv(M, BN), tl.cdiv(M, BM), tl.cdiv(M, BN), GROUP)
        return batch, row * BM, col * BN


    @triton.autotune(configs=_tile_configs(), key=["M", "K"])
    @triton.jit
    def gram_kernel(src, dst, M, K, s_batch, s_row, s_col, d_batch, d_row, d_col,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
        batch, r0, c0 = _tile_origin(tl.program_id(axis=0), M, BM, BN, GROUP)
        if r0 > c0 + BN:
            return
        src += batch * s_batch
        dst += batch * d_batch
        rows = (r0 + tl.arange(0, BM)) % M
        cols = (c0 + tl.arange(0, BN)) % M
        ks = tl.arange(0, BK)
        left = src + (rows[:, None] * s_row + ks[None, :] * s_col)
        right = src + (ks[:, None] * s_col + cols[None, :] * s_row)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for step in tl.range(0, tl.cdiv(K, BK)):
            lhs = tl.load(left, mask=ks[None, :] < K - step * BK, other=0.0)
            rhs = tl.load(right, mask=ks[:, None] < K - step * BK, other=0.0)
            acc = tl.dot(lhs, rhs, acc)
            left += BK * s_col
            right += BK * s_col
        res = acc.to(dst.dtype.element_ty)
        out_rows = r0 + tl.arange(0, BM)
        out_cols = c0 + tl.arange(0, BN)
        tl.store(dst + (out_rows[:, None] * d_row + out_cols[None, :] * d_col), res,
                 mask=(out_rows[:, None] < M) & (out_cols[None, :] < M))
        tl.store(dst + (out_cols[:, None] * d_row + out_rows[None, :] * d_col), res.T,
                 mask=(out_cols[:, None] < M) & (out_rows[None, :] < M))


    @triton.autotune(configs=_tile_configs(), key=["M"])
    @triton.jit
    def gram_update_kernel(src, dst, M, s_batch, s_row, s_col, d_batch, d_row, d_col, scale_gram, scale_self,
                           BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr):
        batch, r0, c0 = _tile_origin(tl.program_id(axis=0), M, BM, BN, GROUP)
        if r0 > c0 + BN:
            return
        src += batch * s_batch
        dst += batch * d_batch
        rows = (r0 + tl.arange(0, BM)) % M
        cols = (c0 + tl.arange(0, BN)) % M
        ks = tl.arange(0, BK)
        left = src + (rows[:, None] * s_row + ks[None, :] * s_col)
        right = src + (ks[:, None] * s_col + cols[None, :] * s_row)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for step in tl.range(0, tl.cdiv(M, BK)):
            acc += tl.dot(tl.load(left, mask=ks[None, :] < M - step * BK, other=0.0),
                          tl.load(right, mask=ks[:, None] < M - step * BK, other=0.0))
            left += BK * s_col
            right += BK * s_col
        out_rows = r0 + tl.arange(0, BM)
        out_cols = c0 + tl.arange(0, BN)
        inside = (out_rows[:, None] < M) & (out_cols[None, :] < M)
        own = tl.load(src + (out_rows[:, None] * s_row + out_cols[None, :] * s_col), mask=inside, other=0.0)
        acc = acc * scale_gram + own.to(tl.float32) * scale_self
        res = acc.to(dst.dtype.element_ty)
        tl.store(dst + (out_rows[:, None] * d_row + out_cols[None, :] * d_col), res, mask=inside)
        tl.store(dst + (out_cols[:, None] * d_row + out_rows[None, :] * d_col), res.T,
                 mask=(out_cols[:, None] < M) & (out_rows[None, :] < M))


    @triton.jit
    def gated_kernel(x_ptr, gate_ptr, out_ptr, n, weight, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        x = tl.load(x_ptr + offs, mask=keep)
        gate = tl.load(gate_ptr + offs, mask=keep)
        tl.store(out_ptr + offs, x * tl.sigmoid(gate) * weight + x, mask=keep)


    def sym_gram(X: torch.Tensor, out: torch.Tensor):
        """
        Launch the Triton kernel to compute C = X @ X.T
        """
        M, K = X.shape[-2:]
        nb = X.size(0) if X.ndim == 3 else 1
        grid = lambda meta: (nb * triton.cdiv(M, meta["BM"]) * triton.cdiv(M, meta["BN"]),)
        gram_kernel[grid](X, out, M, K, X.stride(0) if X.ndim == 3 else 0, X.stride(-2), X.stride(-1),
                          out.stride(0) if out.ndim == 3 else 0, out.stride(-2), out.stride(-1))
        return out


    def sym_gram_update(A: torch.Tensor, g: float, s: float, out: torch.Tensor):
        """
        Launch the Triton kernel to compute C = g * A @ A.T + s * A
        """
        M = A.size(-1)
        nb = A.size(0) if A.ndim == 3 else 1
        grid = lambda meta: (nb * triton.cdiv(M, meta["BM"]) * triton.cdiv(M, meta["BN"]),)
        gram_update_kernel[grid](
            src=A, dst=out, M=M,
            s_batch=A.stride(0) if A.ndim == 3 else 0, s_row=A.stride(-2), s_col=A.stride(-1),
            d_batch=out.stride(0) if out.ndim == 3 else 0, d_row=out.stride(-2), d_col=out.stride(-1),
            scale_gram=g, scale_self=s,
        )
        return out


    def gated(x: torch.Tensor, gate: torch.Tensor, weight: float) -> torch.Tensor:
        out = torch.empty_like(x)
        gated_kernel[(triton.cdiv(x.numel(), 1024),)](x, gate, out, x.numel(), weight, BLOCK=1024)
        return out


    COEFFS = [(3.4445, -4.7750, 2.0315)] * 5


    def orthogonalize(G: torch.Tensor) -> torch.Tensor:
        X = G.bfloat16()
        if G.size(-2) > G.size(-1):
            X = X.mT
        X = (X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)).contiguous()
        A = torch.empty((*X.shape[:-1], X.size(-2)), device=X.device, dtype=X.dtype)
        B = torch.empty_like(A)
        for a, b, c in COEFFS:
            sym_gram(X, out=A)  # A = X @ X.mT
            sym_gram_update(A, g=c, s=b, out=B)  # B = b * A + c * A @ A
            X = a * X + B @ X
        if G.size(-2) > G.size(-1):
            X = X.mT
        return X


    def banner():
        return f"triton {triton.__version__}"
    ''')

CHILD = textwrap.dedent('''\
    import sys
    import torch, torch_npu
    assert torch_npu.__trainbridge_emulated__
    assert "triton" not in sys.modules
    import program
    assert "triton" not in sys.modules and program.device == "npu"
    gen = torch.Generator().manual_seed(0)
    dev = program.device
    X = torch.randn(3, 24, 40, generator=gen)
    X32 = X.to(dev)
    A = torch.empty(3, 24, 24, device=dev)
    program.sym_gram(X32, A)
    S = torch.randn(24, 24, generator=gen)
    S = (S + S.T).to(dev)  # the update kernel mirrors a triangle: its input is symmetric, as in the records
    B = torch.empty(24, 24, device=dev)
    program.sym_gram_update(S, 0.7, -1.3, B)
    x, gate = torch.randn(5, 33, generator=gen), torch.randn(5, 33, generator=gen)
    y = program.gated(x.to(dev), gate.to(dev), 0.25)
    G = torch.randn(2, 32, 48, generator=gen)
    O = program.orthogonalize(G.to(dev))
    torch.save({"X": X, "A": A.cpu(), "S": S.cpu(), "B": B.cpu(), "x": x, "gate": gate, "y": y.cpu(), "G": G,
                "O": O.float().cpu(), "banner": program.banner()}, sys.argv[1])
    ''')


def _line_of(code: str, start: str) -> int:
    return next(i for i, text in enumerate(code.splitlines(), 1) if text.strip().startswith(start))


def _port(code: str):
    result = port_source(code, "program.py")
    assert port_source(result.source, "program.py").changes == [], "porting twice must be a no-op"
    return result


def test_symmetric_matmul_and_elementwise_launches_are_derived_from_their_kernels():
    result = _port(KERNELS)
    launches = {c.line: c for c in result.changes if c.kind == ChangeKind.triton_launch}
    lines = KERNELS.splitlines()
    at = {name: next(i for i, text in enumerate(lines, 1) if text.strip().startswith(name)) for name in
          ("gram_kernel[grid]", "gram_update_kernel[grid]", "gated_kernel[")}
    assert set(launches) == set(at.values())
    gram, update, gate = (launches[at[n]] for n in at)
    assert gram.after == "torch.matmul(X, X.mT, out=out)"
    assert update.after == ("(torch.baddbmm if A.ndim == 3 else torch.addmm)(A, A, A.mT, beta=s, alpha=g, "
                            "out=out)")
    assert gate.after == "out.copy_((((x * torch.sigmoid(gate)) * weight) + x))"
    # the review note gives the formula, compares it with the launcher's docstring, and names the mirror
    assert "out = X @ X.T" in gram.review and "docstring says the same" in gram.review and "symmetric" in gram.review
    assert "out = g * A @ A.T + s * A" in update.review and "docstring says the same" in update.review
    assert "symmetric" not in gate.review
    removed = {c.before for c in result.changes if c.kind == ChangeKind.triton_removed}
    assert removed == {"def gram_kernel(...)", "def gram_update_kernel(...)", "def gated_kernel(...)",
                       "def _tile_origin(...)", "def _tile_configs(...)"}
    source = result.source
    assert "@triton" not in source and "tl." not in source and "grid = lambda" not in source
    # `triton` is still read for its version: the import is guarded, triton.language is gone
    assert "    triton = SimpleNamespace(__version__=None)" in source and "import triton.language" not in source
    assert 'return f"triton {triton.__version__}"' in source
    assert not [s for s in result.skipped if s.category == SkipCategory.triton]


def test_ported_kernels_run_without_triton_on_the_npu_emulation_and_match_the_kernels_math(tmp_path):
    from trainbridge.sandbox.npu_emulation import emulation_path

    (tmp_path / "program.py").write_text(_port(KERNELS).source)
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env.update(OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=str(emulation_path()))
    out = tmp_path / "out.pt"
    proc = subprocess.run([sys.executable, "child.py", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    got = torch.load(out)
    # references from the kernels' math (fp32 accumulate, cast to the output dtype), independent of the port
    X, S = got["X"].double(), got["S"].double()
    torch.testing.assert_close(got["A"].double(), X @ X.mT, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got["B"].double(), 0.7 * (S @ S.T) - 1.3 * S, rtol=1e-5, atol=1e-4)
    x, gate = got["x"], got["gate"]
    torch.testing.assert_close(got["y"], x * torch.sigmoid(gate) * 0.25 + x, rtol=1e-6, atol=1e-6)
    # the orthogonalisation with the ported launchers against the same iteration written with plain matmuls
    G = got["G"]
    Xr = G.bfloat16().mT
    Xr = (Xr / (Xr.norm(dim=(-2, -1), keepdim=True) + 1e-7)).contiguous()
    for a, b, c in [(3.4445, -4.7750, 2.0315)] * 5:
        Ar = Xr @ Xr.mT
        Br = b * Ar + c * Ar @ Ar.mT
        Xr = a * Xr + Br @ Xr
    torch.testing.assert_close(got["O"], Xr.mT.float(), rtol=0.05, atol=0.05)  # bf16 iterations
    assert got["banner"] == "triton None"


def test_a_renamed_generic_matmul_kernel_is_recognised_by_its_strides():
    code = textwrap.dedent('''\
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def k(a, b, c, M, N, K, sam, sak, sbk, sbn, scm, scn, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
            rm = tl.program_id(0) * BM + tl.arange(0, BM)
            rn = tl.program_id(1) * BN + tl.arange(0, BN)
            rk = tl.arange(0, BK)
            pa = a + rm[:, None] * sam + rk[None, :] * sak
            pb = b + rk[:, None] * sbk + rn[None, :] * sbn
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for i in range(0, K, BK):
                acc += tl.dot(tl.load(pa), tl.load(pb))
                pa += BK * sak
                pb += BK * sbk
            tl.store(c + rm[:, None] * scm + rn[None, :] * scn, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))

        def mm(x, y, z):
            k[(1, 1)](x, y, z, x.shape[0], y.shape[1], x.shape[1], x.stride(-2), x.stride(-1), y.stride(-2),
                      y.stride(-1), z.stride(-2), z.stride(-1), BM=16, BN=16, BK=16)
            return z

        def mm_t(x, y, z):
            k[(1, 1)](x, y, z, x.shape[0], y.shape[0], x.shape[1], x.stride(-2), x.stride(-1), y.stride(-1),
                      y.stride(-2), z.stride(-2), z.stride(-1), BM=16, BN=16, BK=16)
            return z
        ''')
    result = _port(code)
    after = sorted(c.after for c in result.changes if c.kind == ChangeKind.triton_launch)
    assert after == ["torch.matmul(x, y, out=z)", "torch.matmul(x, y.mT, out=z)"]
    namespace: dict = {}
    exec(compile(result.source, "program.py", "exec"), namespace)  # no triton needed any more
    gen = torch.Generator().manual_seed(2)
    x, y, yt = (torch.randn(*s, generator=gen) for s in ((5, 7), (7, 3), (3, 7)))
    torch.testing.assert_close(namespace["mm"](x, y, torch.empty(5, 3)), x @ y)
    torch.testing.assert_close(namespace["mm_t"](x, yt, torch.empty(5, 3)), x @ yt.T)
    assert "import triton" not in result.source


def test_kernels_that_cannot_be_derived_stay_reported_with_why_and_the_kernel_line():
    code = textwrap.dedent('''\
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def softcap_ce_kernel(logits, labels, loss, V, stride, cap, BLOCK: tl.constexpr):
            row = tl.program_id(0)
            cols = tl.arange(0, BLOCK)
            z = tl.load(logits + row * stride + cols, mask=cols < V, other=-float("inf"))
            z = cap * tl.sigmoid(z / cap)
            m = tl.max(z, axis=0)
            tl.store(loss + row, m + tl.log(tl.sum(tl.exp(z - m), axis=0)))

        @triton.jit
        def causal_kernel(x_ptr, out_ptr, M, sr, sc, BM: tl.constexpr):
            r = tl.arange(0, BM)
            p = x_ptr + r[:, None] * sr + r[None, :] * sc
            tl.store(out_ptr + r[:, None] * sr + r[None, :] * sc, tl.load(p), mask=r[:, None] >= r[None, :])

        def softcap_ce(logits, labels, cap):
            loss = torch.empty(logits.size(0), device=logits.device)
            softcap_ce_kernel[(logits.size(0),)](logits, labels, loss, logits.size(1), logits.stride(0), cap,
                                                 BLOCK=1024)
            return loss

        def lower(x, out):
            causal_kernel[(1,)](x, out, x.size(0), x.stride(-2), x.stride(-1), BM=32)
            return out

        @triton.jit
        def tma_matmul_kernel(a_desc, b_desc, c_desc, K, BK: tl.constexpr):
            acc = tl.zeros((64, 64), dtype=tl.float32)
            for k in range(0, K, BK):
                acc = tl.dot(a_desc.load([0, k]), b_desc.load([0, k]).T, acc)
            c_desc.store([0, 0], acc)

        def tma_matmul(a_desc, b_desc, c_desc, K):
            tma_matmul_kernel[(1,)](a_desc, b_desc, c_desc, K, BK=64)
        ''')
    result = _port(code)
    assert result.source == code and result.changes == []
    launches = {s.line: s.reason for s in result.skipped if s.category == SkipCategory.triton and "launch" in s.reason}
    ce, causal = _line_of(code, "softcap_ce_kernel[("), _line_of(code, "causal_kernel[(")
    tma = _line_of(code, "tma_matmul_kernel[(")
    assert set(launches) == {ce, causal, tma}
    assert "`a_desc.load` goes through a tensor descriptor (TMA)" in launches[tma]
    assert "`tl.max` is not read" in launches[ce]
    assert f"(line {_line_of(code, 'def softcap_ce_kernel')})" in launches[ce]
    assert f"(line {_line_of(code, 'm = tl.max')})" in launches[ce]
    assert "not a bounds check" in launches[causal] and f"(line {_line_of(code, 'def causal_kernel')})" in \
        launches[causal]
    # the imports stay reported: the kernels still need Triton
    assert {2, 3} <= {s.line for s in result.skipped if s.category == SkipCategory.triton}


def test_a_scalar_parameter_plus_a_tile_is_a_value_not_a_pointer():
    code = textwrap.dedent('''\
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def shifted_square_kernel(x_ptr, out_ptr, n, shift, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            y = shift + tl.load(x_ptr + offs, mask=offs < n)
            tl.store(out_ptr + offs, y * y, mask=offs < n)

        def shifted_square(x, shift):
            out = torch.empty_like(x)
            shifted_square_kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), shift, BLOCK=1024)
            return out
        ''')
    result = _port(code)
    assert [c.after for c in result.changes if c.kind == ChangeKind.triton_launch] == \
        ["out.copy_(((shift + x) * (shift + x)))"]
    namespace: dict = {}
    exec(compile(result.source, "program.py", "exec"), namespace)
    x = torch.randn(3, 7, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(namespace["shifted_square"](x, 0.5), (0.5 + x) ** 2)
