"""benchmarks/records.py's whole pipeline in CI (issue 28): a record-style program of our own (tests/fixtures/records/
train_gpt.py, in the style of the early Modded-NanoGPT records) in the log of a fake mirror (a bare git repository
with records/track_1_short/<folder>/<log>.txt), taken into a temporary repository with git-ignored token shards,
`trainbridge port --to npu`, `trainbridge run --target npu` with the compile reference, and the results page. Public
code never enters this repository: the real records run from a fetched mirror, outside the suite."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import tomllib
from pathlib import Path

import numpy as np
import pytest

from record_repos import build_repo, code_from_log, record_script
from records_catalog import RECORDS, RecordSource, toml_text

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "records" / "train_gpt.py"
RULE = "=" * 100
FOLDER, LOG = "2099-01-01_Fixture", "0f1e2d3c-fixture.txt"
SMALL = {"GPTConfig(n_layer)": 1, "GPTConfig(n_embd)": 32, "Hyperparameters.sequence_length": 32,
         "Hyperparameters.val_tokens": 64}  # val_tokens: one val batch of B * T


def _benchmark():
    """benchmarks/records.py by path: the package has a records module of its own."""
    spec = importlib.util.spec_from_file_location("records_benchmark", ROOT / "benchmarks" / "records.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@localhost", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def fake_mirror(tmp: Path, code: str) -> Path:
    """A bare repository laid out as KellerJordan/modded-nanogpt keeps a record: the log opens with the code between
    lines of 100 '=', then the hardware, then the steps (the early records' layout)."""
    work = tmp / "mirror-work"
    log = work / "records" / "track_1_short" / FOLDER / LOG
    log.parent.mkdir(parents=True)
    log.write_text(f"{RULE}\n{code}{RULE}\nRunning pytorch 2.5.0 compiled for CUDA 12.4\nnvidia-smi:\n(8 GPUs)\n{RULE}\n"
                   "step:0/3000 val_loss:10.8258 train_time:0ms step_avg:nanms\n", encoding="utf-8")
    _git(work, "init", "-q", "--initial-branch=master")
    _git(work, "add", "-A")
    _git(work, "commit", "-qm", "a record")
    _git(tmp, "clone", "-q", "--bare", str(work), str(tmp / "mirror.git"))
    return tmp / "mirror.git"


def test_code_is_taken_from_both_log_layouts():
    code = "import os\nimport sys\nprint('train')\n"
    early = f"{RULE}\n{code}{RULE}\nnvidia-smi output\n{RULE}\nstep:1/10 train_loss:9.0\n"
    late = f"{code}\n{RULE}\nRunning Python 3.12\n{RULE}\nstep:0/1750 val_loss:10.83\n"
    assert code_from_log(early) == code
    assert code_from_log(late) == code + "\n"


def test_the_catalog_maps_every_published_record_and_writes_a_one_process_toml(tmp_path):
    published = [2, 4, 5, 6, 7, 8, 9, 10, 17, 27, 32, 37, 38, 39, 40, 41, 42, 47, 49, 50]
    assert [r.number for r in RECORDS] == published
    assert all(r.folder and r.log and 1.2 < r.published_speedup < 2.6 for r in RECORDS)
    for source in RECORDS:
        toml = tomllib.loads(toml_text(source))
        assert toml["launch"].startswith("torchrun --standalone --nproc_per_node=1 ")
        assert toml["data"] == ["data/fineweb10B/"]
        assert all(value is not None for value in toml["overrides"].values())
    early = {r.number: r for r in RECORDS}[5].overrides_all()
    assert {r.number: r.vocab() for r in RECORDS if r.number in (2, 5, 17, 50)} == {2: 1024, 5: 1024, 17: 50257, 50: 50257}
    assert early["Hyperparameters.val_loss_every"] == 0 and early["GPTConfig(n_layer)"] == 2


@pytest.mark.slow
def test_records_benchmark_ports_runs_and_writes_the_page_for_a_record_style_program(tmp_path):
    records = _benchmark()
    mirror = fake_mirror(tmp_path, FIXTURE.read_text(encoding="utf-8"))
    # the early profile's shrink, smaller still where the record's names allow (per-record overrides, as the catalog
    # has them): one layer of width 32 over 32 tokens
    source = RecordSource(1, "fixture record", FOLDER, LOG, 1.5, script="train_gpt.py", profile="early",
                          overrides=SMALL)
    script = record_script(mirror, source)
    assert script == FIXTURE.read_text(encoding="utf-8")

    # one intent, one candidate: the attention rewrite. Most of the run is the torch.compile reference's cold compile
    # (80 of 141 s on a loaded 2-core host, 5 engineers' runs beside it; the whole test took 318 s there with two
    # layers of width 64, rotary and QK-norm); the budget is a ceiling
    row = records.run_record(source, mirror, tmp_path / "work", tmp_path / "home", budget_s=600, max_candidates=1,
                             gate_rounds=6, categories=("attention",), say=lambda line: None)
    repo = tmp_path / "work" / "record-1" / "repo"
    ignored = _git(repo, "status", "--porcelain", "--ignored")
    assert "!! data/" in ignored and "trainbridge.toml" not in ignored  # the shards are ignored, as the real repo has them
    assert row["ported"] is True, row
    # what the port leaves is reported at its line: the program's own torch.compile (nvidia-smi is carried to npu-smi)
    compiled = next(n for n, line in enumerate(script.splitlines(), 1) if line == "model = torch.compile(model)")
    assert row["not_ported"] == [f"train_gpt.py:{compiled} compile (blocking): model = torch.compile(model)"], row["not_ported"]
    assert row["ran"] is True, row.get("why")
    assert row["baseline_step_ms"] > 0 and row["npu_kernels_per_step_before"] > 0
    assert row["reference_kernels"].get("forward", 0) > 0 and row["reference_kernels"].get("backward", 0) > 0
    # the fused attention rewrite is numerics-verified on the emulated NPU and cuts the pending head's kernels
    assert row["pending_numerics_ok"] == 1 and row["crashed"] == 0, (row["stop_reason"], row["verdicts"])
    assert "npu_fusion_attention" in row["pending_apis"]
    assert row["npu_kernels_per_step_after"] < row["npu_kernels_per_step_before"]

    json_path, md_path = records.write_results([row], tmp_path / "results" / "today-records", ["--records", "1"], "today")
    saved = json.loads(json_path.read_text(encoding="utf-8"))["records"][0]
    required = {"record", "name", "ported", "not_ported", "ran", "baseline_step_ms", "pending_numerics_ok",
                "pending_apis", "crashed", "npu_kernels_per_step_before", "npu_kernels_per_step_after",
                "reference_kernels", "wall_s", "why"}
    assert required <= set(saved) and saved["record"] == 1
    page = md_path.read_text(encoding="utf-8")
    assert "NPU speed is unmeasured here" in page
    assert f"| 1 | fixture record | 1.50x | yes | {row['npu_kernels_per_step_before']} \u2192" in page
    assert f"train_gpt.py:{compiled} compile (blocking)" in page


def test_a_record_missing_from_the_mirror_says_why(tmp_path):
    records = _benchmark()
    mirror = fake_mirror(tmp_path, FIXTURE.read_text(encoding="utf-8"))
    source = RecordSource(3, "absent", "2099-02-02_Absent", "missing.txt", 1.0, profile="early")
    row = records.run_record(source, mirror, tmp_path / "work", tmp_path / "home", budget_s=60, max_candidates=1,
                             gate_rounds=6, say=lambda line: None)
    assert row["ran"] is False and row["why"].startswith("not in the mirror:") and "2099-02-02_Absent" in row["why"]


def test_build_repo_writes_shards_in_the_records_format(tmp_path):
    source = RecordSource(1, "fixture record", FOLDER, LOG, 1.5, profile="early")
    repo = build_repo(tmp_path / "repo", source, FIXTURE.read_text(encoding="utf-8"))
    shard = repo / "data" / "fineweb10B" / "fineweb_train_000001.bin"
    raw = shard.read_bytes()
    header = np.frombuffer(raw[:1024], dtype=np.int32)
    tokens = np.frombuffer(raw[1024:], dtype=np.uint16)
    assert list(header[:3]) == [20240520, 1, len(tokens)] and tokens.max() < source.vocab()
    assert (repo / "trainbridge.toml").read_text(encoding="utf-8") == toml_text(source)


def test_a_folder_the_record_writes_into_is_kept_in_its_repository(tmp_path):
    """Record 17 opens logs/<run>.txt with its mkdir commented out; logs/ is git-ignored as in the real repository,
    and a run's scratch mirror shows no untracked output folder: the benchmark keeps logs/ tracked (.gitkeep)."""
    assert {r.number: r for r in RECORDS}[17].folders == ("logs",)
    source = RecordSource(17, "fixture record", FOLDER, LOG, 1.5, profile="late", folders=("logs",))
    repo = build_repo(tmp_path / "repo", source, FIXTURE.read_text(encoding="utf-8"))
    assert _git(repo, "ls-files", "logs").split() == ["logs/.gitkeep"]
    assert "!! logs/" not in _git(repo, "status", "--porcelain", "--ignored")
    (repo / "logs" / "run.txt").write_text("a log\n")
    assert "logs/run.txt" in _git(repo, "status", "--porcelain", "--ignored")  # what the record writes stays ignored


def test_a_record_that_ran_short_of_the_bar_says_why():
    from records_page import markdown, short_of_bar

    base = {"record": 4, "name": "n", "published_speedup": 1.3, "ran": True, "pending_apis": ["npu_rotary_mul"],
            "crashed": 1, "reference_kernels": {}, "baseline_step_ms": 1.0, "wall_s": 1.0, "why": None,
            "not_ported": [], "ported": True}
    short = {**base, "pending_numerics_ok": 1, "npu_kernels_per_step_before": 931, "npu_kernels_per_step_after": 863,
             "verdicts": [{"recipe": "attention-sdpa-npu-fusion", "reason": "crashed"},
                          {"recipe": "adam-npu-fused", "reason": "not_applicable"}]}
    why = short_of_bar(short)
    assert "1 numerics-verified rewrite(s), 3 needed (the others: attention-sdpa-npu-fusion crashed)" in why
    assert "kernels per step cut 7%, 30% needed (the pending head keeps 863 of 931)" in why
    met = {**short, "pending_numerics_ok": 3, "npu_kernels_per_step_after": 600}
    assert short_of_bar(met) == "" and short_of_bar({**short, "ran": False}) == ""
    page = markdown([short, {**met, "record": 5}], ["--records", "4,5"], "today")
    assert f"- **4 n**: {why}" in page and "- **5 n**" not in page


def test_record_12_is_run_as_a_user_would_with_its_documents():
    """Record 12 (FlexAttention, outside the published table): its toml holds only the launch line, the data and
    the sizes (no compile(disable), no nvidia-smi stand-in), and its vocabulary stays, so the shards hold
    <|endoftext|> and its document mask sees documents."""
    from records_catalog import BY_NUMBER, UNPUBLISHED

    source = BY_NUMBER[12]
    assert source in UNPUBLISHED and source.published_speedup is None and source.reference
    toml = tomllib.loads(toml_text(source))
    assert not {"compile(disable)", "run(executable)", "num_vocab"} & set(toml["overrides"])
    assert source.vocab() == 50257
