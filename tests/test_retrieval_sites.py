"""Issue 25, item 2: a recipe is tried once per site. After a re-analysis the lines of a region move and its intent
gets a new id; the run must still know that a recipe was already judged on that code (a speedrun's cross-entropy
recipe crashed after every re-analysis, four gates that could never pass)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from trainbridge.agents.analyst.static.scan import scan_repo_result
from trainbridge.agents.retrieval.sites import site_fingerprint, tried_key
from trainbridge.graph import nodes
from trainbridge.graph.context import RunContext
from trainbridge.graph.state import RunPaths
from trainbridge.tests.loop_fixtures import GOOD_RECIPE, loop_config, make_loop_repo


def _gelu(repo):
    return next(i for i in scan_repo_result(repo).intents if str(i.category) == "gelu")


def test_a_site_is_its_code_not_its_line_numbers(tmp_path):
    repo = make_loop_repo(tmp_path / "repo")
    before = _gelu(repo)
    fingerprint = site_fingerprint(repo, before)
    model = repo / "model.py"
    model.write_text("# a rewrite above moved every line\n\n\n" + model.read_text(encoding="utf-8"), encoding="utf-8")
    moved = _gelu(repo)
    assert moved.id != before.id and moved.spans[0].line_start == before.spans[0].line_start + 3
    assert site_fingerprint(repo, moved) == fingerprint
    model.write_text(model.read_text(encoding="utf-8").replace("0.044715", "0.0447"), encoding="utf-8")
    assert site_fingerprint(repo, _gelu(repo)) != fingerprint  # other code, another site
    assert site_fingerprint(tmp_path, moved) is None  # unreadable: no site, so never skipped


def test_retrieval_skips_recipes_already_judged_on_the_same_code(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    repo = make_loop_repo(tmp_path / "repo")
    config = loop_config(repo, "sites", tmp_path)
    runtime = SimpleNamespace(context=RunContext(config=config, paths=RunPaths(config.run_id, tmp_path / "home" / "runs")))
    gelu = _gelu(repo)
    site = site_fingerprint(repo, gelu)
    state = {"run_id": config.run_id, "started_at": time.time(), "baseline_step_s": 0.02, "analyses": 2,
             "intents": [gelu.model_dump(mode="json")], "intent_evidence": {gelu.id: {"site": site}}, "done_intents": []}

    fresh = nodes.retrieval(state, runtime)
    assert fresh["current_intent"]["id"] == gelu.id and fresh["recipe_queue"] == [GOOD_RECIPE]

    # the same code judged under an earlier id (its verdict's intent had other line numbers)
    tried = nodes.retrieval({**state, "tried_sites": [tried_key(GOOD_RECIPE, site)]}, runtime)
    assert tried["current_intent"] is None and tried["done_intents"] == [gelu.id]

    # a verdict on other code of the same category does not count here
    other = nodes.retrieval({**state, "tried_sites": [tried_key(GOOD_RECIPE, "0" * 20)]}, runtime)
    assert other["recipe_queue"] == [GOOD_RECIPE]


def test_every_verdict_records_its_recipe_and_site():
    state = {"intent_evidence": {"i1": {"site": "abc"}, "i2": {}}}
    records = [{"intent_id": "i1", "recipe_id": "r1"}, {"intent_id": "i2", "recipe_id": "r2"},
               {"intent_id": "i1", "recipe_id": None}]  # an LLM candidate has no recipe: nothing to skip by
    assert nodes.tried_sites(state, records) == ["r1@abc"]


def test_regions_in_a_library_called_from_one_line_are_different_sites(tmp_path):
    from trainbridge.records import LibrarySpan

    repo = make_loop_repo(tmp_path / "repo")
    gelu = _gelu(repo)
    norm = LibrarySpan(file="transformers/models/llama/modeling_llama.py", line_start=65, line_end=67,
                       module="transformers.models.llama.modeling_llama", function="LlamaRMSNorm.forward",
                       distribution="transformers", version="5.25.0")
    rope = norm.model_copy(update={"function": "apply_rotary_pos_emb", "line_start": 120, "line_end": 130})
    at_norm, at_rope = (site_fingerprint(repo, gelu.model_copy(update={"library": lib})) for lib in (norm, rope))
    assert len({at_norm, at_rope, site_fingerprint(repo, gelu)}) == 3  # one call site, three sites
