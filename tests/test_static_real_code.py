"""The static scan on team-written programs in the styles of public training code (issue 13).

tests/fixtures/real_style/ holds programs written the way the development corpus is written
(benchmarks/corpus/labels.yaml): a speedrun-style single-file trainer with a Muon-like optimizer,
flex attention through a compiled alias, soft-capped fp32 logits and nested accumulation and
optimizer loops; a package split over modules with library norms and attention, complex rotary
and an AdamW whose ``fused`` comes through ``**extra_args``; a Hugging Face-style decoder with
methods, static helpers and a mask helper; and near-misses that must not be reported.

For each program the exact intents (category and spans: the whole function when a new detector's
finding is all a helper does) are asserted per target: ``npu`` gets
everything, ``cuda`` the target-independent findings plus elementwise chains, ``cpu`` and an
unknown target the target-independent ones only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainbridge.agents.analyst.static.scan import scan_repo, scan_source
from trainbridge.agents.analyst.static.targets import GAINS, gains_for

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "real_style"

# (category, spans, gain): gain None = reported for every target; else only where GAINS lists it.
EXPECTED: dict[str, list[tuple[str, tuple[str, ...], str | None]]] = {
    "speedrun_style": [
        # k2 * G + k3 * (G @ G), then k1 * Y + poly @ Y: one addmm each, one region (Y's step reads poly)
        ("elementwise_chain", ("train_gpt.py:20-21",), "elementwise_chain"),
        ("optimizer_step", ("train_gpt.py:32-39",), None),  # for w in group["params"]: lerp_, add_
        ("rmsnorm", ("train_gpt.py:42-43",), "library_rmsnorm"),  # the helper rmsn() whole; its call sites are not
        ("rope", ("train_gpt.py:54-57",), None),  # rotation of the halves, outputs swapped: Rotor.forward whole
        ("elementwise_chain", ("train_gpt.py:72",), "elementwise_chain"),  # mix[0] * v + mix[1] * ve
        ("attention", ("train_gpt.py:75",), "library_attention"),  # fast_flex = torch.compile(flex_attention)
        ("permute_reshape", ("train_gpt.py:76",), None),
        ("elementwise_chain", ("train_gpt.py:86",), "elementwise_chain"),  # torch.relu(...) ** 2
        ("elementwise_chain", ("train_gpt.py:97",), "elementwise_chain"),  # gates[0] * x + gates[1] * x0
        ("cross_entropy", ("train_gpt.py:116-117",), "fp32_logits_loss"),  # logits.float() inside the soft-cap
        ("elementwise_chain", ("train_gpt.py:116",), "elementwise_chain"),  # 20 * tanh(logits / 20)
        ("host_sync", ("train_gpt.py:143",), None),  # .item() every step: loop holds micro and optim loops
    ],
    "package_style": [
        ("rmsnorm", ("lm/layers/aliased.py:7-8",), "library_rmsnorm"),  # class QKNorm(TorchRMSNorm), an import alias
        ("rmsnorm", ("lm/layers/aliased.py:11-12",), "library_rmsnorm"),  # rms_norm imported as rmsnorm_fn
        ("attention", ("lm/layers/aliased.py:15-16",), "library_attention"),  # SDPA imported as sdpa; attend() whole
        ("cross_entropy", ("lm/layers/aliased.py:19-20",), "fp32_logits_loss"),  # cross_entropy imported as xent
        ("rmsnorm", ("lm/layers/aliased.py:24",), None),  # the file's own rms_norm(): written out, not the library
        ("attention", ("lm/layers/attention.py:29-30",), "library_attention"),  # flash_attn_varlen_func: TND
        ("attention", ("lm/layers/attention.py:33",), "library_attention"),  # flash_attn_func(**extra): window
        ("attention", ("lm/layers/attention.py:36",), "library_attention"),  # SDPA fallback
        ("permute_reshape", ("lm/layers/attention.py:36-37",), None),
        ("swiglu", ("lm/layers/mlp.py:13-14",), None),
        ("rmsnorm", ("lm/layers/norms.py:5-9",), "library_rmsnorm"),  # class ...(nn.RMSNorm)
        ("rmsnorm", ("lm/layers/norms.py:12-13",), "library_rmsnorm"),  # make_norm() returns torch.nn.RMSNorm(...)
        ("rope", ("lm/layers/rotary.py:18-21",), None),  # view_as_complex * polar freqs
        ("optimizer_step", ("lm/train.py:15",), None),  # AdamW(..., **extra_args), fused only on cuda
        ("host_sync", ("lm/train.py:32",), None),  # .cpu() every step around an accumulation loop
    ],
    "hf_style": [
        ("rmsnorm", ("modeling_tiny.py:18-20",), None),
        ("rmsnorm", ("modeling_tiny.py:29",), None),  # F.normalize(x) * sqrt(d) * g
        ("rope", ("modeling_tiny.py:39-40", "modeling_tiny.py:34-36"), None),  # TinyRotary._swap_halves
        ("attention", ("modeling_tiny.py:59-63",), None),  # combine_with_mask() between the matmuls
        ("permute_reshape", ("modeling_tiny.py:71",), None),
        ("elementwise_chain", ("modeling_tiny.py:74-75",), "elementwise_chain"),  # modulate(): x * (1 + scale) + shift
        ("gelu", ("modeling_tiny.py:86",), None),
        ("cross_entropy", ("modeling_tiny.py:99-103",), "fp32_logits_loss"),  # loss(): .to(torch.float32), shifted
    ],
    "near_misses": [],
}


def _rows(intents) -> list[tuple[str, tuple[str, ...]]]:
    return sorted((str(i.category), tuple(str(s) for s in i.spans)) for i in intents)


def _expected(program: str, target: str | None) -> list[tuple[str, tuple[str, ...]]]:
    gains = gains_for(target)
    return sorted((c, spans) for c, spans, gain in EXPECTED[program] if gain is None or gain in gains)


@pytest.mark.parametrize("target", ["npu", "cuda", "cpu", None])
@pytest.mark.parametrize("program", sorted(EXPECTED))
def test_real_style_programs_exact_intents(program, target):
    assert _rows(scan_repo(FIXTURES / program, target=target)) == _expected(program, target)


def test_every_target_specific_expectation_names_a_known_gain():
    known = set().union(*GAINS.values())
    assert {gain for rows in EXPECTED.values() for _, _, gain in rows if gain} <= known


def test_unknown_target_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="unknown target 'tpu'.*cpu, cuda, npu"):
        scan_source("x = 1\n", "m.py", target="tpu")


def test_notes_carry_the_npu_rewrite_facts():
    intents = scan_repo(FIXTURES / "package_style", target="npu")
    notes = {str(i.spans[0]): " ".join(i.evidence.notes) for i in intents}
    assert "sparse_mode=3" in notes["lm/layers/attention.py:33"] and "pre_tockens=w" in notes["lm/layers/attention.py:33"]
    assert "TND" in notes["lm/layers/attention.py:29-30"]
    assert "sparse_mode=2" in notes["lm/layers/attention.py:36"] and "1/sqrt(D)" in notes["lm/layers/attention.py:36"]
    assert "**extra_args" in notes["lm/train.py:15"]
    speedrun = {str(i.spans[0]): i for i in scan_repo(FIXTURES / "speedrun_style", target="npu")}
    assert "npu_rms_norm" in speedrun["train_gpt.py:42-43"].evidence.notes[0]
    assert all(0.3 <= i.confidence <= 0.6 for i in speedrun.values())


SDPA_VIEWS = """\
import torch.nn.functional as F

def attend(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
"""


def test_sdpa_on_transposed_views_says_bsnd_without_the_transposes():
    (intent,) = [i for i in scan_source(SDPA_VIEWS, "m.py", target="npu") if str(i.category) == "attention"]
    assert "input_layout='BSND'" in intent.evidence.notes[0] and "drops the transposes" in intent.evidence.notes[0]
    assert scan_source(SDPA_VIEWS, "m.py", target="cuda") == []  # already a flash kernel there


@pytest.mark.parametrize(
    "code",
    [
        # the same rotation, spelled other ways: interleaved halves and stack, terms swapped
        "import torch\ndef r(x, c, s):\n    a = x[..., ::2]\n    b = x[..., 1::2]\n"
        "    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)\n",
        "import torch\ndef r(x, c, s):\n    d = x.shape[-1] // 2\n    a, b = x[..., :d], x[..., d:]\n"
        "    return torch.cat([c * a - s * b, s * a + c * b], -1)\n",
    ],
)
def test_rotation_rotary_spellings(code):
    assert [str(i.category) for i in scan_source(code, "m.py")] == ["rope"]


@pytest.mark.parametrize(
    "code",
    [
        # the same coefficient twice is not a rotation
        "import torch\ndef r(x, c, s):\n    a, b = x.chunk(2, -1)\n    return torch.cat([a * c + b * s, a * s + b * c], -1)\n",
        # halves of two different tensors
        "import torch\ndef r(x, y, c, s):\n    a, _ = x.chunk(2, -1)\n    _, b = y.chunk(2, -1)\n"
        "    return torch.cat([a * c + b * s, b * c - a * s], -1)\n",
    ],
)
def test_rotation_near_misses(code):
    assert scan_source(code, "m.py", target="npu") == []


def test_parameter_loop_counts_only_in_place_updates_of_the_innermost_loop():
    code = (
        "def step(groups):\n"
        "    for group in groups:\n"
        "        group['lr'] = 0.1\n"
        "        for p in group['params']:\n"
        "            p.data.add_(p.grad, alpha=-group['lr'])\n"
        "def scale(model, n):\n"
        "    for p in model.parameters():\n"
        "        p.grad /= n\n"
        "def count(params):\n"
        "    total = 0\n"
        "    for p in params:\n"
        "        total += p.numel()\n"
        "    return total\n"
    )
    rows = _rows(scan_source(code, "m.py"))
    assert rows == [("optimizer_step", ("m.py:4-5",)), ("optimizer_step", ("m.py:7-8",))]


def test_host_sync_in_an_epoch_loop_around_whole_steps_is_not_reported_but_around_micro_batches_is():
    epochs = (
        "def fit(model, opt, data):\n"
        "    for epoch in range(3):\n"
        "        for x, y in data:\n"
        "            model(x, y).backward()\n"
        "            opt.step()\n"
        "        print(model.last.item())\n"
    )
    assert scan_source(epochs, "m.py") == []
    micro = epochs.replace("            opt.step()\n", "").replace("        print(", "        opt.step()\n        print(")
    assert _rows(scan_source(micro, "m.py")) == [("host_sync", ("m.py:6",))]


def test_optimizer_kwargs_that_may_choose_the_implementation_are_not_called_default():
    code = (
        "import torch\n"
        "def build(model, cfg, lr):\n"
        "    a = torch.optim.AdamW(model.parameters(), **cfg)\n"  # unknown: may hold fused=True
        "    b = torch.optim.AdamW(model.parameters(), **dict(lr=lr))\n"  # visibly the default
        "    c = torch.optim.AdamW(model.parameters(), **{'lr': lr, 'fused': True})\n"
        "    d = torch.optim.AdamW(model.parameters(), **{'lr': lr})\n"
        "    return a, b, c, d\n"
    )
    assert _rows(scan_source(code, "m.py")) == [("optimizer_step", ("m.py:4",)), ("optimizer_step", ("m.py:6",))]


def test_a_helper_that_only_wraps_the_op_is_spanned_whole_and_a_busier_one_is_not():
    code = (
        "import torch.nn.functional as F\n"
        "def norm(x):\n"
        "    d = x.shape[-1]\n"
        "    return F.rms_norm(x, (d,))\n"
        "def block(x, w):\n"
        "    y = F.rms_norm(x, (x.size(-1),))\n"
        "    return w(y)\n"
    )
    assert _rows(scan_source(code, "m.py", target="npu")) == [("rmsnorm", ("m.py:2-4",)), ("rmsnorm", ("m.py:6",))]


def test_blocking_collective_per_parameter_gradient_is_communication():
    code = (
        "import torch.distributed as dist\n"
        "from torch.distributed import all_reduce\n"
        "def sync(model):\n"
        "    for param in model.parameters():\n"
        "        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)\n"
        "def sync_imported(params):\n"
        "    for p in params:\n"
        "        all_reduce(p.grad)\n"
        "def overlapped(params):\n"  # async: hidden behind other work
        "    for p in params:\n"
        "        dist.all_reduce(p.grad, async_op=True)\n"
        "def start(model):\n"  # weights broadcast once, not a per-step gradient sync
        "    for p in model.parameters():\n"
        "        dist.broadcast(p.detach(), 0)\n"
        "def flat(self, flat_updates):\n"  # one collective per group over an already flat buffer
        "    for group in self.param_groups:\n"
        "        dist.all_reduce(flat_updates[0].grad)\n"
    )
    assert _rows(scan_source(code, "m.py")) == [("communication", ("m.py:4-5",)), ("communication", ("m.py:7-8",))]


def test_library_norms_are_torch_s_not_a_same_named_function_of_the_user():
    code = (
        "import torch\n"
        "import torch.nn.functional as F\n"
        "from torch import nn\n"
        "from .ops import rms_norm\n"  # the user's own: not the library
        "from .layers import RMSNorm\n"
        "from torch.nn import RMSNorm as TorchNorm\n"
        "def a(x):\n    return rms_norm(x)\n"
        "def b(d):\n    return RMSNorm(d)\n"
        "def c(x):\n    return F.rms_norm(x, x.shape[-1:])\n"
        "def d(x):\n    return torch.nn.functional.rms_norm(x, x.shape[-1:])\n"
        "def e(n):\n    return nn.RMSNorm(n)\n"
        "def f(n):\n    return TorchNorm(n)\n"
    )
    rows = _rows(scan_source(code, "m.py", target="npu"))
    assert rows == [("rmsnorm", (f"m.py:{a}-{a + 1}",)) for a in (11, 13, 15, 17)]


def test_one_line_bodies_are_scanned():
    code = (
        "import torch.nn.functional as F\n"
        "def norm(x): return F.rms_norm(x, x.shape[-1:])\n"
        "def scale(model, n):\n"
        "    for p in model.parameters(): p.grad /= n\n"
    )
    assert _rows(scan_source(code, "m.py", target="npu")) == [("optimizer_step", ("m.py:4",)), ("rmsnorm", ("m.py:2",))]


EVAL_ONLY_UPCAST = """\
import torch
import torch.nn.functional as F


class Head(torch.nn.Module):
    def forward(self, x, targets):
        logits = 30 * torch.sigmoid(self.proj(x) / 7.5)
        for_loss = logits.float() if not self.training else logits
        return F.cross_entropy(for_loss.view(-1, for_loss.size(-1)), targets, reduction="sum" if self.training else "mean")
"""


def test_an_upcast_in_one_branch_of_a_conditional_still_feeds_the_loss():
    """Modded-NanoGPT's late records upcast the logits for evaluation only (`logits.float() if not self.training else
    logits`): the NPU's fused cross-entropy takes both, and the scan found neither before."""
    intents = scan_source(EVAL_ONLY_UPCAST, "head.py", target="npu")
    losses = [str(i.spans[0]) for i in intents if str(i.category) == "cross_entropy"]
    assert losses == ["head.py:8-9"], [(str(i.category), str(i.spans[0])) for i in intents]
    assert not [i for i in scan_source(EVAL_ONLY_UPCAST, "head.py", target="cpu") if str(i.category) == "cross_entropy"]
