"""NPUGraph capture and replay on the emulation (torch_npu.npu.graphs): the CUDA-graph contract that
torch_npu's NPUGraph follows (Ascend/pytorch docs/zh/developer_notes/npugraph.md: replay reads the
static inputs' current contents and rewrites the static outputs in place), npu_fusion_attention_v3 as
the capturable attention (v1/v2 are documented as not supported in aclgraph), and on the emulated npu
device in a child process: device semantics of a capture (no host reads) and a whole training step.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env
from trainbridge.tests.npu_emulation_support import TEMPLATE, tnpu, to_npu  # noqa: F401 (tnpu is a fixture)


def _qkv(b=1, n=2, s=8, d=16, seed=0):
    torch.manual_seed(seed)
    return [to_npu(torch.randn(b, n, s, d)) for _ in range(3)]


def _refill(*tensors, seed):
    torch.manual_seed(seed)
    for t in tensors:
        t.copy_(to_npu(torch.randn(t.shape)))


def test_replay_of_fusion_attention_reads_the_new_static_inputs(tnpu):
    q, k, v = _qkv()
    mask = to_npu(TEMPLATE)
    kwargs = dict(atten_mask=mask, scale=0.25, sparse_mode=3)
    g = tnpu.npu.NPUGraph()
    with tnpu.npu.graph(g):
        assert tnpu.npu.is_current_stream_capturing()
        static_out, smax, ssum, _, _, _ = tnpu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", **kwargs)
    assert not tnpu.npu.is_current_stream_capturing() and g.num_ops > 10
    for seed in (1, 2):  # two replays, each on new contents of the same static tensors
        _refill(q, k, v, seed=seed)
        g.replay()
        want = tnpu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", **kwargs)
        assert torch.equal(static_out.cpu(), want[0].cpu()), seed
        assert torch.equal(smax.cpu(), want[1].cpu()) and torch.equal(ssum.cpu(), want[2].cpu())
    stale = static_out.clone()
    _refill(q, k, v, seed=3)
    assert torch.equal(static_out.cpu(), stale.cpu())  # only replay updates the static output


def test_forward_and_backward_replay_like_eager(tnpu):
    """A captured forward + backward: the gradients the capture created are static too."""
    q, k, v = (t.requires_grad_(True) for t in _qkv(seed=4))
    dy = to_npu(torch.randn(q.shape))
    g = tnpu.npu.NPUGraph()
    with tnpu.npu.graph(g):
        out = tnpu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.25)[0]
        out.backward(dy)
    grads = [t.grad for t in (q, k, v)]
    with torch.no_grad():
        _refill(q, k, v, dy, seed=5)
    for t in grads:
        t.zero_()  # the gradients accumulate into the captured .grad tensors, as in eager mode
    g.replay()
    qe, ke, ve = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want = tnpu.npu_fusion_attention_v3(qe, ke, ve, 2, "BNSD", scale=0.25)[0]
    want.backward(dy)
    assert torch.equal(out.detach().cpu(), want.detach().cpu())
    for got, ref in zip(grads, (qe.grad, ke.grad, ve.grad)):
        torch.testing.assert_close(got.cpu(), ref.cpu(), rtol=0, atol=0)


def test_capture_leaves_older_memory_alone_and_replay_writes_it(tnpu):
    """On a device a capture records kernels without running them: writes into memory that existed
    before it happen at replay only (here an accumulator and the upstream doc's `b = b + 1` chain)."""
    a = to_npu(torch.full((4,), 1.0))
    acc = to_npu(torch.zeros(4))
    g = tnpu.npu.NPUGraph()
    with tnpu.npu.graph(g):
        b = a
        for _ in range(10):
            b = b + 1
        acc.add_(b)
    assert torch.equal(acc.cpu(), torch.zeros(4))
    a.fill_(5.0)
    g.replay()
    g.replay()
    assert torch.equal(b.cpu(), torch.full((4,), 15.0)) and torch.equal(acc.cpu(), torch.full((4,), 30.0))


@pytest.mark.parametrize("op", ["npu_fusion_attention", "npu_fusion_attention_v2"])
def test_v1_and_v2_refuse_a_capture(tnpu, op):
    q, k, v = _qkv()
    g = tnpu.npu.NPUGraph()
    with pytest.raises(RuntimeError, match=f"{op} is not supported in aclgraph .*npu_fusion_attention_v3"):
        with tnpu.npu.graph(g):
            getattr(tnpu, op)(q, k, v, 2, "BNSD")
    assert not tnpu.npu.is_current_stream_capturing()
    assert len(getattr(tnpu, op)(q, k, v, 2, "BNSD")) == 7  # eager calls are unaffected


@pytest.mark.parametrize("layout,heads,keep_prob,error,match", [
    ("BSND", 8, 1.0, RuntimeError, "supports input_layout BNSD only"),
    ("BNSD", 2, 0.9, NotImplementedError, r"dropout \(keep_prob=0.9\) inside an NPUGraph capture is not emulated"),
])
def test_v3_capture_limits(tnpu, layout, heads, keep_prob, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        with tnpu.npu.graph(tnpu.npu.NPUGraph()):
            tnpu.npu_fusion_attention_v3(q, k, v, heads, layout, keep_prob=keep_prob)
    assert tnpu.npu_fusion_attention_v3(q, k, v, heads, layout, keep_prob=keep_prob)[0].shape == q.shape


def test_graph_lifecycle_errors_and_pools(tnpu):
    g = tnpu.npu.NPUGraph()
    with pytest.raises(RuntimeError, match="replay without a preceding successful capture"):
        g.replay()
    with pytest.raises(RuntimeError, match="Unknown capture error mode"):
        g.capture_begin(capture_error_mode="strict")
    pool = tnpu.npu.graph_pool_handle()
    assert pool != tnpu.npu.graph_pool_handle()
    x = to_npu(torch.ones(3))
    g.capture_begin(pool=pool, capture_error_mode="relaxed")
    with pytest.raises(RuntimeError, match="only one capture at a time"):
        tnpu.npu.NPUGraph().capture_begin()
    y = x * 2
    g.capture_end()
    assert g.pool() == pool
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        g.capture_begin()
    g.reset()
    with pytest.raises(RuntimeError, match="replay without a preceding successful capture"):
        g.replay()
    with tnpu.npu.graph(g):  # a reset graph captures again
        z = x + y
    x.fill_(3.0)
    g.replay()
    assert torch.equal(z.cpu(), torch.full((3,), 5.0))  # y is the old capture's, no longer replayed


def test_signatures_follow_torch_npu(tnpu):
    """Ascend/pytorch torch_npu/npu/graphs.py."""
    def params(fn):
        return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]

    assert params(tnpu.npu.NPUGraph.capture_begin) == [("self", inspect.Parameter.empty), ("pool", None),
                                                       ("capture_error_mode", "global")]
    assert params(tnpu.npu.graph.__init__) == [
        ("self", inspect.Parameter.empty), ("npu_graph", inspect.Parameter.empty), ("pool", None), ("stream", None),
        ("auto_dispatch_capture", False), ("capture_error_mode", "global")]
    assert params(tnpu.npu.make_graphed_callables) == [
        ("callables", inspect.Parameter.empty), ("sample_args", inspect.Parameter.empty), ("num_warmup_iters", 3),
        ("allow_unused_input", False), ("pool", None)]
    assert {"NPUGraph", "graph", "graph_pool_handle", "is_current_stream_capturing",
            "make_graphed_callables"} <= set(tnpu.npu.__all__)


def test_make_graphed_callables_trains_like_eager(tnpu):
    """The upstream doc's example in small: graphed modules in a training loop, gradients as in eager."""
    torch.manual_seed(6)
    m1 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU())
    m2 = torch.nn.Linear(16, 4)
    ref1, ref2 = copy.deepcopy(m1), copy.deepcopy(m2)
    x, h = torch.randn(5, 8), torch.randn(5, 16, requires_grad=True)
    g1, g2 = tnpu.npu.make_graphed_callables((m1, m2), ((x,), (h,)))
    assert (g1, g2) == (m1, m2)  # modules come back with a graphed forward
    params, ref_params = [*m1.parameters(), *m2.parameters()], [*ref1.parameters(), *ref2.parameters()]
    for step in range(2):
        data, target = torch.randn(5, 8), torch.randn(5, 4)
        for p in params + ref_params:
            p.grad = None
        loss = (m2(m1(data)) - target).pow(2).sum()
        loss.backward()
        want = (ref2(ref1(data)) - target).pow(2).sum()
        want.backward()
        torch.testing.assert_close(loss, want)
        for p, r in zip(params, ref_params):
            torch.testing.assert_close(p.grad, r.grad, rtol=1e-5, atol=1e-6)


def test_make_graphed_callables_with_fusion_attention(tnpu):
    def attention(q, k, v):
        return tnpu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.25)[0]

    graphed = tnpu.npu.make_graphed_callables(attention, tuple(t.requires_grad_(True) for t in _qkv(seed=7)))
    q, k, v = (t.requires_grad_(True) for t in _qkv(seed=8))
    out = graphed(q, k, v)
    out.pow(2).sum().backward()
    qe, ke, ve = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    want = attention(qe, ke, ve)
    want.pow(2).sum().backward()
    assert torch.equal(out, want)
    for got, ref in zip((q.grad, k.grad, v.grad), (qe.grad, ke.grad, ve.grad)):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)
    with pytest.raises(TypeError, match="must contain only Tensors"):
        tnpu.npu.make_graphed_callables(attention, (q, k, 1.0))


_DEVICE_SCRIPT = textwrap.dedent(r"""
    import json, torch, torch_npu
    r = {"torch_npu_graph": torch.npu.NPUGraph is torch_npu.npu.NPUGraph}
    q, k, v = (torch.randn(1, 2, 8, 16, device="npu") for _ in range(3))
    eager = torch_npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.25)
    r["eager_seed_device"] = str(eager[4].device)
    g = torch.npu.NPUGraph()
    with torch.npu.graph(g):
        static = torch_npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.25)
    r["captured_seed_device"] = str(static[4].device)
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape))
    g.replay()
    want = torch_npu.npu_fusion_attention_v3(q, k, v, 2, "BNSD", scale=0.25)[0]
    r["replay_equal"] = torch.equal(static[0].cpu(), want.cpu())
    try:
        with torch.npu.graph(torch.npu.NPUGraph()):
            q.sum().item()
        r["host_read"] = "allowed"
    except RuntimeError as e:
        r["host_read"] = str(e)

    # a whole SGD step captured, then replayed, against the same step in eager mode on the host
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4).npu()
    x = torch.randn(2, 4, device="npu")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    lin(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    before = [p.detach().cpu().clone() for p in lin.parameters()]
    step = torch.npu.NPUGraph()
    with torch.npu.graph(step):
        lin(x).pow(2).sum().backward()
        opt.step()
    r["capture_left_params"] = all(torch.equal(a, p.detach().cpu()) for a, p in zip(before, lin.parameters()))
    step.replay()
    ref = torch.nn.Linear(4, 4)
    with torch.no_grad():
        for p, a in zip(ref.parameters(), before):
            p.copy_(a)
    ref(x.cpu()).pow(2).sum().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    r["step_diff"] = max((a - p.detach().cpu()).abs().max().item() for a, p in zip(ref.parameters(), lin.parameters()))
    print("RESULT " + json.dumps(r))
""")


def test_capture_on_the_emulated_npu_device(tmp_path):
    selection = NpuSelection(mode="emulated", cause="not_installed", reason="test", python=sys.executable)
    base = {k: v for k, v in os.environ.items()
            if k not in ("TRAINBRIDGE_NPU_EMULATION_DEVICE_MAP", "TRAINBRIDGE_NPU_EMULATION_DEVICE")}
    script = tmp_path / "child.py"
    script.write_text(_DEVICE_SCRIPT)
    proc = subprocess.run([sys.executable, str(script)], env=selection_env(selection, base), cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))[7:])
    assert r["torch_npu_graph"] and r["replay_equal"]
    # torch_npu doc of v3: seed/offset are CPU tensors outside aclgraph, device tensors inside it
    assert r["eager_seed_device"] == "cpu" and r["captured_seed_device"] == "npu:0"
    assert r["host_read"].startswith("operation not permitted when stream is capturing")
    assert r["capture_left_params"] and r["step_diff"] < 1e-6
