"""A program's own torch.compile on the emulated npu device (issue 25, item 1).

On an NPU host torch_npu's backend compiles `torch.compile(model)`; here the emulated device has no
compiler, so a ported program that compiles its model (or a function, `@torch.compile`, with
`dynamic=False`, ...) must still run unchanged, with eager numerics.

Approach: Dynamo traces the program on the device tensors themselves (not a fall-back to eager).
`NpuTensor` is a traceable wrapper subclass (`__tensor_flatten__` / `__tensor_unflatten__`, which keeps
the outer size and stride a trace gives), so Dynamo's fake copy of a device tensor is an NpuTensor
around a fake host tensor, and fake propagation goes through `NpuTensor.__torch_dispatch__`. Two
things meet there that never meet outside a trace:
- a device tensor made *inside* the traced code (`torch.ones(..., device=q.device)`, `.to("npu")`) is
  made by the fake (or functional) mode, not by the backend: a FakeTensor whose device is npu, not an
  NpuTensor. It is a device tensor, not a host tensor, for the device check (`traced_device_tensor`);
  the dispatch works on its host copy (`to_host`) and writes an in-place result back (`write_back`).
  This was the "found at least two devices, npu:0 and npu:0" error;
- the host tensors inside are fake or functional: no kernel runs, so none is counted (`tracing`).
The captured graph then has to run. There is no Inductor device backend for npu here, so when the
default "inductor" compiler is handed a graph that touches the npu device, it runs the graph Dynamo
captured as it is (the "eager" backend) and says so once on stderr (NOTE). Why that backend and not
aot_eager: AOTAutograd desugars a wrapper subclass into its inner tensors, so its graph would run on
the host tensors, past the device check and past the kernel count; the captured graph runs its ops on
real device tensors, so each still reaches NpuTensor's dispatch (checked, counted), and autograd is
eager autograd: losses and gradients equal eager's. Fused torch_npu APIs run whole, as a torch_npu op
does on an NPU, and count one kernel each (`_fused_apis_whole`, at the first torch.compile call: the
graph breaks around them). Graphs without npu tensors still go
to Inductor; a program that names another backend gets it (aot_eager runs, except a backward whose
gradient starts at a tensor made inside the graph: AOTAutograd then expects a plain tensor where the
device gives an NpuTensor).
Deviations a program can see: a frame is re-traced for new shapes rather than traced with symbolic
shapes (`_first_npu_graph`); a captured graph may launch a few kernels more or fewer than eager (Dynamo
unpacks `q, k, v = t` as three selects, whose backward differs from unbind's).
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.utils._pytree import tree_leaves

NOTE = "emulated npu: torch.compile runs the captured graph without Inductor (no NPU compiler here)"

_installed = False
_noted = False


def traced_device_tensor(a, device_type: type) -> bool:
    """A tensor on the npu device that is not a device tensor of the emulation: only a fake, meta-backed
    or functional tensor made while a graph is traced can be one."""
    return isinstance(a, torch.Tensor) and not isinstance(a, device_type) and a.device.type == "npu"


def to_host(a: torch.Tensor) -> torch.Tensor:
    """The host counterpart of a traced device tensor (a fake or functional copy: no data moves)."""
    return a.to("cpu")


def write_back(func, args, kwargs, converted) -> None:
    """After an in-place (or out=) op ran on the host copies of traced device tensors, copy the result
    into each traced device tensor the op writes, so the trace records the mutation where it belongs."""
    schema = func._schema.arguments
    written = [kwargs[p.name] if p.name in kwargs else args[i] if i < len(args) else None
               for i, p in enumerate(schema) if p.alias_info is not None and p.alias_info.is_write]
    for a, host in converted:
        if any(a is w for w in tree_leaves(written)):
            a.copy_(host)


def tracing(host: torch.Tensor) -> bool:
    """Whether a device tensor's host values are a tracer's stand-in (no kernel runs on them)."""
    if type(host) is torch.Tensor or type(host) is torch.nn.Parameter:
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return isinstance(host, (FakeTensor, FunctionalTensor)) or host.device.type == "meta"


def _on_npu(value) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "npu" for t in tree_leaves(value))


def touches_npu(gm: torch.fx.GraphModule, example_inputs) -> bool:
    """Whether a captured graph takes, makes or returns a tensor on the npu device."""
    if _on_npu(list(example_inputs)):
        return True
    if any(t.device.type == "npu" for t in (*gm.parameters(), *gm.buffers())):
        return True
    return any(_on_npu(node.meta.get("example_value")) or _on_npu(node.meta.get("val")) for node in gm.graph.nodes)


def _first_npu_graph() -> None:
    """Said once; and from now on a frame that meets new shapes is traced again for them rather than
    with symbolic shapes: Dynamo cannot bind the symbols it makes when it rebuilds a sliced view of a
    wrapper subclass (`x[:, 1:]` of a device tensor: "sources must not be empty for symbol"), and a
    graph run as captured gains nothing from symbolic shapes."""
    global _noted
    if not _noted:
        _noted = True
        torch._dynamo.config.automatic_dynamic_shapes = False
        print(NOTE, file=sys.stderr, flush=True)


def _fused_apis_whole() -> None:
    """Each fused torch_npu API (the counting wrappers `_kernel_count.count_fused` made) runs whole, as a
    torch_npu op does on an NPU, and counts one kernel: Dynamo would otherwise inline it into the host
    ops it is made of, and the graph would launch (and count) those one by one. It cannot be one node of
    the graph either (`allow_in_graph`): the emulated op reads values (the attention mask template),
    which fake tensors do not have. So the package's fused APIs become `torch.compiler.disable`d: the
    graph breaks around each call (a name imported from torch_npu before the first torch.compile call
    keeps the inlined form: same numerics, counted op by op)."""
    package = sys.modules.get(__name__.rpartition(".")[0])
    if package is None:
        return
    fused = {name: v for name, v in vars(package).items() if getattr(v, "__trainbridge_fused__", False)}
    if fused:
        import torch._dynamo

        for name, fn in fused.items():
            whole = torch._dynamo.disable(fn, reason="an emulated fused torch_npu API runs whole")
            whole.__trainbridge_fused__ = True
            setattr(package, name, whole)


def _wrap_compile(compile_fn):
    prepared = False

    @functools.wraps(compile_fn)
    def compile(*args, **kwargs):
        nonlocal prepared
        if not prepared:
            prepared = True
            _fused_apis_whole()
        return compile_fn(*args, **kwargs)

    compile.__wrapped__ = compile_fn
    return compile


def install() -> None:
    """Route the default compiler's npu graphs to the captured graph and keep fused APIs whole in it
    (idempotent). Only the class torch.compile builds for backend="inductor" and torch.compile itself
    are touched, and Dynamo is imported at the first torch.compile call: importing Dynamo or Inductor
    here would cost every emulated process seconds."""
    global _installed
    if _installed:
        return
    torch.compile = _wrap_compile(torch.compile)
    wrapper = torch._TorchCompileInductorWrapper
    inductor_call = wrapper.__call__

    def __call__(self, model_, inputs_, *args, **kwargs):
        if touches_npu(model_, inputs_):
            _first_npu_graph()
            return model_.forward
        return inductor_call(self, model_, inputs_, *args, **kwargs)

    __call__.__wrapped__ = inductor_call
    wrapper.__call__ = __call__
    _installed = True
