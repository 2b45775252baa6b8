"""torch_npu.npu.make_graphed_callables on the emulation's NPUGraph (torch_npu/npu/graphs.py upstream,
itself torch.cuda's): each callable's forward and backward are captured as two graphs after warm-up;
the graphed callable copies its arguments into the static inputs (unless they are the same memory),
replays the forward graph and returns the static outputs detached inside one autograd node, whose
backward copies the incoming gradients into the static gradient outputs and replays the backward
graph. A module gets a graphed `forward` used while its `training` flag is what it was at capture.
Not checked here (upstream raises): module hooks and buffers that require grad.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .graphs import NPUGraph, graph, graph_pool_handle, values_of

__all__ = ["make_graphed_callables"]


def _differentiable(tensors):
    return tuple(t for t in tensors if t is not None and t.requires_grad)


def _warm_up(fn, args, surface, iters, allow_unused):
    for _ in range(iters):
        outputs = _differentiable(tree_flatten(fn(*args))[0])
        if outputs:
            torch.autograd.grad(outputs, _differentiable(surface), grad_outputs=[torch.empty_like(o) for o in outputs],
                                only_inputs=True, allow_unused=allow_unused)


class _Captured:
    """One callable's two graphs and their static tensors."""

    def __init__(self, fn, args, surface, pool, allow_unused):
        self.surface = surface
        self.n_args = len(tree_flatten(args)[0])
        self.fwd, self.bwd = NPUGraph(), NPUGraph()
        with graph(self.fwd, pool=pool):
            outputs = fn(*args)
        flat, self.spec = tree_flatten(outputs)
        self.outputs = tuple(flat)
        self.grad_outputs = tuple(torch.empty_like(o) if o.requires_grad else None for o in self.outputs)
        wanted = _differentiable(surface)
        with graph(self.bwd, pool=self.fwd.pool()):
            grads = torch.autograd.grad(_differentiable(self.outputs), wanted,
                                        grad_outputs=tuple(g for g in self.grad_outputs if g is not None),
                                        only_inputs=True, allow_unused=allow_unused) if wanted else ()
        grads = iter(grads)
        self.grad_inputs = tuple(next(grads) if t.requires_grad else None for t in surface)

    def function(self):
        cap = self

        class Graphed(torch.autograd.Function):
            @staticmethod
            def forward(ctx, *inputs):
                for static, new in zip(cap.surface[:cap.n_args], inputs[:cap.n_args]):
                    if values_of(static).data_ptr() != values_of(new).data_ptr():
                        static.copy_(new)
                cap.fwd.replay()
                return tuple(o.detach() for o in cap.outputs)

            @staticmethod
            @torch.autograd.function.once_differentiable
            def backward(ctx, *grads):
                for static, new in zip(cap.grad_outputs, grads):
                    if static is None or new is None:
                        continue
                    if values_of(static).data_ptr() != values_of(new).data_ptr():
                        static.copy_(new)
                cap.bwd.replay()
                return tuple(g.detach() if g is not None else None for g in cap.grad_inputs)

        def functionalized(*user_args):
            flat = tree_flatten(user_args)[0]
            out = Graphed.apply(*flat, *cap.surface[cap.n_args:])
            return tree_unflatten(list(out), cap.spec)

        return functionalized


def make_graphed_callables(callables, sample_args, num_warmup_iters=3, allow_unused_input=False, pool=None):
    """Graphed versions of `callables` (a function or module, or a tuple of them, with `sample_args` a
    tuple of tensors, or a tuple of such tuples); see the module doc."""
    single = not isinstance(callables, tuple)
    if single:
        callables, sample_args = (callables,), (sample_args,)
    if len(callables) != len(sample_args):
        raise ValueError("make_graphed_callables: one tuple of sample args per callable")
    surfaces = []
    for fn, args in zip(callables, sample_args):
        flat = tree_flatten(args)[0]
        if not all(isinstance(a, torch.Tensor) for a in flat):
            raise TypeError("In the beta API, sample_args for each callable must contain only Tensors. "
                            "Other types are not allowed.")
        params = tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else ()
        surfaces.append(tuple(flat) + params)
    for fn, args, surface in zip(callables, sample_args, surfaces):
        _warm_up(fn, args, surface, num_warmup_iters, allow_unused_input)
    pool = graph_pool_handle() if pool is None else pool
    graphed = []
    for fn, args, surface in zip(callables, sample_args, surfaces):
        run = _Captured(fn, args, surface, pool, allow_unused_input).function()
        if isinstance(fn, torch.nn.Module):
            fn.forward = _switch(fn, run, fn.forward, fn.training)
            graphed.append(fn)
        else:
            graphed.append(run)
    return graphed[0] if single else tuple(graphed)


def _switch(module, graphed, original, training):
    def forward(*args):
        return graphed(*args) if module.training == training else original(*args)
    return forward
