"""torch_npu.optim stand-ins against torch.optim and the documented combined-buffer hazards.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainbridge.tests.npu_emulation_support import (  # noqa: F401 (tnpu is a fixture)
    tnpu,
)


# ================================================================================ NpuFusedAdamW


def _tiny_model(seed=18, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)


def _batches(n, seed=19):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("amsgrad", [False, True])
def test_fused_adamw_matches_torch_adamw(tnpu, amsgrad):
    fused_model, ref_model = _tiny_model(), _tiny_model()
    hp = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, amsgrad=amsgrad)
    fused = tnpu.optim.NpuFusedAdamW(fused_model.parameters(), **hp)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **hp)
    for x, y in _batches(5):
        for model, opt in ((fused_model, fused), (ref_model, ref)):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    for p, r in zip(fused_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)
    assert fused.state[next(iter(fused_model.parameters()))]["step"] == 5


def test_fused_adamw_raises_like_torch_npu(tnpu):
    model = _tiny_model(dtype=torch.bfloat16)
    opt = tnpu.optim.NpuFusedAdamW(model.parameters())
    model(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(TypeError, match="must be either float32 or float16"):
        opt.step()
    opt32 = tnpu.optim.NpuFusedAdamW(_tiny_model().parameters())
    with pytest.raises(ValueError, match="set_to_none=True"):
        opt32.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):
        tnpu.optim.NpuFusedAdamW(_tiny_model().parameters(), lr=-1.0)


def test_fused_adamw_model_zero_grad_trains_on_stale_gradients(tnpu):
    """The combined-buffer hazard of torch_npu, reproduced: model.zero_grad() detaches the grads."""
    model, ref_model = _tiny_model(), _tiny_model()
    opt = tnpu.optim.NpuFusedAdamW(model.parameters(), lr=1e-2)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=False)
    (x1, y1), (x2, y2) = _batches(2)
    F.mse_loss(model(x1), y1).backward()
    opt.step()
    model.zero_grad()  # set_to_none=True: the next backward allocates grads outside the flat buffer
    F.mse_loss(model(x2), y2).backward()
    opt.step()
    # the reference sees the first batch's gradient twice: that is what the fused optimizer used
    F.mse_loss(ref_model(x1), y1).backward()
    first = [p.grad.clone() for p in ref_model.parameters()]
    ref.step()
    for p, g in zip(ref_model.parameters(), first):
        p.grad = g.clone()
    ref.step()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-6, atol=1e-7)


def test_fused_adamw_late_grad_and_clip(tnpu):
    model = _tiny_model()
    params = list(model.parameters())
    opt = tnpu.optim.NpuFusedAdamW(params)
    params[0].requires_grad_(False)
    (x, y), = _batches(1)
    F.mse_loss(model(x), y).backward()
    want = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params[1:]]))
    total = opt.clip_grad_norm_fused_(0.01)
    torch.testing.assert_close(total, want)
    assert torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in params[1:]])) < 0.0101
    opt.step()
    params[0].requires_grad_(True)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    with pytest.raises(KeyError, match="step"):
        opt.step()




# ================================================================================ every fused optimizer

_FUSED = [  # (torch_npu name, torch.optim class, hyper-parameters): the ones a recipe can target
    ("NpuFusedSGD", torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3)),
    ("NpuFusedSGD", torch.optim.SGD, dict(lr=0.05, momentum=0.9, nesterov=True)),
    ("NpuFusedSGD", torch.optim.SGD, dict(lr=0.05)),
    ("NpuFusedAdam", torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1)),
    ("NpuFusedAdam", torch.optim.Adam, dict(lr=1e-2, amsgrad=True)),
    ("NpuFusedAdamW", torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    ("NpuFusedAdadelta", torch.optim.Adadelta, dict(lr=1.0, weight_decay=0.05)),
    ("NpuFusedRMSprop", torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
]
_FUSED_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in kw.items())}" for n, _, kw in _FUSED]


def _train(model, opt, batches, zero):
    for x, y in batches:
        zero()
        F.mse_loss(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("name,ref_cls,hp", _FUSED, ids=_FUSED_IDS)
def test_fused_optimizer_matches_torch(tnpu, name, ref_cls, hp):
    model, ref_model = _tiny_model(), _tiny_model()
    opt = getattr(tnpu.optim, name)(model.parameters(), **hp)
    ref = ref_cls(ref_model.parameters(), foreach=False, **hp)
    batches = _batches(6)
    _train(model, opt, batches, opt.zero_grad)
    _train(ref_model, ref, batches, ref.zero_grad)
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,ref_cls,hp", _FUSED, ids=_FUSED_IDS)
def test_fused_optimizer_pitfalls_behave_as_on_the_npu(tnpu, name, ref_cls, hp):
    """semantics.md 6.2: bf16 raises; zero_grad(set_to_none=True) raises; model.zero_grad() after the
    first step trains on stale gradients (the flat buffer keeps the first batch's); a reallocated
    parameter is no longer updated."""
    cls = getattr(tnpu.optim, name)
    bf16 = _tiny_model(dtype=torch.bfloat16)
    opt = cls(bf16.parameters(), **hp)
    bf16(torch.randn(2, 4, dtype=torch.bfloat16)).sum().backward()
    with pytest.raises(TypeError, match="must be either float32 or float16"):
        opt.step()
    with pytest.raises(ValueError, match="set_to_none=True"):
        cls(_tiny_model().parameters(), **hp).zero_grad(set_to_none=True)

    stale, fresh = _tiny_model(), _tiny_model()
    opt_stale, opt_fresh = cls(stale.parameters(), **hp), cls(fresh.parameters(), **hp)
    (x1, y1), (x2, y2) = _batches(2)
    for model, opt in ((stale, opt_stale), (fresh, opt_fresh)):
        F.mse_loss(model(x1), y1).backward()
        opt.step()
    stale.zero_grad()  # set_to_none: the next backward allocates grads outside the flat buffer
    opt_fresh.zero_grad()
    for model, opt in ((stale, opt_stale), (fresh, opt_fresh)):
        F.mse_loss(model(x2), y2).backward()
        opt.step()
    first_grad_again = _tiny_model()
    opt_ref = cls(first_grad_again.parameters(), **hp)
    F.mse_loss(first_grad_again(x1), y1).backward()
    opt_ref.step()
    opt_ref.step()  # the buffer still holds the first batch's gradient
    for a, b in zip(stale.parameters(), first_grad_again.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert any(not torch.allclose(a, b) for a, b in zip(stale.parameters(), fresh.parameters()))

    model = _tiny_model()
    opt = cls(model.parameters(), **hp)
    F.mse_loss(model(x1), y1).backward()
    opt.step()
    model[0].weight.data = model[0].weight.data.clone()  # reallocated after combination
    before = model[0].weight.detach().clone()
    opt.zero_grad()
    F.mse_loss(model(x2), y2).backward()
    opt.step()
    torch.testing.assert_close(model[0].weight.detach(), before)  # silently not trained any more
