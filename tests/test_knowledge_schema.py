"""The knowledge base's records: the recipe schema (malformed files rejected naming the file and the
field), outcome ids, and the offline embeddings (identical across processes, Chroma's protocol).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import numpy as np
import pytest
import yaml

from trainbridge.knowledge.embeddings import HashedCodeEmbedding, embed_text
from trainbridge.knowledge.schema import (
    Outcome,
    Recipe,
    RecipeFileError,
    load_recipe_dir,
    load_recipe_file,
    parse_recipe,
)
from trainbridge.knowledge.store import SEED_DIR
from trainbridge.tests.knowledge_support import PYTHON, outcome, seed_recipe  # noqa: F401 (fixtures)


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
