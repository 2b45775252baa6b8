"""cross-entropy-library-npu's helper against F.cross_entropy (issue 25, item 2): any ignore_index (-100 padding, a
speedrun's -1, a real class), reduction ('none' then a masked mean, as a script may write), weight, label smoothing
and logits of shape (C,), (N, C) or (N, C, d), values and gradients, on the emulated fused op (in-process, op math
only). The fused op's own label smoothing crashed training ('mean' backward takes none) and -100 targets were
invalid input to it; the legacy size_average/reduce keywords are refused before a gate."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainbridge.knowledge.schema import load_recipe_file
from trainbridge.tests.npu_emulation_support import tnpu  # noqa: F401 (a fixture)

RECIPE = Path(__file__).resolve().parents[1] / "knowledge" / "recipes" / "cross-entropy-library-npu.yaml"


@pytest.fixture(scope="module")
def helper(tnpu):  # noqa: F811
    recipe = load_recipe_file(RECIPE)
    scope = {"torch": torch, "torch_npu": tnpu}
    exec(recipe.match.params["define"], scope)
    return scope["_tb_npu_cross_entropy"]


def _targets(shape, classes, ignore_index, generator):
    t = torch.randint(0, classes, shape, generator=generator)
    flat = t.view(-1)
    flat[::3] = ignore_index  # every third row ignored (or, for a real class, that class)
    return t


CASES = list(itertools.product((-100, -1, 2), ("mean", "sum", "none"), (False, True), (0.0, 0.1)))


@pytest.mark.parametrize("ignore_index,reduction,weighted,smoothing", CASES)
def test_the_helper_matches_f_cross_entropy(helper, ignore_index, reduction, weighted, smoothing):
    g = torch.Generator().manual_seed(0)
    classes = 7
    weight = torch.rand(classes, generator=g) + 0.5 if weighted else None
    for shape in ((6, classes), (3, classes, 4)):
        x = torch.randn(shape, generator=g, dtype=torch.float64).float()
        t = _targets((shape[0], *shape[2:]), classes, ignore_index, g)
        kwargs = dict(weight=weight, ignore_index=ignore_index, reduction=reduction, label_smoothing=smoothing)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = helper(a, t, **kwargs), F.cross_entropy(b, t, **kwargs)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        upstream = torch.randn(want.shape, generator=g) if reduction == "none" else torch.tensor(1.0)
        got.backward(upstream)
        want.backward(upstream)
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_reduction_none_then_a_masked_mean_and_bf16_logits(helper):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 11, generator=g).bfloat16()
    t = torch.randint(0, 11, (8,), generator=g)
    mask = torch.rand(8, generator=g) > 0.3
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    got = (helper(a, t, reduction="none") * mask).sum() / mask.sum()
    want = (F.cross_entropy(b, t, reduction="none") * mask).sum() / mask.sum()
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    got.backward()
    want.backward()
    torch.testing.assert_close(a.grad.float(), b.grad.float(), rtol=2e-2, atol=2e-3)
    one = torch.randn(5, generator=g)  # unbatched: (C,) logits, a 0-d target
    torch.testing.assert_close(helper(one, torch.tensor(3)), F.cross_entropy(one, torch.tensor(3)))


def test_what_the_helper_cannot_do_is_refused_or_raised(helper):
    recipe = load_recipe_file(RECIPE)
    assert {"size_average", "reduce"} <= set(recipe.match.params["absent_kwargs"])  # refused before a gate
    with pytest.raises(ValueError, match="class-index targets"):
        helper(torch.randn(4, 3), torch.softmax(torch.randn(4, 3), -1))
