"""The torch.compile reference of an unmodified script (sandbox/script/capture.py): `analyze` with the reference and
`collect-evidence` in script mode. The quick tests check the pieces in this process; the slow ones compile real
scripts in the sandbox (caches off, so each pays a cold compile)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from trainbridge.sandbox.script.capture import capture_plan
from trainbridge.sandbox.script.hooks import compile_trained_modules
from trainbridge.sandbox.workload import load_workload
from script_repos import nanogpt_repo, script_repo
from trainbridge.tools.eager_op_counts import OpCounter

NANO = '''launch = "python train.py --batch_size=2 --block_size=16 --n_layer=1 --n_embd=32 --n_head=2 --compile={compile}"
data = ["data/"]
warmup_steps = 1
steps = 2
timeout_s = 120
'''


def test_the_capture_plan_runs_eager_windows_then_compiles_traces_and_times():
    plan, windows = capture_plan(steps=2, timed=3)
    assert windows == {"count_at": 1, "compile_at": 2, "trace_at": 4, "timed": 3}
    assert plan.warmup == [0, 1] and plan.measured == [2, 3, 4] and plan.cooldown == [5, 6, 7]
    _, windows = capture_plan(steps=0, timed=0)
    assert windows["trace_at"] == 4 and windows["timed"] == 0  # forward and backward compile always get their window


def test_op_counts_of_a_window_between_two_boundaries_split_two_models_and_their_optimizers():
    torch.manual_seed(0)
    body, head = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU()), torch.nn.Linear(8, 2)
    optimizers = [torch.optim.SGD(body.parameters(), lr=0.1), torch.optim.Adam(head.parameters())]
    x = torch.randn(3, 4)

    def loss_of():
        return torch.nn.functional.cross_entropy(head(body(x)), torch.tensor([0, 1, 0]))

    counter = OpCounter([body, head], optimizers).install()
    loss = loss_of()  # the forward before the window: its backward is counted in the window
    counter.start()
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    loss = loss_of()  # the next forward closes the window, as the script's next backward would
    counter.stop()
    counter.remove()
    counts = counter.report(step=1)
    ops = counts["ops"]
    assert ops["forward_model"].get("aten.addmm") == 2 and ops["forward_model"].get("aten.relu") == 1
    assert ops["forward_other"].get("aten._log_softmax") == 1  # the loss is outside both models
    assert counts["ops_per_phase"]["backward_model"] >= 4 and counts["ops_per_phase"]["optimizer"] > 0
    assert "aten.addmm" not in ops["forward_other"] and not body._forward_hooks and not head._forward_pre_hooks


def test_the_trained_modules_get_a_compiled_forward_and_a_script_compiled_module_is_left_alone():
    trained, frozen = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    own = torch.compile(torch.nn.Linear(3, 3))  # compiled by the script itself
    optimizer = torch.optim.SGD([*trained.parameters(), *own.parameters()], lr=0.1)
    assert compile_trained_modules() == ["Linear"]  # the optimizer's, not the frozen one, not the script's own
    assert trained.forward.__func__._torchdynamo_orig_callable.__qualname__ == "Linear.forward"  # Dynamo's wrapper, bound to it
    assert trained.forward.__self__ is trained
    assert "forward" not in vars(frozen) and "forward" not in vars(own._orig_mod)
    assert compile_trained_modules() == []  # compiled once only
    del optimizer


def _pack_evidence(tmp_path, repo):
    from trainbridge.graph.cli.app import build_app

    pack = tmp_path / "evidence.tar.gz"
    result = CliRunner().invoke(build_app(), ["collect-evidence", str(repo), "--out", str(pack)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return pack


@pytest.mark.slow
def test_collect_evidence_of_an_unmodified_nanogpt_script_and_the_analysis_that_reads_it(tmp_path):
    from trainbridge.agents.analyst.analyze import analyze_repo
    from trainbridge.tools.evidence_pack import read_pack
    from trainbridge.tools.inductor.parser import parse_evidence_dir

    repo = nanogpt_repo(tmp_path / "repo", NANO.format(compile=False).replace("timeout_s = 120", "timeout_s = 600"))
    pack = _pack_evidence(tmp_path, repo)
    unpacked = read_pack(pack, tmp_path / "unpacked")
    manifest = json.loads((unpacked.evidence_dir / "manifest.json").read_text())
    assert manifest["mode"] == "script" and manifest["compiled_modules"] == ["GPT"] and not manifest["script_compiled"]
    parsed = parse_evidence_dir(unpacked.evidence_dir, repo)
    summary = parsed.summary
    assert summary.kernels_per_step.get("forward", 0) > 0 and summary.kernels_per_step.get("backward", 0) > 0
    assert {span.file for group in parsed.groups for span in group.spans} == {"model.py"}  # the script's own model code
    assert summary.eager_ops_per_step["forward_model"] > summary.kernels_per_step["forward"]  # N eager ops vs K kernels
    assert summary.eager_ops_per_step["optimizer"] > 0 and summary.timed_groups > 0  # the traced window was compiled
    assert not summary.recompiles and not summary.graph_breaks

    analysis = analyze_repo(load_workload(repo), reference_pack=pack)
    assert analysis.mode == "runtime" and analysis.reference_source == str(pack)
    assert any(intent.evidence.reference_kernels for intent in analysis.intents), [i.model_dump() for i in analysis.intents][:3]


@pytest.mark.slow
def test_analyze_compiles_the_reference_of_an_epoch_loop_with_two_optimizers(tmp_path):
    from trainbridge.agents.analyst.analyze import analyze_repo

    repo = script_repo(tmp_path / "repo", "epoch_two_optimizers.py", 'launch = "python train.py"\nwarmup_steps = 1\nsteps = 2\n')
    analysis = analyze_repo(load_workload(repo))
    assert analysis.mode == "runtime" and analysis.reference_source == "compiled here", analysis.notes
    assert analysis.reference.kernels_per_step.get("forward", 0) > 0 and analysis.reference.kernels_per_step.get("backward", 0) > 0
    assert analysis.reference_step_s is not None and analysis.reference_step_s > 0
    assert analysis.reference.eager_ops_per_step["optimizer"] > 0  # SGD and Adam, each counted in their step


@pytest.mark.slow
def test_a_script_that_compiles_its_model_itself_keeps_its_own_compile_as_the_reference(tmp_path):
    from trainbridge.sandbox.runner import run_workload
    from trainbridge.tools.inductor.parser import parse_evidence_dir

    repo = script_repo(tmp_path / "repo", "compiles_itself.py", 'launch = "python train.py --compile"\nwarmup_steps = 1\nsteps = 2\n'
                       'timeout_s = 600\n')
    evidence = tmp_path / "evidence"
    result = run_workload(load_workload(repo).with_overrides(steps=2, warmup_steps=0), mode="capture",
                          extra_request={"evidence_dir": str(evidence), "timed_steps": 2})
    assert result.ok, (result.failure, result.stderr_tail[-2000:])
    assert result.extra["script_compiled"] and result.extra["compiled_modules"] == []
    assert "compiling the model..." in result.stdout_tail  # the script's --compile branch ran
    manifest = json.loads((evidence / "manifest.json").read_text())
    assert any("compiles its model itself" in note for note in manifest["notes"]) and manifest["cold_compile_step_s"] is None
    assert not (evidence / "eager_op_counts.json").exists()  # its step is not eager: no N to count
    parsed = parse_evidence_dir(evidence, repo)
    assert parsed.summary.kernels_per_step.get("forward", 0) > 0 and parsed.summary.kernels_per_step.get("backward", 0) > 0
    assert {span.file for group in parsed.groups for span in group.spans} == {"train.py"}  # the script's own Block
