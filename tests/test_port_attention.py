"""GPU-only attention carried to the NPU by `trainbridge port --to npu` (tools/porting/attention.py).

The programs under fixtures/port_attention/ are written in the Modded-NanoGPT records' styles:
FlexAttention with a causal, a sliding-window (tensor window), a document and a hand-built block mask,
FlashAttention-3 varlen from the `kernels` hub, and flash-attn's flash_attn_func. Each is ported, the
port runs under the emulated torch_npu in a child process, and its attention output and q/k/v
gradients are compared:
- FlexAttention programs against the ORIGINAL program run on the CPU here: the forward is flex_attention's
  own output; FlexAttention has no backward on the CPU, so the gradients are those of SDPA with the keep
  mask expanded from the BlockMask the original built (its blocks, and mask_mod inside partial blocks),
  whose forward is checked against flex_attention's first. The CPU's eager flex_attention applies only the
  mask_mod and ignores a BlockMask's block lists (checked: a hand-built window of 1 or 4 blocks gives the
  same output there), so for hand-built block masks with a binding window the reference is the block
  structure the GPU kernel follows (blocks and mask_mod), not the CPU's output;
- flash-attn programs (no CUDA here) against SDPA with flash-attn's documented masking (bottom-right
  causal, window_size=(w, 0) keeps keys i + d - w .. i + d, varlen sequences attended separately).
All in float32; tolerance atol 2e-5, rtol 1e-4 (the same math summed in another order).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainbridge.tools.porting import ChangeKind, SkipCategory, port_source
from trainbridge.tools.porting.attention_masks import MaskSpec, NotCarried, read_mask_mod

import libcst as cst

FIXTURES = Path(__file__).parent / "fixtures" / "port_attention"
PROGRAMS = ["flex_causal", "flex_window", "flex_documents", "flex_kv_blocks", "flex_kv_blocks_token_window",
            "fa3_hub_varlen", "flash_attn_dense"]
ATOL, RTOL = 2e-5, 1e-4
EOS = 50256

DRIVER = """
import importlib, sys
import torch, torch_npu
assert torch_npu.__trainbridge_emulated__
sys.path.insert(0, sys.argv[1])
cases, results = torch.load(sys.argv[2]), {}
for name, case in cases.items():
    module = importlib.import_module(case["module"])
    args = [a.to("npu") if isinstance(a, torch.Tensor) else a for a in case["args"]]
    for i in case["grad"]:
        args[i].requires_grad_(True)
    out = getattr(module, case["func"])(*args)
    (out * case["upstream"].to("npu")).sum().backward()
    results[name] = {"out": out.detach().cpu(), "grads": [args[i].grad.cpu() for i in case["grad"]]}
torch.save(results, sys.argv[3])
"""


def port_fixture(name: str):
    return port_source((FIXTURES / f"{name}.py").read_text(), f"{name}.py")


def load_original(name: str):
    spec = importlib.util.spec_from_file_location(f"original_{name}", FIXTURES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------- what the port writes


@pytest.mark.parametrize("name, kinds", [
    ("flex_causal", [(15, ChangeKind.flex_block_mask), (16, ChangeKind.flex_attention)]),
    ("flex_window", [(15, ChangeKind.flex_block_mask), (20, ChangeKind.flex_attention)]),
    ("flex_documents", [(19, ChangeKind.flex_block_mask), (20, ChangeKind.flex_attention)]),
    ("flex_kv_blocks", [(34, ChangeKind.flex_block_mask), (46, ChangeKind.flex_attention)]),
    ("flex_kv_blocks_token_window", [(29, ChangeKind.flex_block_mask), (33, ChangeKind.flex_attention)]),
    ("fa3_hub_varlen", [(4, ChangeKind.flash_attention), (6, ChangeKind.flash_attention),
                        (12, ChangeKind.flash_attention)]),
    ("flash_attn_dense", [(4, ChangeKind.flash_attention), (8, ChangeKind.flash_attention),
                          (12, ChangeKind.flash_attention)]),
])
def test_each_pattern_is_carried_at_its_lines_with_a_note(name, kinds):
    result = port_fixture(name)
    carried = [(c.line, c.kind) for c in result.changes if c.kind.value.startswith(("flex", "flash"))]
    assert carried == kinds
    assert all(c.review for c in result.changes if c.kind.value.startswith(("flex", "flash")))
    assert not [s for s in result.skipped if s.category in (SkipCategory.flex_attention, SkipCategory.flash_attn,
                                                            SkipCategory.kernels_hub)]
    tree = ast.parse(result.source)
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert defined.count("_tb_npu_band_attention") == 1 and "_TbNpuMask" in defined
    imported = {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert "torch_npu" in imported
    assert not {m for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for m in [n.module]} & {
        "flash_attn", "kernels", "flash_attn_interface"}
    assert port_source(result.source, f"{name}.py").source == result.source  # idempotent


def test_the_rewritten_lines_read_as_expected():
    flex = port_fixture("flex_documents").source
    assert "block_mask = _tb_npu_mask(True, window=attn_blocksize, docs=docs)" in flex
    assert "y = _tb_npu_flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask)" in flex
    blocks = port_fixture("flex_kv_blocks")
    change = next(c for c in blocks.changes if c.kind == ChangeKind.flex_block_mask)
    assert change.after.startswith("_tb_npu_kv_block_mask(torch.clamp_max(partial_num, ")
    assert "BLOCK_SIZE, True, docs=docs)" in change.after and "behaviour change" in change.review
    hub = port_fixture("fa3_hub_varlen").source
    assert "flash_attn_interface = _TbNpuFlashAttention3" in hub
    assert "y = _tb_npu_flash_attn_varlen(q[0], k[0], v[0], cu_seqlens_q=seqlens" in hub


def test_the_port_report_lists_the_notes_to_review(tmp_path):
    from trainbridge.tools.porting.cli import render_markdown, run_port

    report = render_markdown(run_port(FIXTURES, dry_run=True))
    notes = report[report.index("## To review"):]
    assert "| `flex_kv_blocks.py:34` | flex_block_mask | behaviour change: the block-granular window" in notes
    assert "| `fa3_hub_varlen.py:12` | flash_attention | npu_fusion_attention: scale = softmax_scale" in notes


ARBITRARY = '''import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def attention(q, k, v):
    T = q.size(2)

    def strided(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (kv_idx % 4 == 0)

    block_mask = create_block_mask(strided, None, None, T, T, device="cuda")
    return flex_attention(q, k, v, block_mask=block_mask)


def plain(q, k, v):
    return flex_attention(q, k, v)
'''


def test_an_arbitrary_mask_mod_is_left_and_reported_with_what_to_do():
    result = port_source(ARBITRARY, "prog.py")
    assert "create_block_mask(strided" in result.source and "_tb_npu" not in result.source
    skips = {s.line: s for s in result.skipped if s.category == SkipCategory.flex_attention}
    assert sorted(skips) == [11, 12, 16]
    assert "`kv_idx % 4 == 0` is not a causal, sliding-window or document term" in skips[11].reason
    assert "mask_mod `strided`, line 8" in skips[11].reason and "atten_mask" in skips[11].reason
    assert "line(s) 11" in skips[12].reason and skips[12].blocking


def test_flex_score_mod_and_flash_softcap_are_reported_not_carried():
    code = ('import torch\nfrom torch.nn.attention.flex_attention import flex_attention\n'
            'from flash_attn import flash_attn_func\n\n\ndef f(q, k, v, bias):\n'
            '    a = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + bias)\n'
            '    return a, flash_attn_func(q, k, v, causal=True, softcap=30.0)\n')
    result = port_source(code, "prog.py")
    reasons = {(s.line, s.category): s.reason for s in result.skipped}
    assert "score_mod" in reasons[(7, SkipCategory.flex_attention)]
    assert "softcap" in reasons[(8, SkipCategory.flash_attn)]
    assert (3, SkipCategory.flash_attn) in reasons  # the import stays, and stays reported
    assert "_tb_npu" not in result.source


COMPILED = '''import torch
from flash_attn import flash_attn_func


@torch.compile(dynamic=False, fullgraph=True)
def newton_schulz(g):
    return g @ g.mT


class Attention(torch.nn.Module):
    def forward(self, q, k, v):
        return flash_attn_func(q, k, v, causal=True)


model = torch.compile(Attention(), dynamic=False, fullgraph=True)
'''


def test_a_compiled_model_with_carried_attention_drops_fullgraph():
    result = port_source(COMPILED, "prog.py")
    assert [(c.line, c.kind) for c in result.changes if c.kind == ChangeKind.attention_fullgraph] == [
        (15, ChangeKind.attention_fullgraph)]
    assert "model = torch.compile(Attention(), dynamic=False, fullgraph=False)" in result.source
    assert "@torch.compile(dynamic=False, fullgraph=True)" in result.source  # not the model: left as it was
    untouched = port_source(COMPILED.replace("flash_attn_func(q, k, v, causal=True)", "q"), "prog.py")
    assert "fullgraph=False" not in untouched.source


def _mask_spec(body: str) -> MaskSpec:
    module = cst.parse_module(f"def m(b, h, q_idx, kv_idx):\n{body}")
    return read_mask_mod(module, module.body[0])


def test_mask_mod_reader():
    assert _mask_spec("    return kv_idx <= q_idx\n") == MaskSpec(True, None, None)
    assert _mask_spec("    w = q_idx - kv_idx <= n\n    return (q_idx >= kv_idx) and w\n") == MaskSpec(True, "(n) + 1", None)
    assert _mask_spec("    return (d.ids[q_idx] == d.ids[kv_idx]) & (q_idx - kv_idx < size * 2)\n") == MaskSpec(
        False, "size * 2", "d.ids")
    for body in ("    return q_idx > kv_idx\n", "    return (q_idx >= kv_idx) | (kv_idx < 4)\n",
                 "    return q_idx - kv_idx < q_idx\n", "    n = 4\n    return q_idx - kv_idx < n\n",
                 "    if b:\n        return q_idx >= kv_idx\n    return q_idx >= kv_idx\n"):
        with pytest.raises(NotCarried):
            _mask_spec(body)


# ------------------------------------------------------------------------- numerics under the emulation


def sdpa(q, k, v, keep, scale):
    """Reference attention: q/k/v [B, S, H, D] (k/v may have fewer heads), keep [Sq, Skv] True = attend."""
    group = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(group, dim=2) for t in (k, v))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=keep,
                                         scale=scale)
    return out.transpose(1, 2)


def band_keep(sq, skv, left, bottom_right=True):
    """Causal keep mask with `left` earlier keys (None: unlimited), flash-attn's bottom-right alignment."""
    i = torch.arange(sq)[:, None] + (skv - sq if bottom_right else 0)
    j = torch.arange(skv)[None, :]
    keep = j <= i
    return keep & (j >= i - left) if left is not None else keep


def varlen_keep(cu: list[int], left: int) -> torch.Tensor:
    total = cu[-1]
    keep = torch.zeros(total, total, dtype=torch.bool)
    for start, end in zip(cu, cu[1:]):
        if end > start:
            keep[start:end, start:end] = band_keep(end - start, end - start, left)
    return keep


def expand_block_mask(block_mask, sq: int, skv: int) -> torch.Tensor:
    """The token-level keep set of a FlexAttention BlockMask: full blocks, and mask_mod inside partial ones."""
    bq, bk = block_mask.BLOCK_SIZE
    i, j = torch.arange(sq)[:, None], torch.arange(skv)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    by_mod = block_mask.mask_mod(zero, zero, i, j).expand(sq, skv)
    keep = torch.zeros(sq, skv, dtype=torch.bool)
    listed = [(block_mask.kv_num_blocks, block_mask.kv_indices, False),
              (block_mask.full_kv_num_blocks, block_mask.full_kv_indices, True)]
    for nums, indices, full in listed:
        if nums is None:
            continue
        for qb in range(nums.shape[-1]):
            for n in range(int(nums[0, 0, qb])):
                kb = int(indices[0, 0, qb, n])
                rows, cols = slice(qb * bq, (qb + 1) * bq), slice(kb * bk, (kb + 1) * bk)
                keep[rows, cols] = True if full else by_mod[rows, cols]
    return keep


def run_original_flex(name: str, func: str, args: list, scale):
    """The original program's flex_attention output on the CPU, and the keep mask its BlockMask holds."""
    module = load_original(name)
    seen = []
    real = module.flex_attention

    def spy(query, key, value, block_mask=None, **kw):
        seen.append(block_mask)
        return real(query, key, value, block_mask=block_mask, **kw)

    module.flex_attention = spy
    with torch.no_grad():
        out = getattr(module, func)(*args)
    (block_mask,) = seen
    return out, expand_block_mask(block_mask, args[0].shape[1], args[1].shape[1])


def reference_grads(q, k, v, keep, scale, upstream):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = sdpa(*leaves, keep, scale)
    (out * upstream).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def documents(length: int, eos_at: list[int]) -> torch.Tensor:
    idx = torch.randint(0, 50000, (length,))
    idx[eos_at] = EOS
    return idx


def qkv(sq: int, skv: int, heads: int = 2, kv_heads: int | None = None, dim: int = 16):
    return (torch.randn(1, sq, heads, dim), torch.randn(1, skv, kv_heads or heads, dim),
            torch.randn(1, skv, kv_heads or heads, dim))


def build_cases():
    """name -> (case for the child, reference output, reference grads, original flex output or None)."""
    torch.manual_seed(0)
    cases = {}

    def flex_case(name, program, func, extra, scale, note=None):
        q, k, v = qkv(*((512, 512) if program == "flex_kv_blocks" else (256, 256)))
        args = [q, k, v, *extra(q)]
        original, keep = run_original_flex(program, func, args, scale)
        upstream = torch.randn_like(original)
        ref_out, ref_grads = reference_grads(q, k, v, keep, scale, upstream)
        torch.testing.assert_close(ref_out, original, atol=ATOL, rtol=RTOL)  # the expanded mask is the original's
        cases[name] = ({"module": program, "func": func, "args": args, "grad": [0, 1, 2], "upstream": upstream},
                       original, ref_grads, keep)

    flex_case("flex causal", "flex_causal", "attention", lambda q: [], 16 ** -0.5)
    flex_case("flex window 40", "flex_window", "attention", lambda q: [torch.tensor(40)], 0.12)
    flex_case("flex window 97", "flex_window", "attention", lambda q: [torch.tensor(97)], 0.12)
    docs = documents(256, [0, 40, 41, 130, 255])
    flex_case("flex documents", "flex_documents", "attention", lambda q: [docs, torch.tensor(48)], 16 ** -0.5)
    long_docs = documents(512, [0, 300])
    flex_case("flex kv blocks", "flex_kv_blocks", "attention", lambda q: [long_docs, torch.tensor(4)], 0.12)

    # hand-built blocks with a window of 2 blocks: the port keeps a token window of 256 keys (behaviour note)
    q, k, v = qkv(512, 512)
    args = [q, k, v, long_docs, torch.tensor(2)]
    original, block_keep = run_original_flex("flex_kv_blocks", "attention", args, 0.12)
    doc = (long_docs == EOS).cumsum(0)
    token_keep = band_keep(512, 512, 255) & (doc[:, None] == doc[None, :])
    upstream = torch.randn_like(original)
    ref_out, ref_grads = reference_grads(q, k, v, token_keep, 0.12, upstream)
    cases["flex kv blocks window"] = ({"module": "flex_kv_blocks", "func": "attention", "args": args,
                                       "grad": [0, 1, 2], "upstream": upstream}, ref_out, ref_grads, token_keep)
    assert bool((block_keep <= token_keep).all()) and not torch.equal(block_keep, token_keep)

    # blocks listed densely with a block window of ceil(100/128) = 1 block, mask_mod with a token window of 100:
    # the port keeps the token window (a superset of the original's keys where the block window cuts it)
    q, k, v = qkv(512, 512)
    args = [q, k, v, long_docs, torch.tensor(100)]
    original, block_keep = run_original_flex("flex_kv_blocks_token_window", "attention", args, 16 ** -0.5)
    token_keep = band_keep(512, 512, 99) & (doc[:, None] == doc[None, :])
    upstream = torch.randn_like(original)
    ref_out, ref_grads = reference_grads(q, k, v, token_keep, 16 ** -0.5, upstream)
    cases["flex kv blocks token window"] = ({"module": "flex_kv_blocks_token_window", "func": "attention",
                                             "args": args, "grad": [0, 1, 2], "upstream": upstream}, ref_out,
                                            ref_grads, token_keep)
    assert bool((block_keep <= token_keep).all()) and not torch.equal(block_keep, token_keep)

    # FlashAttention-3 varlen from the hub: documents of 37, 0, 90, 1 and 128 tokens, cu_seqlens padded with T
    q, k, v = qkv(256, 256, heads=4, kv_heads=2)
    cu = [0, 37, 37, 127, 128, 256]
    seqlens = torch.tensor(cu + [256] * 3, dtype=torch.int32)
    for window in (16, 300):
        keep = varlen_keep(cu, window)
        upstream = torch.randn(1, 256, 4, 16)
        ref_out, ref_grads = reference_grads(q, k, v, keep, 0.12, upstream)
        cases[f"fa3 varlen window {window}"] = ({"module": "fa3_hub_varlen", "func": "attention",
                                                 "args": [q, k, v, seqlens, window], "grad": [0, 1, 2],
                                                 "upstream": upstream}, ref_out, ref_grads, keep)

    # flash_attn_func: causal (default scale) and windowed, with grouped KV heads and fewer queries than keys
    q, k, v = qkv(96, 160, heads=4, kv_heads=1)
    for func, extra, keep, scale in (("causal", [], band_keep(96, 160, None), 16 ** -0.5),
                                     ("windowed", [24], band_keep(96, 160, 24), 0.2)):
        upstream = torch.randn(1, 96, 4, 16)
        ref_out, ref_grads = reference_grads(q, k, v, keep, scale, upstream)
        cases[f"flash_attn_func {func}"] = ({"module": "flash_attn_dense", "func": func, "args": [q, k, v, *extra],
                                             "grad": [0, 1, 2], "upstream": upstream}, ref_out, ref_grads, keep)
    return cases


@pytest.fixture(scope="module")
def emulated_runs(tmp_path_factory):
    from trainbridge.sandbox.npu_emulation import emulation_path

    root = tmp_path_factory.mktemp("port_attention")
    programs = root / "ported"
    programs.mkdir()
    for name in PROGRAMS:
        (programs / f"{name}.py").write_text(port_fixture(name).source)
    cases = build_cases()
    torch.save({name: case for name, (case, *_) in cases.items()}, root / "cases.pt")
    (root / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env.update(OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=str(emulation_path()))
    proc = subprocess.run([sys.executable, str(root / "driver.py"), str(programs), str(root / "cases.pt"),
                           str(root / "results.pt")], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return cases, torch.load(root / "results.pt")


CASES = ["flex causal", "flex window 40", "flex window 97", "flex documents", "flex kv blocks",
         "flex kv blocks window", "flex kv blocks token window", "fa3 varlen window 16", "fa3 varlen window 300", "flash_attn_func causal",
         "flash_attn_func windowed"]


@pytest.mark.parametrize("name", CASES)
def test_ported_attention_matches_the_original_under_the_emulation(emulated_runs, name):
    cases, results = emulated_runs
    _, want_out, want_grads, keep = cases[name]
    got = results[name]
    assert keep.any(dim=-1).all()  # no fully masked rows: the comparison is defined
    torch.testing.assert_close(got["out"], want_out, atol=ATOL, rtol=RTOL)
    for got_grad, want_grad in zip(got["grads"], want_grads, strict=True):
        torch.testing.assert_close(got_grad, want_grad, atol=ATOL, rtol=RTOL)


COMPILED_DOCUMENTS = """
import sys
import torch, torch_npu
from torch._dynamo.utils import counters
sys.path.insert(0, sys.argv[1])
from flex_documents import attention

compiled = torch.compile(attention)
gen = torch.Generator().manual_seed(0)
worst, layouts, graphs = 0.0, set(), []
for eos_at in ([7, 30], [3], [12, 40, 41], [], [50]):
    idx = torch.randint(0, 100, (64,), generator=gen)
    idx[eos_at] = 50256
    layouts.add(tuple(eos_at))
    q, k, v = (torch.randn(1, 64, 2, 16, generator=gen).npu() for _ in range(3))
    want = attention(q, k, v, idx.npu(), torch.tensor(24).npu())
    got = compiled(q, k, v, idx.npu(), torch.tensor(24).npu())
    worst = max(worst, (got - want).abs().max().item())
    graphs.append(counters["stats"]["unique_graphs"])
print("RESULT", worst, len(layouts), ",".join(map(str, graphs)))
"""


def test_a_compiled_document_mask_does_not_recompile_for_each_batch(tmp_path):
    """The ported document mask under the program's own torch.compile (Modded-NanoGPT record 12 compiles its model):
    each batch's document end offsets are host ints; read and passed inside the traced code, every new layout was
    guarded as a new graph (`len(mask.ends) == 10`, `mask.ends[0] == 1`: a recompile a step, which ran the record's
    host Inductor reference past its 900 s limit after 3 steps). They stay outside the graph now: five layouts, the
    first layout's graphs only, the outputs of eager."""
    from trainbridge.sandbox.npu_emulation import emulation_path

    (tmp_path / "flex_documents.py").write_text(port_fixture("flex_documents").source)
    (tmp_path / "driver.py").write_text(COMPILED_DOCUMENTS)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    env.update(OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0", PYTHONPATH=str(emulation_path()))
    proc = subprocess.run([sys.executable, str(tmp_path / "driver.py"), str(tmp_path)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    worst, layouts, graphs = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT")).split()[1:]
    assert int(layouts) == 5 and float(worst) < 1e-6
    graphs = [int(g) for g in graphs.split(",")]  # Dynamo's graphs after each layout: the first layout's only
    assert len(set(graphs)) == 1, (graphs, proc.stderr[-3000:])
