"""The knowledge base: recipe schema, offline embeddings, Chroma store, ranking, JSONL exchange, CLI.

Everything runs against real Chroma: embedded persistent directories under tmp_path, and one test
against a real `chroma run` server on a loopback port.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from trainbridge.agents.retrieval.rank import rank_recipes
from trainbridge.knowledge.cli import kb_app
from trainbridge.knowledge.embeddings import HashedCodeEmbedding, embed_text
from trainbridge.knowledge.jsonl import KBFileError
from trainbridge.knowledge.schema import (
    Outcome,
    Recipe,
    RecipeFileError,
    load_recipe_dir,
    load_recipe_file,
    parse_recipe,
)
from trainbridge.knowledge.store import SEED_DIR, KnowledgeBase, KnowledgeBaseError, default_kb_dir
from trainbridge.records import Evidence, Intent, IntentSource, SourceSpan

PYTHON = sys.executable
CHROMA = Path(sys.executable).parent / "chroma"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

RMSNORM_EVIDENCE = Evidence(
    reference_kernels=1,
    target_ops=6,
    kernels=["cpp_fused_add_mean_mul_pow_rsqrt_0"],
    target_op_names=["aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul", "aten::mul"],
)
GELU_EVIDENCE = Evidence(
    reference_kernels=1,
    target_ops=7,
    kernels=["cpp_fused_add_mul_pow_tanh_1"],
    target_op_names=["aten::mul", "aten::pow", "aten::mul", "aten::add", "aten::mul", "aten::tanh", "aten::add"],
)
ADAMW_EVIDENCE = Evidence(
    target_ops=120,
    target_op_names=["aten::mul_", "aten::add_", "aten::lerp_", "aten::addcmul_", "aten::sqrt", "aten::div", "aten::addcdiv_"],
    notes=["Optimizer.step#AdamW.step"],
)


def intent(category: str, evidence: Evidence, line: int = 10) -> Intent:
    spans = [SourceSpan(file="model.py", line_start=line, line_end=line + 2)]
    return Intent(
        id=Intent.make_id(category, spans),
        category=category,
        spans=spans,
        evidence=evidence,
        confidence=0.9,
        source=IntentSource.runtime,
    )


def outcome(recipe_id: str | None, verdict: str, *, category="rmsnorm", evidence=RMSNORM_EVIDENCE, backend="npu",
            ratio=None, minutes=0, run="run-1") -> Outcome:
    return Outcome(
        run_id=run,
        intent_id=f"{category}-{minutes}",
        category=category,
        evidence=evidence,
        recipe_id=recipe_id,
        diff=f"--- a/model.py\n+++ b/model.py\n@@ -1 +1 @@\n-old {minutes}\n+new\n",
        verdict=verdict,
        ratio=ratio,
        ratio_ci=(ratio * 0.98, ratio * 1.02) if ratio else None,
        backend=backend,
        versions={"torch": "2.13.0"},
        timestamp=T0 + timedelta(minutes=minutes),
    )


def seed_recipe(recipe_id: str) -> dict:
    return yaml.safe_load((SEED_DIR / f"{recipe_id}.yaml").read_text())


# The seeds these tests reason about; other seed recipes may ship beside them, so the tests that
# depend on the exact recipe set use a folder holding only these.
OWN_SEEDS = ["adamw-foreach-to-fused", "adamw-npu-fused", "gelu-tanh-functional", "rmsnorm-f-rms-norm",
             "rmsnorm-npu-rms-norm"]


@pytest.fixture
def seeds(tmp_path):
    folder = tmp_path / "seeds"
    folder.mkdir()
    for rid in OWN_SEEDS:
        (folder / f"{rid}.yaml").write_text((SEED_DIR / f"{rid}.yaml").read_text())
    return folder


@pytest.fixture
def kb(tmp_path, seeds):
    with KnowledgeBase(tmp_path / "kb", seed_dir=seeds) as base:
        yield base


# --------------------------------------------------------------------------------------------
# schema


def test_seed_recipes_are_valid_and_cover_cpu_and_npu():
    recipes = load_recipe_dir(SEED_DIR)
    ids = [r.id for r in recipes]
    assert len(ids) == len(set(ids)) == len(list(SEED_DIR.glob("*.yaml"))) >= 4
    npu = [r for r in recipes if r.targets == ["npu"]]
    assert any("import torch_npu" in r.imports for r in npu)
    assert all(r.provenance.kind == "seed" and r.stats.tried == 0 for r in recipes)
    rms = next(r for r in recipes if r.id == "rmsnorm-npu-rms-norm")
    assert rms.match.kind == "semantic" and "npu_rms_norm" in rms.replacement
    assert rms.numerics.class_ == "tolerance" and rms.numerics.rtol == 1e-3


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["numerics"].update(rtol="abc"), "rmsnorm.yaml: numerics.rtol: Input should be a valid number"),
        (lambda d: d.update(stat={}), "rmsnorm.yaml: stat: Extra inputs are not permitted"),
        (lambda d: d.update(targets=["tpu"]), "rmsnorm.yaml: targets.0: Input should be 'cpu', 'cuda' or 'npu'"),
        (lambda d: d.update(category="rms"), "rmsnorm.yaml: category: Input should be"),
        (lambda d: d.update(id="Bad Id"), "rmsnorm.yaml: id: String should match pattern"),
        (lambda d: d["numerics"].pop("atol"), "rmsnorm.yaml: numerics: class 'tolerance' needs rtol and atol"),
        (lambda d: d.update(numerics={"class": "exact", "rtol": 1e-3}), "numerics: class 'exact' takes no rtol"),
        (lambda d: d.update(replacement="torch_npu.npu_rms_norm($x, $gamma)[0]"),
         "rmsnorm.yaml: replacement uses placeholders the match does not bind: ['gamma']"),
        (lambda d: d.update(match={"kind": "regex", "params": {}}), "match: unknown match kind 'regex'"),
        (lambda d: d.update(match={"kind": "op_sequence", "params": {"regex": "pow-(mean"}}),
         "match: params.regex does not compile"),
        (lambda d: d.update(imports=["torch_npu"]), "imports: not an import line: 'torch_npu'"),
        (lambda d: d["preconditions"].append({"kind": "dtype", "subject": "x", "op": "in", "value": "bf16"}),
         "preconditions.4: op 'in' needs a list value"),
        (lambda d: d.update(stats={"tried": 1, "accepted": 1, "rejected": 1}),
         "stats: accepted + rejected cannot exceed tried"),
    ],
)
def test_malformed_recipes_are_rejected_naming_file_and_field(tmp_path, edit, message):
    data = seed_recipe("rmsnorm-npu-rms-norm")
    edit(data)
    path = tmp_path / "rmsnorm.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeFileError) as exc:
        load_recipe_file(path)
    assert message in str(exc.value)


def test_unreadable_and_non_mapping_recipe_files(tmp_path):
    (tmp_path / "broken.yaml").write_text("id: [unclosed\n")
    with pytest.raises(RecipeFileError, match=r"^broken.yaml: not valid YAML"):
        load_recipe_file(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(RecipeFileError, match="list.yaml: a recipe must be a mapping of fields, got list"):
        load_recipe_file(tmp_path / "list.yaml")
    with pytest.raises(RecipeFileError, match="missing.yaml: cannot read recipe file"):
        load_recipe_file(tmp_path / "missing.yaml")
    data = seed_recipe("gelu-tanh-functional")
    (tmp_path / "a.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeFileError, match="b.yaml: id: 'gelu-tanh-functional' is already used by a.yaml"):
        load_recipe_dir(tmp_path)


def test_recipe_round_trips_through_json_with_the_class_alias():
    recipe = parse_recipe(seed_recipe("adamw-foreach-to-fused"))
    dumped = json.loads(recipe.model_dump_json())
    assert dumped["numerics"]["class"] == "tolerance" and "class_" not in dumped["numerics"]
    assert Recipe.model_validate_json(recipe.model_dump_json()) == recipe
    assert recipe.match.bound_names() == {"args", "func"}


def test_outcome_ids_are_stable_and_content_derived():
    a, b = outcome("r", "accepted", ratio=0.9), outcome("r", "accepted", ratio=0.9)
    assert a.id == b.id and a.id.startswith("outcome-")
    assert outcome("r", "accepted", ratio=0.8).id != a.id
    assert Outcome.model_validate_json(a.model_dump_json()) == a
    assert a.accepted and not outcome("r", "numerics mismatch").accepted
    with pytest.raises(ValueError, match="ratio_ci must be"):
        Outcome(run_id="r", intent_id="i", category="gelu", verdict="accepted", backend="cpu", ratio_ci=(2.0, 1.0))


# --------------------------------------------------------------------------------------------
# embeddings


TEXTS = [
    "x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)",
    "cpp_fused_add_mean_mul_pow_rsqrt_0 aten::pow aten::mean",
    "",
    "torch.optim.AdamW(model.parameters(), lr=3e-4, foreach=False)",
]


def test_embeddings_are_identical_across_processes_with_different_hash_seeds():
    script = textwrap.dedent(
        f"""
        import json, sys
        from trainbridge.knowledge.embeddings import embed_text
        print(json.dumps([embed_text(t).tolist() for t in {TEXTS!r}]))
        """
    )
    runs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        done = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=True)
        runs.append(json.loads(done.stdout))
    here = [embed_text(t).tolist() for t in TEXTS]
    assert runs[0] == runs[1] == here


def test_embeddings_are_unit_vectors_that_match_code_to_kernel_names():
    vecs = {t: embed_text(t) for t in TEXTS}
    for vec in vecs.values():
        assert vec.shape == (256,) and abs(float(np.linalg.norm(vec)) - 1.0) < 1e-5
    kernel = embed_text("cpp_fused_add_mean_mul_pow_rsqrt_0")
    rms_code, adamw_code = embed_text(TEXTS[0]), embed_text(TEXTS[3])
    assert float(kernel @ rms_code) > float(kernel @ adamw_code) + 0.2
    # x ** 2, x.pow(2), aten::pow and x.square() name the same op
    assert float(embed_text("x ** 2") @ embed_text("aten::pow")) > 0.99
    assert float(embed_text("x.square()") @ embed_text("x.pow(2)")) > 0.99


def test_embedding_function_implements_chroma_protocol():
    ef = HashedCodeEmbedding(dims=64)
    assert HashedCodeEmbedding.name() == "trainbridge-hashed-code" and not ef.is_legacy()
    rebuilt = HashedCodeEmbedding.build_from_config(ef.get_config())
    assert rebuilt == ef and rebuilt.dims == 64
    assert np.allclose(ef(["a b c"])[0], ef.embed_query(["a b c"])[0])
    assert len(ef(["x.pow(2)", "gelu"])) == 2 and ef(["x"])[0].shape == (64,)
    with pytest.raises(ValueError, match="feature version 99"):
        HashedCodeEmbedding.build_from_config({"dims": 64, "feature_version": 99})
    with pytest.raises(ValueError, match="dims must be an integer >= 16"):
        HashedCodeEmbedding(dims=4)
    assert ef.default_space() == "cosine"


# --------------------------------------------------------------------------------------------
# store


def test_default_dir_reads_the_environment_when_called_not_at_import(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINBRIDGE_KB_DIR", raising=False)
    monkeypatch.delenv("TRAINBRIDGE_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert default_kb_dir() == tmp_path / "xdg" / "trainbridge" / "kb"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_kb_dir() == Path.home() / ".local" / "share" / "trainbridge" / "kb"
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))  # the knowledge base lives beside the runs
    assert default_kb_dir() == tmp_path / "home" / "kb"
    monkeypatch.setenv("TRAINBRIDGE_KB_DIR", str(tmp_path / "team"))
    assert default_kb_dir() == tmp_path / "team"
    with KnowledgeBase() as base:
        assert base.location == str((tmp_path / "team").resolve())
        assert len(base.list_recipes()) == len(load_recipe_dir(SEED_DIR))


def test_seeds_load_once_and_changed_seeds_update_but_keep_stats(tmp_path, seeds):
    with KnowledgeBase(tmp_path / "kb", seed_dir=seeds) as base:
        assert len(base.list_recipes()) == len(list(seeds.glob("*.yaml")))
        base.record_outcome(outcome("gelu-tanh-functional", "accepted", category="gelu", evidence=GELU_EVIDENCE, ratio=0.9))
        assert base.load_seeds(seeds) == 0  # nothing new, nothing changed
    data = seed_recipe("gelu-tanh-functional")
    data["pitfalls"].append("a new pitfall shipped with a newer version")
    (seeds / "gelu-tanh-functional.yaml").write_text(yaml.safe_dump(data))
    with KnowledgeBase(tmp_path / "kb", seed_dir=seeds) as base:
        recipes = base.list_recipes()
        assert len(recipes) == len(list(seeds.glob("*.yaml")))
        gelu = base.get_recipe("gelu-tanh-functional")
        assert gelu.pitfalls[-1] == "a new pitfall shipped with a newer version"
        assert (gelu.stats.tried, gelu.stats.accepted, gelu.stats.best_ratio) == (1, 1, 0.9)


REOPEN = textwrap.dedent(
    """
    import sys, warnings
    warnings.simplefilter("error")
    from trainbridge.knowledge.store import KnowledgeBase
    from trainbridge.knowledge.schema import Outcome
    if sys.argv[2] == "write":
        o = Outcome.model_validate_json(sys.argv[3])
        for _ in range(2):  # the second client finds the outcome already stored
            with KnowledgeBase(sys.argv[1]) as kb:
                print(kb.record_outcome(o))
    else:
        with KnowledgeBase(sys.argv[1]) as kb:
            print(kb.get_recipe("rmsnorm-npu-rms-norm").stats.model_dump_json())
            print(len(kb.outcomes_for(recipe_id="rmsnorm-npu-rms-norm")))
    """
)


def test_persistence_across_processes_reopens_without_warnings(tmp_path):
    path = str(tmp_path / "kb")
    rec = outcome("rmsnorm-npu-rms-norm", "accepted", ratio=0.8)

    def run(*args):
        done = subprocess.run([PYTHON, "-W", "error", "-c", REOPEN, path, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert "Warning" not in done.stderr, done.stderr
        return done.stdout.split()

    assert run("write", rec.model_dump_json()) == ["True", "False"]  # not counted twice
    stats, count = run("read")  # (the default seed folder: every shipped recipe)
    assert json.loads(stats) == {"tried": 1, "accepted": 1, "rejected": 0, "best_ratio": 0.8}
    assert count == "1"


def test_recipes_crud_and_filters(kb):
    assert kb.get_recipe("no-such-recipe") is None
    assert {r.id for r in kb.list_recipes(category="rmsnorm")} == {"rmsnorm-f-rms-norm", "rmsnorm-npu-rms-norm"}
    assert {r.id for r in kb.list_recipes(target="npu")} == {"rmsnorm-npu-rms-norm", "adamw-npu-fused", "gelu-tanh-functional"}
    assert [r.id for r in kb.list_recipes(category="rmsnorm", target="cpu")] == ["rmsnorm-f-rms-norm"]
    with pytest.raises(KnowledgeBaseError, match="already exists; use upsert"):
        kb.add_recipe(kb.get_recipe("gelu-tanh-functional"))
    learned = parse_recipe({**seed_recipe("gelu-tanh-functional"), "id": "gelu-learned", "provenance": {"kind": "learned"}})
    kb.add_recipe(learned)
    assert kb.get_recipe("gelu-learned") == learned
    kb.record_outcome(outcome("gelu-learned", "accepted", category="gelu", evidence=GELU_EVIDENCE, ratio=0.7))
    changed = learned.model_copy(update={"title": "renamed"})
    assert kb.upsert_recipe(changed) is False
    stored = kb.get_recipe("gelu-learned")
    assert stored.title == "renamed" and stored.stats.tried == 1  # stats are measured, not authored


def test_record_outcome_updates_stats_and_outcomes_are_queryable(kb):
    rid = "rmsnorm-npu-rms-norm"
    records = [
        outcome(rid, "accepted", ratio=0.85, minutes=1),
        outcome(rid, "numerics mismatch: grad cosine 0.97", minutes=2),
        outcome(rid, "accepted", ratio=0.80, minutes=3),
        outcome(rid, "accepted", ratio=0.95, minutes=4),
        outcome(None, "no speedup", minutes=5),  # an LLM patch without a recipe
        outcome("gelu-tanh-functional", "accepted", category="gelu", evidence=GELU_EVIDENCE, ratio=0.9, minutes=6),
    ]
    assert kb.record_outcomes(records + records[:2]) == 6
    assert kb.get_recipe(rid).stats.model_dump() == {"tried": 4, "accepted": 3, "rejected": 1, "best_ratio": 0.8}
    assert [o.id for o in kb.outcomes_for(recipe_id=rid)] == [o.id for o in records[:4]]
    assert len(kb.outcomes_for(category="rmsnorm")) == 5
    assert kb.outcomes_for(category="rmsnorm", limit=1) == [records[4]]
    assert kb.outcomes_for(backend="cpu") == []
    s = kb.stats()
    assert (s.outcomes, s.accepted, s.rejected, s.pending) == (6, 4, 2, 0)
    assert s.recipes_by_category["rmsnorm"] == 2 and s.recipes_by_target["npu"] == 3
    # an NPU candidate whose numerics passed on the emulation is tried, but neither accepted nor rejected
    pending = outcome(rid, "speed_unmeasured_numerics_ok: numerics match. Speed unmeasured", minutes=7)
    assert pending.pending and not pending.accepted
    kb.record_outcome(pending)
    assert kb.get_recipe(rid).stats.model_dump() == {"tried": 5, "accepted": 3, "rejected": 1, "best_ratio": 0.8}
    s = kb.stats()
    assert (s.outcomes, s.accepted, s.rejected, s.pending) == (7, 4, 2, 1)


def test_search_finds_recipes_from_code_and_kernel_names(kb):
    assert kb.search("x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)", n=1)[0].recipe.category == "rmsnorm"
    assert kb.search("cpp_fused_add_mul_pow_tanh_0", n=1)[0].recipe.id == "gelu-tanh-functional"
    assert kb.search("torch.optim.AdamW(params, foreach=False)", n=2, target="cpu")[0].recipe.id == "adamw-foreach-to-fused"
    hits = kb.search("anything", n=100)
    assert len(hits) == len(kb.list_recipes()) and hits == sorted(hits, key=lambda h: -h.similarity)


def test_ranking_prefers_category_and_backend(kb):
    rms = intent("rmsnorm", RMSNORM_EVIDENCE)
    npu = rank_recipes(kb, rms, "npu")
    assert npu[0].recipe.id == "rmsnorm-npu-rms-norm"
    assert all("npu" in r.recipe.targets for r in npu)  # strict: only recipes written for npu
    assert npu[0].parts.category == 1.0 and npu[0].parts.target == 1.0
    assert "category rmsnorm = intent" in npu[0].explanation and "no similar outcomes yet" in npu[0].explanation
    assert rank_recipes(kb, rms, "cpu")[0].recipe.id == "rmsnorm-f-rms-norm"
    loose = rank_recipes(kb, rms, "npu", n=10, strict_target=False)
    assert [r.recipe.id for r in loose[:2]] == ["rmsnorm-npu-rms-norm", "rmsnorm-f-rms-norm"]
    assert "not written for npu" in loose[1].explanation and loose[1].parts.target == 0.0
    assert rank_recipes(kb, intent("gelu", GELU_EVIDENCE), "npu")[0].recipe.id == "gelu-tanh-functional"
    assert rank_recipes(kb, intent("optimizer_step", ADAMW_EVIDENCE), "npu")[0].recipe.id == "adamw-npu-fused"
    assert [r.score for r in loose] == sorted((r.score for r in loose), reverse=True)
    assert all(abs(r.score - r.parts.total()) < 1e-9 for r in loose)


def test_ranking_learns_from_outcomes_on_similar_evidence(kb):
    alt = parse_recipe({
        **seed_recipe("rmsnorm-npu-rms-norm"),
        "id": "rmsnorm-npu-add-rms-norm-split",
        "title": "RMSNorm via npu_add_rms_norm with a zero residual",
        "provenance": {"kind": "learned", "notes": "test"},
    })
    kb.add_recipe(alt)
    rms = intent("rmsnorm", RMSNORM_EVIDENCE)
    before = [r.recipe.id for r in rank_recipes(kb, rms, "npu", n=2)]
    # rejections of the front-runner on *dissimilar* evidence (an optimizer region) change nothing
    kb.record_outcomes([
        outcome(before[0], "numerics mismatch", category="optimizer_step", evidence=ADAMW_EVIDENCE, minutes=i)
        for i in range(5)
    ])
    assert [r.recipe.id for r in rank_recipes(kb, rms, "npu", n=2)] == before
    # ... and on cpu runs neither
    kb.record_outcomes([outcome(before[0], "slower", backend="cpu", minutes=10 + i) for i in range(5)])
    assert [r.recipe.id for r in rank_recipes(kb, rms, "npu", n=2)] == before
    # pending NPU verdicts (numerics verified on the emulation, speed unmeasured) are no evidence either way
    kb.record_outcomes([outcome(before[0], "speed_unmeasured_numerics_ok: numerics match", minutes=40 + i) for i in range(4)])
    unjudged = rank_recipes(kb, rms, "npu", n=2)
    assert [r.recipe.id for r in unjudged] == before and unjudged[0].parts.similar_outcomes == 0.0
    # rejections on the same kind of region on npu, and acceptances of the other, flip the order
    kb.record_outcomes([outcome(before[0], "slower: ratio 1.04", minutes=20 + i, ratio=1.04) for i in range(3)])
    kb.record_outcomes([outcome(before[1], "accepted", minutes=30 + i, ratio=0.82) for i in range(2)])
    after = rank_recipes(kb, rms, "npu", n=2)
    assert [r.recipe.id for r in after] == before[::-1]
    assert after[0].parts.similar_outcomes == pytest.approx(2.0, abs=0.01)
    assert after[0].parts.accept_rate == pytest.approx(3 / 4, abs=0.01)
    assert after[0].parts.gain == pytest.approx(0.18, abs=0.01)
    assert after[1].parts.accept_rate == pytest.approx(1 / 5, abs=0.01)
    assert "accept rate 0.75 over 2.0 similar outcomes" in after[0].explanation


def test_export_import_round_trips_exactly_and_is_idempotent(tmp_path):
    learned = parse_recipe({**seed_recipe("gelu-tanh-functional"), "id": "gelu-site-a", "provenance": {"kind": "learned"}})
    with KnowledgeBase(tmp_path / "a") as a:
        a.add_recipe(learned)
        a.record_outcomes([
            outcome("rmsnorm-npu-rms-norm", "accepted", ratio=0.8, minutes=1),
            outcome("rmsnorm-npu-rms-norm", "slower", minutes=2),
            outcome("gelu-site-a", "accepted", category="gelu", evidence=GELU_EVIDENCE, ratio=0.93, minutes=3),
            outcome(None, "llm patch touched the harness", minutes=4),
        ])
        a.export_jsonl(tmp_path / "a.jsonl")
        recipes_a, outcomes_a = a.list_recipes(), a.all_outcomes()
    with KnowledgeBase(tmp_path / "b") as b:
        b._batch = 2  # exercise the batching that keeps every add under Chroma's max batch size
        report = b.import_jsonl(tmp_path / "a.jsonl")
        assert report.outcomes_added == 4 and report.recipes_added == 1  # the seeds were already there
        assert b.list_recipes() == recipes_a and b.all_outcomes() == outcomes_a
        b.export_jsonl(tmp_path / "b.jsonl")
        again = b.import_jsonl(tmp_path / "a.jsonl")
        assert (again.recipes_added, again.outcomes_added) == (0, 0)
        assert again.outcomes_skipped == 4
        assert b.list_recipes() == recipes_a and len(b.all_outcomes()) == 4
    assert (tmp_path / "a.jsonl").read_text() == (tmp_path / "b.jsonl").read_text()
    with KnowledgeBase(tmp_path / "c", seed_dir=None) as c:  # a really empty knowledge base
        assert c.list_recipes() == [] and c.search("x.pow(2)") == []
        assert rank_recipes(c, intent("rmsnorm", RMSNORM_EVIDENCE), "npu") == []
        c.import_jsonl(tmp_path / "a.jsonl")
        assert c.list_recipes() == recipes_a and c.all_outcomes() == outcomes_a


def test_import_rejects_a_bad_line_and_imports_nothing(kb, tmp_path):
    good = '{"type":"outcome","record":' + outcome("gelu-tanh-functional", "accepted", ratio=0.9).model_dump_json() + "}"
    bad = json.dumps({"type": "outcome", "record": {"run_id": "r"}})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + bad + "\n")
    with pytest.raises(KBFileError, match=r"bad.jsonl:2: outcome\.intent_id: Field required"):
        kb.import_jsonl(path)
    assert kb.all_outcomes() == []
    path.write_text('{"type": "header", "format": "other", "version": 1}\n')
    with pytest.raises(KBFileError, match="bad.jsonl:1: expected format 'trainbridge-kb'"):
        kb.import_jsonl(path)


# --------------------------------------------------------------------------------------------
# CLI


def invoke(*args: str):
    return CliRunner().invoke(kb_app, list(args), env={"COLUMNS": "200"})


def test_cli_commands(tmp_path):
    kbdir = str(tmp_path / "kb")
    listed = invoke("list", "--kb-dir", kbdir, "--target", "npu")
    assert listed.exit_code == 0, listed.output
    assert "rmsnorm-npu-rms-norm" in listed.output and "rmsnorm-f-rms-norm" not in listed.output

    shown = invoke("show", "rmsnorm-npu-rms-norm", "--kb-dir", kbdir)
    assert shown.exit_code == 0 and "npu_rms_norm" in shown.output and "pitfall: Returns (y, rstd)" in shown.output
    as_json = invoke("show", "gelu-tanh-functional", "--json", "--kb-dir", kbdir)
    assert Recipe.model_validate_json(as_json.output).id == "gelu-tanh-functional"
    missing = invoke("show", "nope", "--kb-dir", kbdir)
    assert missing.exit_code == 1 and "no recipe 'nope'" in missing.output

    found = invoke("search", "cpp_fused_add_mul_pow_tanh_0", "-n", "3", "--kb-dir", kbdir)
    assert found.exit_code == 0 and "gelu-tanh-functional" in found.output

    data = seed_recipe("gelu-tanh-functional")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({**data, "id": "gelu-mine", "provenance": {"kind": "learned"}}))
    added = invoke("add", str(tmp_path / "mine.yaml"), "--kb-dir", kbdir)
    assert added.exit_code == 0 and "added gelu-mine" in added.output
    assert "updated gelu-mine" in invoke("add", str(tmp_path / "mine.yaml"), "--kb-dir", kbdir).output
    data["numerics"]["rtol"] = "loose"
    (tmp_path / "rmsnorm.yaml").write_text(yaml.safe_dump(data))
    rejected = invoke("add", str(tmp_path / "rmsnorm.yaml"), "--kb-dir", kbdir)
    assert rejected.exit_code == 2 and "rmsnorm.yaml: numerics.rtol: Input should be a valid number" in rejected.output

    exported = invoke("export", str(tmp_path / "kb.jsonl"), "--kb-dir", kbdir)
    n_seeds = len(list(SEED_DIR.glob("*.yaml")))
    assert exported.exit_code == 0 and f"exported {n_seeds + 1} recipe(s)" in exported.output
    imported = invoke("import", str(tmp_path / "kb.jsonl"), "--kb-dir", str(tmp_path / "other"))
    assert imported.exit_code == 0 and "imported 1 recipe(s) and 0 outcome(s)" in imported.output

    stats = invoke("stats", "--json", "--kb-dir", str(tmp_path / "other"))
    assert json.loads(stats.output)["recipes"] == n_seeds + 1
    table = invoke("stats", "--kb-dir", kbdir)
    assert table.exit_code == 0 and "category rmsnorm" in table.output

    both = invoke("list", "--kb-dir", kbdir, "--kb-url", "http://127.0.0.1:1")
    assert both.exit_code == 2 and "not both" in both.output
    bad_target = invoke("list", "--kb-dir", kbdir, "--target", "tpu")
    assert bad_target.exit_code == 2
    helped = invoke("--help")
    assert helped.exit_code == 0 and all(c in helped.output for c in ("list", "show", "search", "add", "import", "export", "stats"))


def test_cli_bad_import_file_and_url_from_environment(tmp_path, monkeypatch):
    kbdir = str(tmp_path / "kb")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    bad = invoke("import", str(tmp_path / "bad.jsonl"), "--kb-dir", kbdir)
    assert bad.exit_code == 2 and "bad.jsonl:1: not JSON" in bad.output
    dead = f"http://127.0.0.1:{_free_port()}"
    monkeypatch.setenv("TRAINBRIDGE_KB_URL", dead)
    assert invoke("stats", "--kb-dir", kbdir).exit_code == 0  # an explicit --kb-dir wins
    from_env = invoke("stats")
    assert from_env.exit_code == 1 and f"cannot reach the Chroma server at {dead}" in from_env.output


# --------------------------------------------------------------------------------------------
# a real Chroma server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def chroma_server(tmp_path):
    port = _free_port()
    log = (tmp_path / "chroma.log").open("wb")
    proc = subprocess.Popen(
        [str(CHROMA), "run", "--path", str(tmp_path / "server"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chroma server did not start: {(tmp_path / 'chroma.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_knowledge_base_on_a_real_chroma_server(chroma_server, tmp_path, seeds):
    with KnowledgeBase.connect(chroma_server, seed_dir=seeds) as kb:
        assert kb.location == chroma_server
        assert len(kb.list_recipes()) == len(OWN_SEEDS)
        kb.record_outcome(outcome("rmsnorm-npu-rms-norm", "accepted", ratio=0.75))
        assert rank_recipes(kb, intent("rmsnorm", RMSNORM_EVIDENCE), "npu")[0].recipe.id == "rmsnorm-npu-rms-norm"
        kb.export_jsonl(tmp_path / "server.jsonl")
    with KnowledgeBase.connect(chroma_server) as again:  # a second client sees the same data
        assert again.get_recipe("rmsnorm-npu-rms-norm").stats.best_ratio == 0.75
        assert again.import_jsonl(tmp_path / "server.jsonl").outcomes_added == 0
    listed = invoke("list", "--kb-url", chroma_server, "--category", "rmsnorm")
    assert listed.exit_code == 0 and "1/1/0" in listed.output


def test_connect_to_a_dead_server_says_what_to_do():
    with pytest.raises(KnowledgeBaseError, match=r"cannot reach the Chroma server at .*chroma run --path DIR"):
        KnowledgeBase.connect(f"http://127.0.0.1:{_free_port()}")
    with pytest.raises(KnowledgeBaseError, match="must look like http://host:port"):
        KnowledgeBase.connect("ftp://host:1")
    failed = invoke("stats", "--kb-url", f"http://127.0.0.1:{_free_port()}")
    assert failed.exit_code == 1 and "cannot reach the Chroma server" in failed.output

