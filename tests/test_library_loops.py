"""Training loops run by libraries, in script mode (issue 26, item 3): a Hugging Face Trainer script, an accelerate
loop and a Lightning module (tests/fixtures/library_loops/, tiny random-weight models, random data, no download), each
run unmodified as `train.py` of a fresh repository.

init finds each one's launch line (a library trainer's loop counts as training) and its check measures steps whose
loss is the loss the script itself prints; Lightning's own `max_steps` shrinks the run through a call override; the
coder's library patch of the Trainer script's LlamaRMSNorm and a candidate of the Lightning module are judged by the
gate (numerics through the Trainer's wrapped optimizer and Lightning's closure steps). Real children, each run as
small as the gate allows (one round): a whole `trainbridge run` of these scripts is left to benchmarks and the
README's example, since its baseline, profile and gate took 5.5 of this file's 8.5 minutes on 2 busy cores.
"""

from __future__ import annotations

import inspect
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")  # dev dependencies (pyproject's dev extra, pinned in constraints.txt)
pytest.importorskip("accelerate")
pytest.importorskip("pytorch_lightning")

from script_repos import commit_all  # noqa: E402
from trainbridge.graph.cli.init import check_once  # noqa: E402
from trainbridge.sandbox.runner import run_workload  # noqa: E402
from trainbridge.sandbox.workload import load_workload  # noqa: E402
from trainbridge.tools.launch.discovery import discover_launch  # noqa: E402
from trainbridge.tools.launch.init_toml import render_toml  # noqa: E402

pytestmark = pytest.mark.timeout(1800)

FIXTURES = Path(__file__).parent / "fixtures" / "library_loops"
SMALL = "warmup_steps = 1\nsteps = 2\ntimeout_s = 300\n"


def library_repo(path: Path, fixture: str, toml: str | None = None) -> Path:
    """A git repository holding one fixture as train.py (and `toml` as its trainbridge.toml), outputs git-ignored."""
    path.mkdir(parents=True)
    shutil.copy(FIXTURES / f"{fixture}.py", path / "train.py")
    (path / ".gitignore").write_text("out/\nlightning_logs/\n", encoding="utf-8")
    if toml is not None:
        (path / "trainbridge.toml").write_text(toml, encoding="utf-8")
    commit_all(path)
    return path


def printed_losses(stdout: str) -> list[float]:
    """The losses the script printed, one `STEP <n> loss=<value>` line per optimizer step."""
    return [float(m.group(1)) for m in re.finditer(r"^STEP \d+ loss=(\S+)$", stdout, re.MULTILINE)]


@pytest.mark.parametrize("fixture, trains_by, shrink_keys", [
    ("hf_trainer", "runs transformers.Trainer", {"TrainingArguments(max_steps)", "TrainingArguments(per_device_train_batch_size)",
                                                  "TrainingArguments(gradient_accumulation_steps)"}),
    ("accelerate_loop", "builds an optimizer and calls .backward()", {"--max_steps", "--batch_size"}),
    ("lightning_module", "runs pytorch_lightning.Trainer", {"Trainer(max_steps)"}),
])
def test_init_finds_the_library_loop_and_its_check_measures_the_scripts_own_losses(tmp_path, fixture, trains_by, shrink_keys):
    root = library_repo(tmp_path / "repo", fixture)
    found = discover_launch(root, cuda=False)
    assert found.best is not None and found.best.launch == "python train.py", (found.candidates, found.near_misses)
    assert any(trains_by in reason for reason in found.best.reasons), found.best.reasons
    assert shrink_keys <= {s.key for s in found.settings}, found.settings
    (root / "trainbridge.toml").write_text(render_toml(found, found.best), encoding="utf-8")
    result = check_once(root)  # init's check: warm-up and measured steps of the line it wrote
    assert result is not None and result.ok, (result.failure if result else None, result.stderr_tail[-2000:] if result else "")
    steps = [*result.losses, *result.cooldown_losses]
    printed = printed_losses(result.stdout_tail)
    # one step per optimizer step of the library's loop (two micro-batches each for Trainer and accelerate), its loss the
    # loss the script printed for that step: backward's scalars summed (Lightning's closure ran inside optimizer.step)
    assert len(steps) >= 3 and printed[:len(steps)] == pytest.approx(steps, rel=1e-5), (steps, printed)
    assert result.extra["script"]["loss_sources"] == {"backward-unscaled": len(steps)}
    # the library's own seeding (transformers' and accelerate's set_seed, Lightning's seed_everything) reached the gate's
    seeded = {(function, value) for function, value, _ in result.extra["script"]["seed_calls"]}
    assert {("torch.manual_seed", "1234"), ("random.seed", "1234")} <= seeded, seeded
    assert len(result.step_times_s) == 2 and all(t > 0 for t in result.step_times_s)


def test_lightning_max_steps_shrinks_through_a_call_override_and_the_early_end_says_which(tmp_path):
    root = library_repo(tmp_path / "repo", "lightning_module",
                        'launch = "python train.py"\n' + SMALL + '\n[overrides]\n"Trainer(max_steps)" = 2\n')
    result = run_workload(load_workload(root))
    assert result.failure is not None and "finished after 2 optimizer step(s)" in result.failure.message, result.failure
    assert '"Trainer(max_steps)" = 1000' in result.failure.message  # the run-longer advice in Lightning's terms


# Verdicts the gate reaches when both sides ran and their numerics matched (a refusal before the gate, such as
# not_applicable, is none; a candidate of these recipes trains the same model)
GATE_REASONS = {"accepted", "not_significant", "slower"}


def test_the_coder_patches_the_library_under_a_trainer_script_and_the_gate_judges_it(tmp_path):
    """What a `trainbridge run --category rmsnorm` of the Trainer script does after its analysis, without the run's
    baseline and profile (tests/test_library_regions.py locates the region): the coder writes LlamaRMSNorm's library
    patch for the intent reached from `trainer.train()`, and the gate trains both sides under the Trainer."""
    import git

    from transformers.models.llama import modeling_llama

    from trainbridge.agents.coder.candidate import Candidate, make_candidate
    from trainbridge.agents.profiler.judge import judge_candidate
    from trainbridge.knowledge.schema import load_recipe_dir
    from trainbridge.records import Intent, SourceSpan
    from trainbridge.tests.git_ops_support import workspace
    from trainbridge.tools.codemods.library_patch import IMPORT_LINE, PATCH_MODULE
    from trainbridge.tools.library_code import library_span

    root = library_repo(tmp_path / "repo", "hf_trainer", 'launch = "python train.py"\n' + SMALL)
    source = (root / "train.py").read_text(encoding="utf-8").splitlines()
    call = next(i for i, line in enumerate(source, start=1) if "trainer.train()" in line)
    lines, first = inspect.getsourcelines(modeling_llama.LlamaRMSNorm.forward)
    library = library_span("transformers/models/llama/modeling_llama.py", first, first + len(lines) - 1,
                           "LlamaRMSNorm.forward")
    spans = [SourceSpan(file="train.py", line_start=call, line_end=call)]
    intent = Intent(id=Intent.make_id("rmsnorm", spans, library), category="rmsnorm", spans=spans, library=library,
                    confidence=0.5, source="advisor_rule")
    recipes = {r.id: r for r in load_recipe_dir(Path(__file__).resolve().parents[1] / "knowledge" / "recipes")}
    recipe = recipes["rmsnorm-hf-llama-patch-rms-norm"]
    work = workspace(git.Repo(root), tmp_path)
    made = make_candidate(work, intent, recipe)
    assert isinstance(made, Candidate), made
    assert sorted(made.files) == ["train.py", PATCH_MODULE] and IMPORT_LINE in (Path(made.worktree) / "train.py").read_text()
    verdict = judge_candidate(work.worktree, Path(made.worktree), target="cpu", recipe_numerics=recipe.numerics, rounds=1,
                              max_rounds=1, min_gain=0.01)
    # both sides trained under the Trainer (its AcceleratedOptimizer, two micro-batches a step, its own set_seed) with
    # the same losses and gradients, and were timed
    assert verdict.numerics is not None and verdict.numerics.passed, verdict.message
    assert verdict.reason.value in GATE_REASONS, (verdict.reason, verdict.message)
    assert verdict.baseline_rounds and verdict.candidate_rounds and all(t > 0 for t in verdict.candidate_rounds[0])


def test_the_gate_judges_a_candidate_of_a_lightning_module(tmp_path):
    from trainbridge.agents.profiler.judge import judge_candidate

    toml = 'launch = "python train.py"\n' + SMALL
    base = library_repo(tmp_path / "base", "lightning_module", toml)
    candidate = library_repo(tmp_path / "candidate", "lightning_module", toml)
    script = candidate / "train.py"
    before = "torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)"
    assert before in script.read_text(encoding="utf-8")
    script.write_text(script.read_text(encoding="utf-8").replace(before, before[:-1] + ", foreach=True)"), encoding="utf-8")
    verdict = judge_candidate(base, candidate, target="cpu", rounds=1, max_rounds=1, min_gain=0.01)
    # the probe ran Lightning's closure steps on both sides: the same losses and gradients within tolerance
    assert verdict.numerics is not None and verdict.numerics.passed, verdict.message
    assert verdict.reason.value in GATE_REASONS, (verdict.reason, verdict.message)


def test_accelerates_optimizer_wrapper_is_left_out_for_the_optimizer_it_wraps_and_can_be_counted():
    from accelerate import Accelerator

    from trainbridge.sandbox.script.hooks import live_optimizers
    from trainbridge.tools.eager_op_counts import OpCounter

    model = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, wrapped = Accelerator(cpu=True).prepare(model, inner)
    assert type(wrapped).__name__ == "AcceleratedOptimizer" and isinstance(wrapped, torch.optim.Optimizer)
    with pytest.raises(AttributeError, match="_optimizer_step_pre_hooks"):  # what the compile reference's counter met
        wrapped.register_step_pre_hook(lambda *a: None)
    listed = [o for o in live_optimizers() if o is inner or o is wrapped]
    assert listed == [inner]
    OpCounter([model], listed).install().remove()  # hooks only the optimizer whose __init__ ran


def test_the_compile_arm_compiles_the_model_a_lightning_module_holds_when_it_has_no_forward_of_its_own():
    import pytorch_lightning as pl

    from trainbridge.sandbox.script.library_steps import forward_owners

    class Holds(pl.LightningModule):  # training_step calls self.model(...), as people write around a library model
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
            self.metric = torch.nn.Identity()  # no parameters: nothing to compile

    class Own(Holds):
        def forward(self, x):
            return self.model(x)

    holds, own = Holds(), Own()
    assert forward_owners(holds) == [holds.model] and forward_owners(own) == [own]
