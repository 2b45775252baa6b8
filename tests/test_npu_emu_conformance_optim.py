"""Ascend/pytorch's fused-optimizer test cases (test/optim/test_fused_optimizers.py), against the
emulated torch_npu.optim: the same optimizer cases, parameter sets, model, iteration counts and
tolerances, with torch.optim as the golden (see test_npu_emu_conformance_norm_rope.py for the
conventions). Off the device the model and tensors stay on the host; the math is the same.
"""

from __future__ import annotations

from copy import deepcopy

import pytest
import torch
from torch.optim import SGD, Adadelta, Adam, AdamW, RMSprop

from trainbridge.tests.npu_emulation_support import on_device, tnpu, to_npu, upstream  # noqa: F401 (fixture)

SRC = "Ascend/pytorch test/optim/test_fused_optimizers.py"
_CASES = [
    ("SGD", "NpuFusedSGD", dict(lr=0.01, momentum=0.9, weight_decay=0.001)),
    ("Adam", "NpuFusedAdam", dict(eps=1e-8, betas=(0.9, 0.999), lr=2e-3, weight_decay=0.05)),
    ("AdamW", "NpuFusedAdamW", dict(eps=1e-8, betas=(0.9, 0.999), lr=2e-3, weight_decay=0.05)),
    ("Adadelta", "NpuFusedAdadelta", dict(lr=1.0, rho=0.9, eps=1e-6, weight_decay=0.05)),
    ("RMSprop", "NpuFusedRMSprop", dict(eps=0.001, lr=0.01, weight_decay=1e-5)),
]
_TORCH = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW, "Adadelta": Adadelta, "RMSprop": RMSprop}
_IDS = [c[1] for c in _CASES]


def _rtol(expected, actual, prec=1e-4, prec16=1e-3):
    from torch_npu.testing import assert_rtol_equal

    assert_rtol_equal(expected, actual, prec, prec16)


def _params_and_grads():
    params = [
        torch.arange(6).reshape(2, 3).float(), torch.arange(12).reshape(4, 3).float(),
        torch.arange(6).reshape(2, 3).half(), torch.arange(12).reshape(4, 3).half(),
        torch.arange(15).reshape(5, 3).float(), torch.arange(18).reshape(6, 3).half(),
        torch.arange(6).reshape(2, 3).float(),
    ]
    params = [to_npu(p) for p in params]
    for i, p in enumerate(params):
        if i < len(params) - 1:  # the last one has no grad
            p.requires_grad = True
            p.grad = p.clone().detach() / 100.0
    return params


def _clone(params):
    out = []
    for p in params:
        c = p.clone().detach()
        if p.requires_grad:
            c.requires_grad = True
            c.grad = p.grad.clone().detach()
        out.append(c)
    return out


def _model():
    model = torch.nn.Sequential(torch.nn.Conv2d(1, 8, kernel_size=3), torch.nn.BatchNorm2d(8, momentum=0.3),
                                torch.nn.ReLU(), torch.nn.Linear(22, 12))
    return model.to("npu:0") if on_device() else model


def _input():
    x = torch.rand(3, 1, 24, 24)
    return x.to("npu:0") if on_device() else x


@upstream("torch_npu.optim.NpuFused*", SRC, "test_zero_grad")
@pytest.mark.parametrize("torch_name,fused_name,kwargs", _CASES, ids=_IDS)
def test_zero_grad(tnpu, torch_name, fused_name, kwargs):
    params = _params_and_grads()
    clone = _clone(params)
    with torch.no_grad():
        _TORCH[torch_name](params, **kwargs).zero_grad()
        getattr(tnpu.optim, fused_name)(clone, **kwargs).zero_grad()
    for p, c in zip(params, clone):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, c.grad)
            assert not c.grad.any()


@upstream("torch_npu.optim.NpuFused*", SRC, "test_step")
@pytest.mark.parametrize("torch_name,fused_name,kwargs", _CASES, ids=_IDS)
def test_step(tnpu, torch_name, fused_name, kwargs):
    params = _params_and_grads()
    clone = _clone(params)
    opt, fused = _TORCH[torch_name](params, **kwargs), getattr(tnpu.optim, fused_name)(clone, **kwargs)
    with torch.no_grad():
        for _ in range(10):
            opt.step()
            fused.step()
            for p, c in zip(params, clone):
                if p.grad is not None:
                    _rtol(p.cpu(), c.cpu(), prec=1e-3)


@upstream("torch_npu.optim.NpuFused*", SRC, "test_unscale")
@pytest.mark.parametrize("torch_name,fused_name,kwargs", _CASES, ids=_IDS)
def test_unscale(tnpu, torch_name, fused_name, kwargs):
    from torch_npu.npu.amp import GradScaler, autocast

    m = _model()
    opt = getattr(tnpu.optim, fused_name)(m.parameters(), **kwargs)
    scaler = GradScaler(init_scale=128.0)
    with autocast():
        loss = m(_input()).mean()
    scaler.scale(loss).backward()
    before = {p: p.grad.clone().detach() for p in m.parameters() if p.grad is not None}
    scaler.unscale_(opt)
    for p in m.parameters():
        if p.grad is not None:
            torch.testing.assert_close(before[p] / 128, p.grad)


def _train(tnpu, fused_name, torch_name, kwargs, scaler_kwargs, loss_fn, prec):
    from torch_npu.npu.amp import GradScaler, autocast

    torch.manual_seed(0)
    model = _model()
    runs = []
    for opt_factory in (lambda ps: _TORCH[torch_name](ps, **kwargs),
                        lambda ps: getattr(tnpu.optim, fused_name)(ps, **kwargs)):
        m = deepcopy(model)
        runs.append((m, opt_factory(m.parameters()), GradScaler(**scaler_kwargs)))
    for _ in range(10):
        x = _input()
        losses = []
        for m, opt, scaler in runs:
            with autocast():
                out = m(x)
                loss = loss_fn(out)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            losses.append(loss.detach().float().cpu())
        _rtol(losses[0], losses[1], prec=prec, prec16=prec)


@upstream("torch_npu.optim.NpuFused*", SRC, "test_simple_model_train_dynamic")
@pytest.mark.parametrize("torch_name,fused_name,kwargs", _CASES, ids=_IDS)
def test_simple_model_train_dynamic(tnpu, torch_name, fused_name, kwargs):
    _train(tnpu, fused_name, torch_name, kwargs, {}, lambda out: out.mean(), 1e-4)


@upstream("torch_npu.optim.NpuFused*", SRC, "test_simple_model_train_static")
@pytest.mark.parametrize("torch_name,fused_name,kwargs", _CASES, ids=_IDS)
def test_simple_model_train_static(tnpu, torch_name, fused_name, kwargs):
    _train(tnpu, fused_name, torch_name, kwargs, dict(dynamic=False, init_scale=128), lambda out: out.float().mean(),
           1e-3)


@upstream("torch_npu.optim.NpuFused*", SRC, "test_clip_grad_norm_fused")
@pytest.mark.parametrize("torch_name,fused_name,kwargs", _CASES, ids=_IDS)
def test_clip_grad_norm_fused(tnpu, torch_name, fused_name, kwargs):
    params = _params_and_grads()
    clone = _clone(params)
    fused = getattr(tnpu.optim, fused_name)(clone, **kwargs)
    norm = torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], 5.0)
    norm_fused = fused.clip_grad_norm_fused_(5.0)
    for p, c in zip(params, clone):
        if p.grad is not None:
            _rtol(p.grad.cpu(), c.grad.cpu(), prec=1e-3)
    _rtol(norm.float().cpu(), norm_fused.cpu(), prec=1e-3)


@upstream("torch_npu.optim.NpuFused*", SRC, "module import: the nine optimizer names")
def test_the_test_files_imports_resolve(tnpu):
    from torch_npu.optim import (  # noqa: F401
        NpuFusedAdadelta,
        NpuFusedAdam,
        NpuFusedAdamP,
        NpuFusedAdamW,
        NpuFusedBertAdam,
        NpuFusedLamb,
        NpuFusedRMSprop,
        NpuFusedRMSpropTF,
        NpuFusedSGD,
    )


@upstream("torch_npu.optim.NpuFused*", SRC, "test_step_3rd_optims (upstream-skipped; not emulated, raises)")
@pytest.mark.parametrize("name", ["NpuFusedAdamP", "NpuFusedLamb", "NpuFusedBertAdam", "NpuFusedRMSpropTF"])
def test_third_party_optimizers_say_they_are_not_emulated(tnpu, name):
    with pytest.raises(NotImplementedError, match="not emulated"):
        getattr(tnpu.optim, name)(_params_and_grads(), lr=0.01)
