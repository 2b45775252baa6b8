"""The development corpus machinery (benchmarks/corpus/, benchmarks/corpus_recall.py), on synthetic files.

The public files themselves are not in the repository; these tests check the labels' shape, the
log extraction, the scoring arithmetic and the command line on team-written stand-ins.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from trainbridge.benchmarks import corpus_recall
from trainbridge.benchmarks.corpus import materialise
from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, SourceSpan

SEP = "=" * 100


def test_labels_name_pinned_public_files_and_valid_spans():
    files, must, may = corpus_recall.load_labels()
    assert len({f["local"] for f in files}) == len(files)
    categories = {c.value for c in IntentCategory}
    for f in files:
        assert re.fullmatch(r"[0-9a-f]{40}", f["commit"]), f
        assert f["extract"] in ("file", "log_code") and f["repo"].count("/") == 1 and f["path"]
        assert f["local"].endswith(".py")
    assert {r.category for r in must + may} <= categories
    assert len(must) >= 90  # the figures in the results files are over this many regions


UNSEEN = Path(corpus_recall.__file__).resolve().parent / "corpus" / "labels_unseen.yaml"
USED = {"KellerJordan/modded-nanogpt", "Lightning-AI/litgpt", "huggingface/pytorch-image-models", "karpathy/llm.c",
        "karpathy/nanochat", "pytorch/torchtitan", "karpathy/nanoGPT", "karpathy/minGPT"}


def test_unseen_labels_are_30_plus_public_files_from_repositories_not_used_before():
    files, must, may = corpus_recall.load_labels(UNSEEN)
    categories = {c.value for c in IntentCategory}
    assert len(files) >= 30 and len({f["local"] for f in files}) == len(files)
    assert not {f["repo"] for f in files} & USED and len({f["repo"] for f in files}) >= 10
    for f in files:
        assert re.fullmatch(r"[0-9a-f]{40}", f["commit"]) and f["extract"] == "file" and f["local"].endswith(".py"), f
    assert {r.category for r in must + may} <= categories
    assert len(must) >= 75  # the figures in the 2026-12-04-corpus-unseen results are over this many regions
    old_names = {f["local"] for f in corpus_recall.load_labels()[0]}
    assert not old_names & {f["local"] for f in files}  # both corpora can share a folder


def test_extract_log_code_both_layouts_and_a_broken_log():
    early = f"{SEP}\nimport torch\nx = 1\n{SEP}\nstep:0 loss 3.1\n"
    late = f"import torch\nx = 1\n{SEP}\nRunning pytorch\n{SEP}\nstep:0\n"
    assert materialise.extract_log_code(early) == "import torch\nx = 1\n"
    assert materialise.extract_log_code(late) == "import torch\nx = 1\n"
    with pytest.raises(ValueError, match="no line of exactly 100"):
        materialise.extract_log_code("=" * 99 + "\nno code\n")
    with pytest.raises(ValueError, match="never closes"):
        materialise.extract_log_code(f"{SEP}\nimport torch\n")


def _intent(category: str, file: str, start: int, end: int) -> Intent:
    spans = [SourceSpan(file=file, line_start=start, line_end=end)]
    return Intent(id=Intent.make_id(category, spans), category=IntentCategory(category), spans=spans,
                  evidence=Evidence(notes=["n"]), confidence=0.5, source=IntentSource.static)


def test_score_counts_found_missed_and_false_positives_per_category():
    R = corpus_recall.Region
    must = [R("a.py", "rmsnorm", 10, 12), R("a.py", "rmsnorm", 30, 30), R("a.py", "rope", 5, 8)]
    may = [R("a.py", "rmsnorm", 40, 41)]
    intents = [
        _intent("rmsnorm", "a.py", 12, 14),  # overlaps a must: found, not a false positive
        _intent("rmsnorm", "a.py", 41, 41),  # only a may: not found, not a false positive
        _intent("rmsnorm", "b.py", 30, 30),  # right lines, other file: false positive
        _intent("rope", "a.py", 30, 30),  # right lines, other category: false positive
    ]
    scores = corpus_recall.score(intents, must, may)
    assert (scores["rmsnorm"].must, scores["rmsnorm"].found, scores["rmsnorm"].predictions) == (2, 1, 3)
    assert scores["rmsnorm"].false_positives == 1 and scores["rmsnorm"].missed == ["a.py:30"]
    assert (scores["rope"].found, scores["rope"].false_positives) == (0, 1)
    total = scores["overall"]
    assert (total.must, total.found, total.predictions, total.false_positives) == (3, 1, 4, 2)
    assert total.recall == pytest.approx(1 / 3) and total.fp_share == pytest.approx(0.5)
    table = corpus_recall.table(scores)
    assert "| overall" in table and "33%" in table and "50%" in table


def test_goal_ignores_categories_with_few_must_regions_but_not_the_overall_row():
    S = corpus_recall.Score
    small_bad = {"rope": S(must=2, found=0, predictions=1, false_positives=1), "overall": S(must=20, found=19, predictions=20)}
    assert corpus_recall.goal_met(small_bad)
    big_bad = {"rope": S(must=5, found=4, predictions=5), "overall": S(must=20, found=19, predictions=20)}
    assert not corpus_recall.goal_met(big_bad)  # 80% recall in a category with 5 must regions
    noisy = {"overall": S(must=10, found=10, predictions=10, false_positives=2)}
    assert not corpus_recall.goal_met(noisy)


def test_command_line_scores_a_folder_and_refuses_a_missing_file(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "tiny.py").write_text(textwrap.dedent("""\
        import torch.nn.functional as F

        def norm(x):
            return F.rms_norm(x, (x.size(-1),))

        def act(x):
            return F.relu(x).square()
        """))
    labels = tmp_path / "labels.yaml"
    labels.write_text(yaml.safe_dump({"target": "npu", "files": [
        {"local": "tiny.py", "repo": "team/tiny", "path": "tiny.py", "commit": "0" * 40, "extract": "file",
         "must": {"rmsnorm": ["3-4"], "elementwise_chain": ["7"]}},
    ]}))
    out = tmp_path / "scores.json"
    assert corpus_recall.main([str(corpus), "--labels", str(labels), "--json", str(out)]) == 0
    scores = json.loads(out.read_text())["scores"]
    assert scores["overall"]["found"] == 2 and scores["overall"]["false_positives"] == 0
    # the same folder scored for the CPU: neither is a gain there
    assert corpus_recall.main([str(corpus), "--labels", str(labels), "--target", "cpu", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["scores"]["overall"]["found"] == 0
    # a higher recall bar is reported as not met when a region is missed
    data = yaml.safe_load(labels.read_text())
    data["files"][0]["must"]["gelu"] = ["1"]  # line 1 holds no GELU: one missed region in three
    labels.write_text(yaml.safe_dump(data))
    assert corpus_recall.main([str(corpus), "--labels", str(labels), "--goal-recall", "0.95", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    assert payload["goal_recall"] == 0.95 and payload["goal_met"] is False and payload["detector_failures"] == []
    assert "goal (recall >= 95%" in capsys.readouterr().out
    (corpus / "tiny.py").unlink()
    assert corpus_recall.main([str(corpus), "--labels", str(labels)]) == 2
    assert "missing from" in capsys.readouterr().err


def test_materialise_reads_pinned_commits_from_a_git_mirror(tmp_path):
    import subprocess

    repo = tmp_path / "mirrors" / "team+tiny"
    repo.mkdir(parents=True)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "log.txt").write_text(f"{SEP}\nprint('hi')\n{SEP}\nstep 0\n")
    subprocess.run([*git, "add", "log.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    commit = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    labels = tmp_path / "labels.yaml"
    labels.write_text(yaml.safe_dump({"files": [
        {"local": "rec.py", "repo": "team/tiny", "path": "log.txt", "commit": commit, "extract": "log_code"},
        {"local": "gone.py", "repo": "team/absent", "path": "x.py", "commit": commit, "extract": "file"},
    ]}))
    problems = materialise.materialise(tmp_path / "mirrors", tmp_path / "out", labels)
    assert (tmp_path / "out" / "rec.py").read_text() == "print('hi')\n"
    assert problems == [f"gone.py: no mirror of team/absent under {tmp_path / 'mirrors'}"]
