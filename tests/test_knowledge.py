"""The knowledge base's store: seeds, recipes and outcomes in Chroma, search and ranking, JSONL exchange.

Everything runs against real Chroma: embedded persistent directories under tmp_path.
Shared records and fixtures: tests/knowledge_support.py.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from trainbridge.agents.retrieval.rank import rank_recipes
from trainbridge.knowledge.jsonl import KBFileError
from trainbridge.knowledge.schema import load_recipe_dir, parse_recipe
from trainbridge.knowledge.store import SEED_DIR, KnowledgeBase, KnowledgeBaseError, default_kb_dir
from trainbridge.tests.knowledge_support import (  # noqa: F401 (fixtures)
    ADAMW_EVIDENCE,
    GELU_EVIDENCE,
    PYTHON,
    RMSNORM_EVIDENCE,
    intent,
    kb,
    outcome,
    seed_recipe,
    seeds,
)


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
    # batches of 2 exercise the batching that keeps every add under Chroma's max batch size
    with KnowledgeBase(tmp_path / "b", batch_size=2) as b:
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


def test_intent_coverage_names_the_intents_left_that_have_a_recipe(kb):
    from trainbridge.agents.retrieval.choose import intent_coverage

    rms, gelu = intent("rmsnorm", RMSNORM_EVIDENCE, line=10), intent("gelu", GELU_EVIDENCE, line=40)
    orphan = intent("permute_reshape", GELU_EVIDENCE, line=70)  # a category no recipe is written for
    intents = [i.model_dump(mode="json") for i in (rms, gelu, orphan)]
    left = intent_coverage(intents, done={rms.id}, kb=kb, target="cpu", allowed=None)
    assert (left.reached, left.left_without) == (1, 1) and left.left_with_recipe == ["gelu at model.py:40-42"]
    assert not left.every_intent_with_a_recipe and "1 with a recipe not reached (gelu at model.py:40-42)" in left.line()
    done = intent_coverage(intents, done={rms.id, gelu.id}, kb=kb, target="cpu", allowed=None)
    assert done.every_intent_with_a_recipe and done.as_record()["every_intent_with_a_recipe"] is True
    assert "reached every intent with a recipe (2 worked; 1 found without one)" in done.line()
    assert intent_coverage(intents, done={rms.id}, kb=kb, target="cpu", allowed=["rmsnorm-f-rms-norm"]).every_intent_with_a_recipe


def test_a_recipe_that_needs_torchair_is_not_tried_on_a_host_without_it(tmp_path, monkeypatch):
    """Issue 25, item 2: the TorchAir recipes (`requires: [torchair]`) crashed every gate on the emulation (4 of a
    ported speedrun's 13 candidates); retrieval leaves them out there and offers them where TorchAir is."""
    from trainbridge.agents.retrieval import choose

    needing = sorted(r.id for r in load_recipe_dir(SEED_DIR) if r.requires)
    assert needing == ["compile-regional-npu", "optimizer-loop-compile-npu"]
    with KnowledgeBase(tmp_path / "kb", seed_dir=SEED_DIR) as base:
        step = intent("optimizer_step", ADAMW_EVIDENCE)
        monkeypatch.setattr(choose, "host_capabilities", lambda target: frozenset())  # the emulation's answer
        here = choose.own_recipes(base, step, "npu", None)
        monkeypatch.setattr(choose, "host_capabilities", lambda target: frozenset({"torchair"}))
        there = choose.own_recipes(base, step, "npu", None)
    assert "optimizer-loop-compile-npu" not in here and "adamw-npu-fused" in here
    assert set(there) - set(here) == {"optimizer-loop-compile-npu"}


def test_the_emulated_npu_has_no_torchair():
    from trainbridge.sandbox.backends import host_capabilities, npu_emulated

    assert host_capabilities("cpu") == frozenset()
    if npu_emulated():
        assert host_capabilities("npu") == frozenset()


def test_precision_change_is_a_tolerance_recipes_sentence_and_the_npu_norms_carry_it():
    from trainbridge.knowledge.schema import Numerics

    with pytest.raises(ValueError, match="precision_change"):
        Numerics.model_validate({"class": "exact", "precision_change": "rounds once where the original rounds per op"})
    flagged = Numerics.model_validate({"class": "tolerance", "rtol": 1e-2, "atol": 1e-5,
                                       "precision_change": "rounds once where the original rounds per op"})
    assert flagged.precision_change.startswith("rounds once")
    recipes = {r.id: r for r in load_recipe_dir(SEED_DIR)}
    assert recipes["rmsnorm-library-npu"].numerics.precision_change  # fp32 compute, one rounding: flagged for review
    assert recipes["sgd-npu-fused"].numerics.precision_change is None
