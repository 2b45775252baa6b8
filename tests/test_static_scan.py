"""The analyst's static source scan (agents/analyst/static/) on whole programs: the bundled examples, a
program the scanner has never seen, files and errors (the spellings of each pattern and the
program rules: tests/test_static_scan_patterns.py).

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
from trainbridge.tests.static_scan_support import Row, rows, spans_of, write_files


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
UNSEEN = Path(__file__).parent / "fixtures" / "unseen_program"


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


# --- files and errors --------------------------------------------------------------------------
def test_syntax_error_names_the_file_and_line():
    with pytest.raises(StaticScanError, match=r"cannot scan pkg/broken.py:2: .*Fix the syntax error"):
        scan_source("def ok():\n    return (1,\n", "pkg/broken.py")


def test_scan_repo_skips_unparseable_files_with_a_note(tmp_path, caplog):
    write_files(tmp_path, {"good.py": "import torch\n\ndef f(x):\n    return x * torch.sigmoid(x)\n", "bad.py": "print 'py2'\n"})
    result = scan_repo_result(tmp_path)
    assert rows(result.intents) == [("silu", "good.py", 4, 4)]
    assert [s.file for s in result.skipped] == ["bad.py"] and "bad.py:1" in result.skipped[0].reason
    assert "bad.py" in caplog.text
    with pytest.raises(StaticScanError, match="bad.py"):
        scan_repo(tmp_path, on_syntax_error="raise")


def test_scan_repo_file_selection(tmp_path):
    silu = "import torch\n\ndef f(x):\n    return x * torch.sigmoid(x)\n"
    write_files(tmp_path, {"src/a.py": silu, "src/b.py": silu, "tests/test_a.py": silu, ".venv/lib/c.py": silu, "test_d.py": silu})
    assert [i.spans[0].file for i in scan_repo(tmp_path)] == ["src/a.py", "src/b.py"]
    chosen = scan_repo(tmp_path, [Path("src/b.py"), tmp_path / "tests" / "test_a.py"])
    assert [i.spans[0].file for i in chosen] == ["src/b.py", "tests/test_a.py"]
    with pytest.raises(ValueError, match="not inside the repository"):
        scan_repo(tmp_path / "src", [tmp_path / "test_d.py"])
