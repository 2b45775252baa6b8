"""Every seed recipe applied to real code, run, and compared with the original program.

For each case the program (a bundled example, a differently written variant under
tests/fixtures/recipe_variants/, or a runnable real-style program under tests/fixtures/real_style/runnable/)
is copied to a temporary folder, the static scanner's intent of
the case's category gives the spans, and the recipe is applied exactly as the coder does
(`apply_recipe(source, recipe, span)` for each span of the intent until one applies). The
rewritten program must parse, import and train: a child process builds it through its
`trainbridge_entry`, records the first-step gradients of `loss_fn` and the losses of a few
`train_step` calls, and the parent compares them with the unmodified program's (same seed, same
batches) within the recipe's numerics class. torch_npu recipes run in a child with the NPU
emulation first on PYTHONPATH and device "npu"; their baseline is the original program on that same
emulated device (as the gate compares head and candidate on the target: the emulated device's own
op decompositions differ from the CPU's by ~1e-9, which an 'exact' recipe must not be blamed for).

All cases of one program and backend run in one child (one torch import), the unmodified program's baseline
first in it; the children of the bundled examples take a while and are marked slow. The child, the case record, the lab and the
numerics comparison are in benchmarks/recipe_lab.py (shared with benchmarks/recipe_apply_rate.py);
the cases in tests/recipe_cases.py.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import libcst as cst
import pytest

from trainbridge.tests.recipe_cases import CASES
from recipe_lab import RECIPES, Lab, apply_case, assert_within, compare, params, source_dir


@pytest.fixture(scope="session")
def lab(tmp_path_factory, request):
    """The lab of the cases this session runs, the next groups' children started while one is read, two at a time
    (CI's two cores: each child has one thread, and this process mostly waits for them)."""
    selected = {item.callspec.params["case"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_recipe_on_real_code"}
    lab = Lab(tmp_path_factory.mktemp("recipes"), [c for c in CASES if c in selected])
    lab.prefetch(workers=min(2, os.cpu_count() or 1))
    yield lab
    lab.close()


# ------------------------------------------------------------------------------------------------
# the cases


def test_every_seed_recipe_has_a_real_code_case():
    # a library patch rewrites a library's code from the user's repository: its real code is the installed library,
    # and tests/test_library_patches.py runs each one on a Hugging Face model built from a config
    patches = {rid for rid, recipe in RECIPES.items() if recipe.match.kind == "library_patch"}
    library_tests = (Path(__file__).parent / "test_library_patches.py").read_text(encoding="utf-8")
    assert patches and {rid for rid in patches if f'"{rid}"' not in library_tests} == set(), "library patches without a test"
    recipes = set(RECIPES) - patches
    covered = {c.recipe for c in CASES if c.expect in ("match", "fails") and c.mutate is None}
    assert recipes - covered == set(), "seed recipes without a test on real code"
    written_differently = ("variant_", "real_")
    on_variants = {c.recipe for c in CASES if c.program.startswith(written_differently) and c.expect != "refused"}
    on_examples = {c.recipe for c in CASES if not c.program.startswith(written_differently) and c.expect == "match"}
    # every recipe is also exercised on code spelled differently from the bundled examples (for the
    # recipes whose pattern no example contains, that variant is its only real-code test)
    assert recipes - on_variants == set(), "recipes not tried on a differently written variant"
    assert on_examples | on_variants == recipes


@pytest.mark.parametrize("case", params([c for c in CASES if c.expect == "refused"]))
def test_recipe_refuses_code_that_only_looks_similar(case, tmp_path):
    folder = tmp_path / "program"
    shutil.copytree(source_dir(case.program), folder)
    applied = apply_case(case, folder)
    assert applied.file is None, f"{case.recipe} rewrote code it must not touch:\n{applied.after}"
    assert applied.refusals and all("matches recipe" in r or "no expression" in r for r in applied.refusals)


@pytest.mark.parametrize("case", params([c for c in CASES if c.expect != "refused"]))
def test_recipe_on_real_code(case, lab):
    recipe = RECIPES[case.recipe]
    assert case.backend in {t.value for t in recipe.targets}, f"{recipe.id} is not written for {case.backend}"
    applied, result = lab.result(case)
    assert applied.file is not None, f"{recipe.id} did not apply to {case.program}:\n" + "\n".join(applied.refusals)
    assert applied.after != applied.before
    cst.parse_module(applied.after)
    if case.expect == "fails":
        assert result is not None and not result["ok"], f"{case.id} was expected to fail loudly but ran"
        assert re.search(case.expect_error, result["error"]), result["traceback"]
        return
    assert result is not None and result["ok"], f"{case.id} does not run:\n{result and result.get('traceback')}"
    base = lab.baseline(case.program, case.steps, case.backend)
    assert result["param_names"] == base["param_names"], "the rewrite changed the model's parameters"
    if case.expect == "diverges":
        with pytest.raises(AssertionError) as rejected:
            assert_within(recipe, compare(base, result))
        print(f"REJECTED {case.id}: {str(rejected.value).splitlines()[0][:300]}")
        return
    comparison = compare(base, result)
    print(f"NUMERICS {case.id}: {comparison.line()}")
    assert_within(recipe, comparison)
    if recipe.category == "host_sync":
        steps = case.steps
        logged = result["log_records"] + result["stdout_lines"]
        assert base["log_records"] + base["stdout_lines"] == steps  # one log line per step before
        assert logged == len(range(0, steps, 10)), f"expected logs at steps 0, 10, ...: got {logged} of {steps}"
