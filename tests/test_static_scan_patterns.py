"""The analyst's static source scan (agents/analyst/static/) pattern by pattern: the spellings of each
pattern, code that is not one, nesting and gating through methods and wrappers, patterns over several
statements, and the program rules (host syncs, optimizer and zero_grad, conv layout).

Expected findings were derived by reading the sources: each entry names the code it points at.
"""

from __future__ import annotations

import textwrap

import pytest

from trainbridge.agents.analyst.static.scan import scan_repo, scan_source
from trainbridge.tests.static_scan_support import rows, scan, write_files


# --- spellings ---------------------------------------------------------------------------------
SPELLINGS = [
    ("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w", "rmsnorm"),
    ("x * torch.rsqrt(torch.mean(x ** 2, dim=-1, keepdim=True) + eps)", "rmsnorm"),
    ("x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)", "rmsnorm"),
    ("x * (1.0 / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))", "rmsnorm"),
    ("w * (x * (x.pow(2).mean(dim=-1, keepdim=True) + eps) ** -0.5)", "rmsnorm"),
    ("(x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, keepdim=True, unbiased=False) + eps) * w + b", "layernorm"),
    ("q * cos + torch.cat((-q[..., h:], q[..., :h]), dim=-1) * sin", "rope"),
    ("F.silu(gate) * up", "swiglu"),
    ("torch.nn.functional.silu(self.w1(x)) * self.w3(x)", "swiglu"),
    ("a * torch.sigmoid(a) * b", "swiglu"),
    ("F.gelu(a, approximate='tanh') * b", "geglu"),
    ("x * torch.sigmoid(x)", "silu"),
    ("x * x.sigmoid()", "silu"),
    ("0.5 * x * (1 + torch.tanh(0.7978845608 * (x + 0.044715 * x * x * x)))", "gelu"),
    ("x * 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))", "gelu"),
    ("torch.exp(x) / torch.sum(torch.exp(x), dim=-1, keepdim=True)", "softmax"),
    ("F.nll_loss(F.log_softmax(logits, -1), t)", "cross_entropy"),
    ("-torch.log(torch.softmax(z, -1)).gather(1, t[:, None]).mean()", "cross_entropy"),
    ("x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)", "normalize"),
    ("x.permute(0, 2, 1, 3).reshape(b, n, c)", "permute_reshape"),
    ("torch.reshape(x.transpose(1, 2), (b, n, -1))", "permute_reshape"),
    ("x.transpose(1, 2).flatten(2)", "permute_reshape"),
    ("x.float().float()", "redundant_cast"),
    ("x.type_as(y).type_as(y)", "redundant_cast"),
    ("x.float().to(torch.bfloat16)", "redundant_cast"),
    ("torch.zeros(3, dtype=torch.float32).float()", "redundant_cast"),
    ("torch.softmax(torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d), dim=-1) @ v", "attention"),
    ("torch.einsum('bhij,bhjd->bhid', torch.einsum('bhid,bhjd->bhij', q, k).softmax(-1), v)", "attention"),
]


@pytest.mark.parametrize("expression,category", SPELLINGS)
def test_spellings_of_each_pattern(expression, category):
    code = f"import math\nimport torch\nimport torch.nn.functional as F\n\n\ndef f(self, x, y, a, b, q, k, v, gate, up, w, eps, h, cos, sin, logits, t, z, d, n, c):\n    return {expression}\n"
    assert scan(code) == [(category, "m.py", 7, 7)]


NOT_PATTERNS = [
    "F.rms_norm(x, (x.shape[-1],), w, 1e-6)",
    "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
    "F.cross_entropy(logits, t)",
    "F.layer_norm(x, (x.shape[-1],), w, b)",
    "F.silu(x)",  # the library call, not gated
    "F.gelu(x) * 2.0",  # a constant factor is not a gate
    "F.normalize(x, dim=-1)",
    "x * torch.rsqrt(torch.mean(x ** 2) + eps)",  # a global mean: not a norm over a dimension
    "x / torch.sqrt(x.var(-1, keepdim=True) + eps)",  # not centred
    "x * torch.sigmoid(2.0 * x)",  # neither SiLU nor QuickGELU
    "x / x.norm(p=1, dim=-1, keepdim=True)",  # L1
    "x.view(b, n, h, d).transpose(1, 2)",  # a view then a transpose: no copy
    "x.flatten(2).transpose(1, 2)",
    "x.half().float()",  # a round trip through half changes values
    "x.to(d).float()",  # .to(device) is not a cast
    "q @ k.transpose(-2, -1)",  # scores alone
    "torch.log_softmax(z, -1)",
]


@pytest.mark.parametrize("expression", NOT_PATTERNS)
def test_code_that_is_not_a_pattern_gives_no_intent(expression):
    code = f"import torch\nimport torch.nn.functional as F\n\n\ndef f(x, w, b, q, k, v, logits, t, eps, n, h, d, z):\n    return {expression}\n"
    assert scan(code) == []


def test_unbiased_variance_layernorm_is_reported_with_a_warning():
    (intent,) = scan_source("def f(x, e):\n    return (x - x.mean(-1, keepdim=True)) / (x.var(-1, keepdim=True) + e).sqrt()\n", "m.py")
    assert intent.category.value == "layernorm" and intent.confidence == 0.4
    assert "unbiased variance" in intent.evidence.notes[0]


def test_nested_matches_are_reported_once():
    code = """
        import torch

        def layer_norm(x, w, b, eps):
            mu = x.mean(-1, keepdim=True)
            var = (x - mu).pow(2).mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(var + eps) * w + b

        def attention(q, k, v):
            s = q @ k.transpose(-2, -1)
            p = torch.exp(s) / torch.exp(s).sum(-1, keepdim=True)
            return p @ v

        def gated(a, b):
            return a * torch.sigmoid(a) * b
        """
    # The centred division is also "x / sqrt(mean(x^2) + eps)" with x := (x - mu): inside the LayerNorm.
    # The manual softmax is inside the attention; a * sigmoid(a) inside the gate.
    assert scan(code) == [("attention", "m.py", 10, 12), ("layernorm", "m.py", 5, 7), ("swiglu", "m.py", 15, 15)]


def test_gates_through_methods_wrappers_and_submodules():
    code = """
        import torch
        from torch import nn
        import torch.nn.functional as F

        class MLP(nn.Module):
            def __init__(self):
                super().__init__()
                self.act = nn.GELU(approximate="tanh")

            def _swish(self, t):
                return t * torch.sigmoid(t)

            def forward(self, x):
                a = self._swish(self.w1(x)) * self.w3(x)
                b = self.act(self.w1(x)) * self.w3(x)
                return a + b

        def wrapped(x):
            return F.silu(x)

        def use(x, y):
            return wrapped(x) * y
        """
    intents = scan_source(textwrap.dedent(code), "m.py")
    assert [[f"{s}@{s.function}" for s in i.spans] for i in intents] == [
        ["m.py:12@MLP._swish"],  # silu: the method's body
        ["m.py:15@MLP.forward", "m.py:11-12@MLP._swish"],  # swiglu through the method
        ["m.py:16@MLP.forward"],  # geglu through the nn.GELU submodule
        ["m.py:23@use", "m.py:19-20@wrapped"],  # swiglu through a wrapper of F.silu
    ]
    assert [i.category.value for i in intents] == ["silu", "swiglu", "geglu", "swiglu"]


def test_a_pattern_over_several_statements_spans_them_all():
    code = """
        import torch

        def norm(hidden, weight, eps):
            dtype = hidden.dtype
            hidden = hidden.to(torch.float32)
            variance = hidden.pow(2).mean(-1, keepdim=True)
            hidden = hidden * torch.rsqrt(variance + eps)
            return weight * hidden.to(dtype)
        """
    (intent,) = scan_source(textwrap.dedent(code), "m.py")
    assert (intent.category.value, str(intent.spans[0]), intent.spans[0].function) == ("rmsnorm", "m.py:7-9", "norm")


def test_adjacent_matches_in_one_function_are_one_intent():
    code = """
        import torch

        def rot(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        def apply(q, k, cos, sin):
            q = q * cos + rot(q) * sin
            k = k * cos + rot(k) * sin

            v = k * cos + rot(k) * sin
            return q, k, v
        """
    intents = scan_source(textwrap.dedent(code), "m.py")
    assert [[str(s) for s in i.spans] for i in intents] == [["m.py:9-10", "m.py:4-6"], ["m.py:12", "m.py:4-6"]]


# --- program rules -----------------------------------------------------------------------------
def test_host_sync_only_once_per_step():
    code = """
        import torch

        def train(model, data, opt):
            for epoch in range(3):
                for x, y in data:
                    loss = model(x).sum()
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                    seen.append(loss.item())
                    if step % 100 == 0:
                        print(loss.item())
                print(loss.item())
            return (model(x).argmax(-1) == y).float().mean().item()

        def step(model, batch, optimizer):
            loss = model(batch).mean()
            loss.backward()
            optimizer.step()
            return loss.cpu()

        def timed(model, batch, optimizer):
            for i in range(10):
                loss = step(model, batch, optimizer)
                torch.cuda.synchronize()
                print(loss.item())
            for i in range(10):
                losses.append(step(model, batch, optimizer).tolist())

        def evaluate(model, data):
            return [model(x).tolist() for x in data]
        """
    # per step: .item() in the inner loop, .cpu() in the step function, .tolist() in a loop calling it;
    # not: every 100 steps, once per epoch, once at the end, a loop that synchronizes anyway, evaluation.
    assert scan(code) == [("host_sync", "m.py", 11, 11), ("host_sync", "m.py", 21, 21), ("host_sync", "m.py", 29, 29)]


def test_optimizer_and_zero_grad_rules():
    code = """
        import torch
        from torch import optim

        def build(model, params):
            a = torch.optim.AdamW(params, lr=1e-3, foreach=False)
            b = optim.SGD(params, lr=0.1)
            c = optim.SGD(params, lr=0.1, fused=True)
            d = torch.optim.Adam(params, foreach=True)
            return a, b, c, d

        def step(model, opt, loss):
            opt.zero_grad(set_to_none=False)
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                p.grad.data.zero_()
            opt.step()
        """
    intents = scan_source(textwrap.dedent(code), "m.py")
    assert rows(intents) == [
        ("optimizer_step", "m.py", 6, 6),
        ("optimizer_step", "m.py", 7, 7),
        ("zero_grad", "m.py", 13, 13),
        ("zero_grad", "m.py", 17, 17),
    ]
    confidence = {i.spans[0].line_start: i.confidence for i in intents}
    assert confidence[6] > confidence[7]  # foreach=False is certain; the default depends on the device


CONV_MODEL = """
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    """


def test_conv_layout_across_files_and_not_when_channels_last_is_used(tmp_path):
    write_files(tmp_path / "a", {"net.py": CONV_MODEL, "run.py": "from net import Net\n\nmodel = Net().to('cpu')\n"})
    (intent,) = scan_repo(tmp_path / "a")
    assert intent.category.value == "conv_layout"
    assert [str(s) for s in intent.spans] == ["run.py:3", "net.py:7"]
    converted = "from net import Net\nimport torch\n\nmodel = Net().to(memory_format=torch.channels_last)\n"
    write_files(tmp_path / "b", {"net.py": CONV_MODEL, "run.py": converted})
    assert scan_repo(tmp_path / "b") == []
    patch_embedding = "from torch import nn\n\nproj = nn.Conv2d(3, 64, kernel_size=16, stride=16)\n"
    assert scan_source(patch_embedding, "vit.py") == []  # one patch-embedding conv is not a conv net
