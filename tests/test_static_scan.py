"""The analyst's static source scan (agents/analyst/static/).

Expected findings were derived by reading the sources: each entry names the code it points at.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainbridge.agents.analyst.static.scan import StaticScanError, scan_repo, scan_repo_result, scan_source
from trainbridge.records import Intent, IntentSource
from trainbridge.tests.static_scan_expectations import EXPECTED_EXAMPLES

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
UNSEEN = Path(__file__).parent / "fixtures" / "unseen_program"

Row = tuple[str, str, int, int]  # (category, file, first line, last line) of an intent's first span


def rows(intents: list[Intent]) -> list[Row]:
    return sorted((i.category.value, i.spans[0].file, i.spans[0].line_start, i.spans[0].line_end) for i in intents)


def spans_of(intents: list[Intent], category: str) -> list[list[str]]:
    return [[f"{s}@{s.function}" for s in i.spans] for i in intents if i.category.value == category]


def scan(code: str) -> list[Row]:
    return rows(scan_source(textwrap.dedent(code), "m.py"))


@pytest.fixture(scope="module")
def example_intents() -> dict[str, list[Intent]]:
    return {name: scan_repo(EXAMPLES / name) for name in EXPECTED_EXAMPLES}


# --- the bundled examples ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(EXPECTED_EXAMPLES))
def test_examples_exact_intents(name, example_intents):
    assert rows(example_intents[name]) == sorted(EXPECTED_EXAMPLES[name])


def test_examples_point_at_helpers_and_rewrite_sites(example_intents):
    llama = example_intents["llama_pretrain"]
    assert spans_of(llama, "rope") == [["model.py:51-52@apply_rotary_pos_emb", "model.py:44-47@rotate_half"]]
    assert spans_of(llama, "swiglu") == [["model.py:68@SwiGLU.forward", "model.py:56-57@silu"]]
    assert spans_of(llama, "rmsnorm") == [["model.py:33@RMSNorm.forward"]]
    resnet = spans_of(example_intents["resnet_classify"], "conv_layout")
    assert resnet == [
        [
            "train.py:76@trainbridge_entry",  # where the model is built: .to(memory_format=...) goes here
            "model.py:12@BasicBlock.__init__",
            "model.py:14@BasicBlock.__init__",
            "model.py:19@BasicBlock.__init__",
            "model.py:35@ResNet.__init__",
        ]
    ]


def test_example_notes_say_what_was_matched(example_intents):
    notes = {(i.category.value, i.spans[0].line_start): i.evidence.notes for i in example_intents["clip_pretrain"]}
    assert "erf form" in notes[("gelu", 43)][0]
    assert "QuickGELU" in notes[("gelu", 47)][0] and "not" in notes[("gelu", 47)][0]
    assert notes[("attention", 66)] == ["attention written out: softmax(q @ k^T, scaled, masked) @ v"]
    gpt2 = {i.category.value: i for i in example_intents["gpt2_pretrain"]}
    assert "tanh" in gpt2["gelu"].evidence.notes[0]
    assert gpt2["layernorm"].confidence == 0.6 and "+ bias" in gpt2["layernorm"].evidence.notes[0]


def test_intents_are_well_formed_static_records(example_intents):
    every = [i for intents in example_intents.values() for i in intents]
    assert len({i.id for i in every}) == len(every)
    for intent in every:
        assert intent.source is IntentSource.static
        assert intent.evidence.detectors == ["static"] and intent.evidence.notes
        assert 0.3 <= intent.confidence <= 0.6
        assert intent.id == Intent.make_id(intent.category, intent.spans)
        assert intent.spans[0].function, f"{intent.category} at {intent.spans[0]} has no enclosing function"
    again = scan_repo(EXAMPLES / "llama_pretrain")
    assert [i.id for i in again] == [i.id for i in example_intents["llama_pretrain"]]


# The README tables of the examples list what an analyser (runtime and static) should find. Every
# static intent must land on a row of its category, and every row must be found, except these:
README_ROWS_NOT_STATIC = {
    ("llama_pretrain", "rope_tables"): "cos/sin tables built once at init: not a per-step rewrite target",
    ("llama_pretrain", "zero_grad"): "plain zero_grad() already sets grads to None (default since torch 2.0)",
    ("gpt2_pretrain", "zero_grad"): "zero_grad(set_to_none=True) is already the cheap form",
    ("resnet_classify", "zero_grad"): "plain zero_grad() already sets grads to None (default since torch 2.0)",
    ("clip_pretrain", "zero_grad"): "plain zero_grad() already sets grads to None (default since torch 2.0)",
    ("resnet_classify", "basic_block"): "conv-BN-ReLU fusion shows in compiled kernels, not in the source",
    ("resnet_classify", "stem"): "conv-BN-ReLU fusion shows in compiled kernels, not in the source",
    ("resnet_classify", "input_layout"): "the input layout follows the model's; reported with the model site",
}
STATIC_ONLY = {"permute_reshape"}  # a category the README tables do not list
README_ROW = re.compile(r"^\|\s*`(?P<id>[a-z0-9_]+)`\s*\|\s*`(?P<cat>[^`]+)`\s*\|\s*`(?P<file>[\w./]+):(?P<a>\d+)(?:-(?P<b>\d+))?`")


def readme_rows(name: str) -> dict[str, Row]:
    out = {}
    for line in (EXAMPLES / name / "README.md").read_text().splitlines():
        m = README_ROW.match(line)
        if m and m["cat"] != "-":
            out[m["id"]] = (m["cat"], m["file"], int(m["a"]), int(m["b"] or m["a"]))
    return out


@pytest.mark.parametrize("name", sorted(EXPECTED_EXAMPLES))
def test_examples_agree_with_their_readme_tables(name, example_intents):
    table = readme_rows(name)
    assert table, f"{name}/README.md lists no patterns"

    def overlaps(row: Row, other: Row) -> bool:
        return row[0] == other[0] and row[1] == other[1] and row[2] <= other[3] and other[2] <= row[3]

    found = rows(example_intents[name])
    for row in found:
        if row[0] not in STATIC_ONLY:
            assert any(overlaps(row, t) for t in table.values()), f"{row} is on no README row of its category"
    for key, row in table.items():
        if (name, key) not in README_ROWS_NOT_STATIC:
            assert any(overlaps(f, row) for f in found), f"README row {key} {row} not found"


# --- a program the scanner has never seen ------------------------------------------------------
EXPECTED_UNSEEN: list[Row] = [
    ("attention", "mixer.py", 38, 42),  # einsum q.k, * scale, + causal bias, F.softmax, dropout, einsum p.v
    ("cross_entropy", "objective.py", 6, 6),  # -(onehot * F.log_softmax(logits)).sum(-1).mean()
    ("geglu", "feedforward.py", 26, 26),  # erf_gelu(self.fc_a(h)) * self.fc_b(h), erf_gelu imported
    ("gelu", "activations.py", 7, 7),  # t * 0.5 * (1.0 + torch.erf(t / math.sqrt(2.0)))
    ("host_sync", "fit.py", 15, 15),  # history.append(loss.detach().cpu()) every iteration
    ("normalize", "heads.py", 24, 24),  # z / torch.norm(z, dim=-1, keepdim=True).clamp_min(1e-6)
    ("optimizer_step", "fit.py", 7, 7),  # torch.optim.Adam(..., foreach=False)
    ("permute_reshape", "fast_block.py", 22, 22),  # y.transpose(1, 2).reshape(b, n, c) after SDPA
    ("permute_reshape", "heads.py", 21, 21),  # .permute(0, 2, 1, 3).contiguous().reshape(b, n, c)
    ("redundant_cast", "heads.py", 25, 26),  # emb32 = emb.to(torch.float32); emb32.float()
    ("rmsnorm", "mixer.py", 29, 30),  # ms = torch.mean(h**2, -1, keepdim=True); h * rsqrt(ms + eps) * gain
    ("rope", "rotary.py", 10, 10),  # cos_t * t + sin_t * swap_halves(t)
    ("silu", "activations.py", 11, 11),  # t / (1.0 + torch.exp(-t))
    ("softmax", "heads.py", 8, 9),  # e = exp(scores - max); e / e.sum(dim=-1, keepdim=True)
    ("swiglu", "feedforward.py", 15, 15),  # self.act(self.proj_gate(h)) * self.proj_in(h), act = nn.SiLU()
    ("zero_grad", "fit.py", 11, 11),  # opt.zero_grad(set_to_none=False)
]


def test_unseen_program_intents():
    result = scan_repo_result(UNSEEN)
    assert result.skipped == []
    assert "__init__.py" in result.files and "fast_block.py" in result.files
    intents = result.intents
    assert rows(intents) == sorted(EXPECTED_UNSEEN)
    # Helpers in other modules are followed through relative imports and recognised by their body.
    assert spans_of(intents, "rope") == [["rotary.py:10@spin", "rotary.py:4-6@swap_halves"]]
    assert spans_of(intents, "geglu") == [["feedforward.py:26@GeluGate.forward", "activations.py:6-7@erf_gelu"]]
    assert spans_of(intents, "rmsnorm") == [["mixer.py:29-30@TokenMixer._rms"]]
    notes = {i.category.value: i.evidence.notes[0] for i in intents}
    assert "einsum" in notes["attention"] and "masked" in notes["attention"]


def test_unseen_program_is_a_working_program():
    """The fixture is real code: it trains for a few steps (so the expectations are about real code)."""
    script = textwrap.dedent(
        """
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        from unseen_program.settings import MixerSettings
        from unseen_program.mixer import TokenMixer
        from unseen_program.feedforward import GatedFeedForward, GeluGate
        from unseen_program.heads import ProjectionHead
        from unseen_program.fast_block import FastBlock
        from unseen_program.fit import fit

        cfg = MixerSettings()

        class Model(torch.nn.Module):
            n_classes = cfg.n_classes

            def __init__(self):
                super().__init__()
                self.mix, self.fast = TokenMixer(cfg), FastBlock(cfg.width, cfg.heads)
                self.ff, self.gg = GatedFeedForward(cfg.width, 96), GeluGate(cfg.width, 96)
                self.head = ProjectionHead(cfg.width, cfg.n_classes)

            def forward(self, x):
                h = self.mix(x)
                h = self.fast(h + self.gg(h + self.ff(h)))
                return self.head(h)[0]

        torch.manual_seed(0)
        batches = lambda it: (torch.randn(2, 16, cfg.width), torch.randint(0, cfg.n_classes, (2,)))
        history, final = fit(Model(), batches, 2)
        assert len(history) == 2 and all(torch.isfinite(h) for h in history), history
        print("ok", final)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script, str(UNSEEN.parent)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1].startswith("ok")


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


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    return root


CONV_MODEL = """
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3))
    """


def test_conv_layout_across_files_and_not_when_channels_last_is_used(tmp_path):
    _write(tmp_path / "a", {"net.py": CONV_MODEL, "run.py": "from net import Net\n\nmodel = Net().to('cpu')\n"})
    (intent,) = scan_repo(tmp_path / "a")
    assert intent.category.value == "conv_layout"
    assert [str(s) for s in intent.spans] == ["run.py:3", "net.py:7"]
    converted = "from net import Net\nimport torch\n\nmodel = Net().to(memory_format=torch.channels_last)\n"
    _write(tmp_path / "b", {"net.py": CONV_MODEL, "run.py": converted})
    assert scan_repo(tmp_path / "b") == []
    patch_embedding = "from torch import nn\n\nproj = nn.Conv2d(3, 64, kernel_size=16, stride=16)\n"
    assert scan_source(patch_embedding, "vit.py") == []  # one patch-embedding conv is not a conv net


# --- files and errors --------------------------------------------------------------------------
def test_syntax_error_names_the_file_and_line():
    with pytest.raises(StaticScanError, match=r"cannot scan pkg/broken.py:2: .*Fix the syntax error"):
        scan_source("def ok():\n    return (1,\n", "pkg/broken.py")


def test_scan_repo_skips_unparseable_files_with_a_note(tmp_path, caplog):
    _write(tmp_path, {"good.py": "import torch\n\ndef f(x):\n    return x * torch.sigmoid(x)\n", "bad.py": "print 'py2'\n"})
    result = scan_repo_result(tmp_path)
    assert rows(result.intents) == [("silu", "good.py", 4, 4)]
    assert [s.file for s in result.skipped] == ["bad.py"] and "bad.py:1" in result.skipped[0].reason
    assert "bad.py" in caplog.text
    with pytest.raises(StaticScanError, match="bad.py"):
        scan_repo(tmp_path, on_syntax_error="raise")


def test_scan_repo_file_selection(tmp_path):
    silu = "import torch\n\ndef f(x):\n    return x * torch.sigmoid(x)\n"
    _write(tmp_path, {"src/a.py": silu, "src/b.py": silu, "tests/test_a.py": silu, ".venv/lib/c.py": silu, "test_d.py": silu})
    assert [i.spans[0].file for i in scan_repo(tmp_path)] == ["src/a.py", "src/b.py"]
    chosen = scan_repo(tmp_path, [Path("src/b.py"), tmp_path / "tests" / "test_a.py"])
    assert [i.spans[0].file for i in chosen] == ["src/b.py", "tests/test_a.py"]
    with pytest.raises(ValueError, match="not inside the repository"):
        scan_repo(tmp_path / "src", [tmp_path / "test_d.py"])
