"""Semantic matching of function-shaped regions (issue 13 item 4): the region and each candidate of a
``semantic`` recipe run on the same seeded inputs in a confined child; the first candidate whose outputs
and input gradients agree is written in, however the region is spelled. Team-written rotary functions
in spellings no syntactic rope pattern knows, and near misses that no candidate computes."""

from __future__ import annotations

import textwrap

import pytest

from trainbridge.agents.coder.semantic_match import apply_semantically, match_region, probes
from trainbridge.records import SourceSpan
from recipe_lab import RECIPES
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tools.codemods.region_probe import ProbeError, build_probe, verdict

RECIPE = RECIPES["rope-function-npu-rotary-mul"]


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _span(source: str, name: str) -> SourceSpan:
    lines = source.splitlines()
    start = next(i for i, line in enumerate(lines, 1) if f"def {name}(" in line)
    return SourceSpan(file="rot.py", line_start=start, line_end=start + 1)


FORMS = _src('''
    import torch


    def _swap(t):
        a, b = t.unbind(-2)
        return torch.stack((-b, a), dim=-2)


    @torch.compile
    def spin(t, c, s):
        """Halves by narrow, recombined by stack/flatten; tables per half (speedrun direction)."""
        lo, hi = t.narrow(-1, 0, t.size(-1) // 2), t.narrow(-1, t.size(-1) // 2, t.size(-1) // 2)
        return torch.stack((lo * c + hi * s, hi * c - lo * s)).movedim(0, -2).flatten(-2)


    def hf_style(q, cos, sin):
        """Full-dim tables, rotate-half through a helper on an unflattened view (HF direction)."""
        halves = q.unflatten(-1, (2, q.size(-1) // 2))
        return q * cos + _swap(halves).flatten(-2) * sin


    def pairwise(x, cos, sin):
        """GPT-J / Meta pairwise rotation: no candidate (interleave needs repeated tables)."""
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


    class Attn(torch.nn.Module):
        def rotate(self, x, cos, sin):
            return x * cos * self.scale
''')


def test_the_recipe_is_matched_by_behaviour_and_its_probe_program_is_self_contained():
    assert probes(RECIPE) and not probes(RECIPES["rope-halves-npu-rotary-mul"])
    probe = build_probe(FORMS, _span(FORMS, "spin"), RECIPE)
    assert probe.function == "spin" and probe.site.line_start == _span(FORMS, "spin").line_start and probe.site.function == "spin"
    assert "@torch.compile" not in probe.program  # the semantics of the body, not its compilation
    assert "def _tb_original(t, c, s):" in probe.program and "def _swap(t):" in probe.program
    assert [f"def _tb_candidate_{i}(t, c, s):" in probe.program for i in range(4)] == [True] * 4
    assert "torch_npu.npu_rotary_mul(t, torch.cat((c, c), dim=-1), -torch.cat((s, s), dim=-1))" in probe.program
    assert probe.shape_sets[0] == {"t": {"shape": [2, 6, 2, 8]}, "c": {"shape": [1, 6, 1, 4]}, "s": {"shape": [1, 6, 1, 4]}}
    compile(probe.program, "probe.py", "exec")


def test_regions_that_cannot_be_probed_say_why():
    with pytest.raises(ProbeError, match="reads its object"):
        build_probe(FORMS, _span(FORMS, "rotate"), RECIPE)
    bare = RECIPE.model_copy(update={"match": RECIPE.match.model_copy(
        update={"params": {k: v for k, v in RECIPE.match.params.items() if k != "probe"}})})
    with pytest.raises(ProbeError, match="no probe shapes"):
        build_probe(FORMS, _span(FORMS, "spin"), bare)
    with pytest.raises(ProbeError, match=r"_swap\(t\) takes 1 argument"):
        build_probe(FORMS, _span(FORMS, "_swap"), RECIPE)
    with pytest.raises(ProbeError, match="no function holds"):
        build_probe(FORMS, SourceSpan(file="rot.py", line_start=1, line_end=1), RECIPE)


def test_verdict_takes_the_recipes_tolerance_and_the_cosine_floor():
    close = {"max_abs": 1e-6, "scale": 1.0, "cosine": 1.0}
    report = {"outputs": [close], "grads": {"x": close}, "shapes": {"x": [2]}}
    assert verdict(report, rtol=1e-4, atol=1e-5)[0]
    far = {**report, "grads": {"x": {"max_abs": 1e-2, "scale": 1.0, "cosine": 1.0}}}
    ok, why = verdict(far, rtol=1e-4, atol=1e-5)
    assert not ok and "gradient of x" in why
    turned = {**report, "outputs": [{"max_abs": 0.0, "scale": 1.0, "cosine": 0.99}]}
    assert not verdict(turned, rtol=1e-4, atol=1e-5)[0]
    assert verdict({"equivalent": False, "reason": "the candidate raises"}, rtol=1.0, atol=1.0) == (False, "the candidate raises")


def test_a_rotary_spelled_with_narrow_and_stack_gets_the_half_table_rewrite():
    edit, why = apply_semantically(FORMS, _span(FORMS, "spin"), RECIPE)
    assert edit is not None, why
    body = edit.source.split("def spin(", 1)[1].split("\ndef ", 1)[0]
    assert "return torch_npu.npu_rotary_mul(t, torch.cat((c, c), dim=-1), -torch.cat((s, s), dim=-1))" in body
    assert "t.narrow(" not in body and '"""Halves by narrow' in body  # the docstring stays
    assert "_tb_rope_table" not in edit.source  # a helper only other candidates call is not inserted
    assert why.startswith("semantic match: spin: equivalent on shapes") and "candidate 1 of" in why


def test_full_dim_tables_skip_the_shapes_the_region_rejects_and_find_the_third_candidate():
    found = match_region(FORMS, _span(FORMS, "hf_style"), RECIPE, target="npu")
    assert found.replacement == "torch_npu.npu_rotary_mul($x, _tb_rope_table($cos, $x), _tb_rope_table($sin, $x))"
    assert [c.equivalent for c in found.checks] == [False, False, True]
    assert "raises" in found.checks[0].detail  # per-half tables concatenated are twice the head dim here


def test_a_rotation_no_candidate_computes_is_refused_with_each_candidates_figures():
    edit, why = apply_semantically(FORMS, _span(FORMS, "pairwise"), RECIPE)
    assert edit is None
    assert why.startswith("pairwise: no candidate computes the same")
    assert why.count("$x") >= 4 and ("max abs diff" in why or "raises" in why)
    with pytest.raises(CodemodRefused):  # and the syntactic rope recipes do not take it either
        apply_recipe(FORMS, RECIPES["rope-halves-npu-rotary-mul"], _span(FORMS, "pairwise"))


def test_the_documented_trap_as_the_only_candidate_is_refused_by_the_probe():
    """r2 = +sin for the speedrun rotation (the trap of rope-chunk / rope-halves): the probe catches it."""
    params = {**RECIPE.match.params, "candidates": [RECIPE.match.params["candidates"][1]]}
    wrong = RECIPE.model_copy(update={"match": RECIPE.match.model_copy(update={"params": params})})
    found = match_region(FORMS, _span(FORMS, "spin"), wrong, target="npu")
    assert found.replacement is None and "max abs diff" in found.checks[0].detail


COMPLEX = _src('''
    import torch


    def meta_style(xq, freqs_cis):
        xc = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
        shape = [d if i in (1, xc.ndim - 1) else 1 for i, d in enumerate(xc.shape)]
        return torch.view_as_real(xc * freqs_cis.view(*shape)).flatten(3).type_as(xq)


    def heads_first(x, freqs_cis):
        xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis[None, None]).flatten(-2)


    def conjugate(x, freqs_cis):
        xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
        return torch.view_as_real(xc * freqs_cis.conj()[None, :, None, :]).flatten(3).type_as(x)
''')


@pytest.mark.parametrize("name, layout", [("meta_style", "$x, 1)"), ("heads_first", "$x, 2)")])
def test_complex_multiply_rotary_gets_interleave_tables_in_its_own_layout(name, layout):
    recipe = RECIPES["rope-complex-npu-rotary-mul"]
    found = match_region(COMPLEX, _span(COMPLEX, name), recipe, target="npu")
    assert found.replacement is not None and layout in found.replacement, found.summary()


def test_a_complex_rotary_turning_the_other_way_is_refused():
    edit, why = apply_semantically(COMPLEX, _span(COMPLEX, "conjugate"), RECIPES["rope-complex-npu-rotary-mul"])
    assert edit is None and "no candidate computes the same" in why and "max abs diff" in why


def test_the_coder_gets_a_refusal_not_an_exception_when_the_region_cannot_be_probed():
    edit, why = apply_semantically(FORMS, _span(FORMS, "rotate"), RECIPE)
    assert edit is None and why.startswith("the region cannot be probed") and "reads its object" in why


RECORD_FORM = _src('''
    import torch


    def rotary(x_BTHD, cos, sin):
        """The Modded-NanoGPT records' (2025) rotary: [max_seq_len, head_dim / 2] tables (half of them zero
        frequencies), sliced to the sequence of BSND x."""
        assert cos.size(0) >= x_BTHD.size(-3)
        cos, sin = (
            cos[None, : x_BTHD.size(-3), None, :],
            sin[None, : x_BTHD.size(-3), None, :],
        )
        x1, x2 = x_BTHD.chunk(2, dim=-1)
        y1 = x1 * cos + x2 * sin
        y2 = x1 * (-sin) + x2 * cos
        return torch.cat((y1, y2), 3)
''')


def test_the_records_rotary_over_sliced_two_dim_half_tables_gets_the_sliced_rewrite():
    """Every earlier shape set is rejected (the region's assert, then half tables against the full head dim); the
    2-D half tables find the sliced candidate, in the speedrun direction (r2 = -sin)."""
    edit, why = apply_semantically(RECORD_FORM, _span(RECORD_FORM, "rotary"), RECIPE)
    assert edit is not None, why
    assert "candidate 5 of" in why and "[6, 4]" in why, why
    assert ("return torch_npu.npu_rotary_mul(x_BTHD, torch.cat((cos, cos), dim=-1)[None, :x_BTHD.size(1), None, :], "
            "-torch.cat((sin, sin), dim=-1)[None, :x_BTHD.size(1), None, :])") in edit.source
