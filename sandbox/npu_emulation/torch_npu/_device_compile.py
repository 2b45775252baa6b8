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
eager autograd: losses and gradients equal eager's. Fused torch_npu APIs are one node each of the
captured graph, as a torch_npu op is on an NPU, and count one kernel each (`_fused_apis_in_graph`, at the
first torch.compile call, so `fullgraph=True` holds); the emulation's own code never becomes a frame Dynamo
compiles (`_skip_emulation_frames`), and the hccl collectives run whole, a graph break around each
(`_device_collectives.opaque_to_compile`, also under the npu -> cpu mapping, where Inductor compiles the host
tensors and the fused ops' host math, their checks of input values standing aside while traced). Graphs without
npu tensors still go
to Inductor; a program that names another backend gets it (aot_eager runs, except a backward whose
gradient starts at a tensor made inside the graph: AOTAutograd then expects a plain tensor where the
device gives an NpuTensor).
Deviations a program can see: a frame is re-traced for new shapes rather than traced with symbolic
shapes (`_first_npu_graph`); a captured graph may launch a few kernels more or fewer than eager (Dynamo
unpacks `q, k, v = t` as three selects, whose backward differs from unbind's); an int a fused API returns
(npu_fusion_attention's seed, offset, numels) is the trace's constant; a fused call's checks of its input values
(the compressed mask template, fully masked rows) run in eager code only.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.utils._pytree import tree_leaves, tree_map

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


def _fused_apis_in_graph() -> None:
    """Each fused torch_npu API (the counting wrappers `_kernel_count.count_fused` made) is one node of the
    captured graph, as a torch_npu op is on an NPU (`torch.ops.npu.*`, with a shape function): Dynamo would
    otherwise inline it into the host ops it is made of, and the graph would launch (and count) those one by one,
    or break the graph at the values the emulated op reads (the attention mask plan), which `fullgraph=True`
    refuses. So the package's fused APIs are `allow_in_graph`, by identity (a name a program imported from
    torch_npu before compiling is the same function), and a call on a tracer's fake tensors gets fake outputs
    from `_fake_call`. The captured graph calls the API on the device tensors: it runs whole and counts one
    kernel. Deviation: an int an API returns (npu_fusion_attention's seed, offset, numels) is the trace's
    constant, as Dynamo keeps ints from a call in the graph."""
    package = sys.modules.get(__name__.rpartition(".")[0])
    if package is None:
        return
    from . import _kernel_count

    _kernel_count.trace_call = _fake_call
    for fn in {id(v): v for v in vars(package).values() if getattr(v, "__trainbridge_fused__", False)}.values():
        torch.compiler.allow_in_graph(fn)


def _traced_leaf(t) -> bool:
    if not isinstance(t, torch.Tensor):
        return False
    host = getattr(t, "_host", None)
    return tracing(host if isinstance(host, torch.Tensor) else t)


def _fake_call(fn, args, kwargs):
    """The outputs of a fused call on a tracer's fake tensors: the call runs once on real zeros of the same shapes
    and dtypes (the emulated op needs values; its output shapes never depend on them; its checks of input values
    stand aside: `_checks.shapes_only`, as zeros are no causal mask template), with the NPU and host
    generators and the kernel count put back afterwards, and each result becomes a fake tensor of its shape,
    stride, dtype and device, tied to the inputs that require grad (as an op's output would be)."""
    leaves = tree_leaves((args, kwargs))
    if not any(_traced_leaf(t) for t in leaves):
        return _kernel_count_module().NOT_TRACED
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ._checks import shapes_only
    from ._generator import _generators

    mode = detect_fake_mode(leaves)
    with unset_fake_temporarily():
        counted = _kernel_count_module()._total
        real_args, real_kwargs = tree_map(_zeros_like, (args, kwargs))
        npu_states = {i: (g._seed, g._offset, g.ops_state.clone()) for i, g in _generators.items()}
        host_state = torch.default_generator.get_state()
        try:
            with shapes_only():
                out = fn(*real_args, **real_kwargs)
        finally:
            _kernel_count_module()._total = counted
            torch.default_generator.set_state(host_state)
            for i, (seed, offset, ops) in npu_states.items():
                _generators[i]._seed, _generators[i]._offset, _generators[i].ops_state = seed, offset, ops
    grads = [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]

    def fake(o):
        if not isinstance(o, torch.Tensor):
            return o
        with mode:
            f = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
            if o.requires_grad and grads:
                anchor = sum(g.sum() * 0 for g in grads)
                f = f + anchor.to(f.dtype)
        return f

    return tree_map(fake, out)


def _kernel_count_module():
    from . import _kernel_count

    return _kernel_count


def _zeros_like(t):
    """A real tensor of zeros for a fake one (a device tensor on the device), keeping requires_grad."""
    if isinstance(t, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(t)](t)
    if not isinstance(t, torch.Tensor):
        return t
    shape = [int(s) for s in t.shape]
    z = torch.zeros(shape, dtype=t.dtype, device=t.device)
    return z.requires_grad_() if t.requires_grad and (t.is_floating_point() or t.is_complex()) else z


def _codes(value, seen: set) -> list:
    """The code objects of a function, of a class's methods, and of the functions nested in them."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        return [c for f in (value.fget, value.fset, value.fdel) if f is not None for c in _codes(f, seen)]
    if isinstance(value, type):
        if value in seen:
            return []
        seen.add(value)
        return [c for member in vars(value).values() for c in _codes(member, seen)]
    code = getattr(getattr(value, "__wrapped__", value), "__code__", None)
    stack, out = [code] if code is not None else [], []
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        out.append(c)
        stack.extend(k for k in c.co_consts if hasattr(k, "co_consts"))
    return out


def _skip_emulation_frames() -> None:
    """Dynamo never traces the emulation's own code as a frame of its own. While a compiled frame runs, the ops
    its eager parts (around a graph break, in a resumed frame) launch on device tensors call back into Python
    (NpuTensor.__torch_dispatch__, the PrivateUse1 kernels, the device hooks), and Dynamo, whose frame hook is
    still set, would compile those frames as if they were the program's: it broke a graph inside NpuTensor.__new__
    (at torch.Tensor._make_wrapper_subclass) and resumed past it on a wrapper without its values ("'NpuTensor'
    object has no attribute '_host'", the Modded-NanoGPT records with fused rewrites under their own
    torch.compile), and re-compiled __torch_dispatch__'s helpers until its recompile limit. On an NPU those
    are C++ kernels Dynamo never sees: each code object of the package runs as it is, with everything it calls
    (a tracer that inlines a call into the package still traces it: only frames entered on their own are
    skipped)."""
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    prefix = __name__.rpartition(".")[0]
    seen: set = set()
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == prefix or module_name.startswith(prefix + ".")):
            continue
        for value in list(vars(module).values()):
            owner = getattr(value, "__module__", None) if not isinstance(value, (staticmethod, classmethod)) else \
                getattr(value.__func__, "__module__", None)
            if owner == module_name:
                for code in _codes(value, seen):
                    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP))


def _prepare_backend() -> None:
    _skip_emulation_frames()
    _fused_apis_in_graph()
    from ._device_collectives import opaque_to_compile

    opaque_to_compile()


def wrap_compile(prepare) -> None:
    """torch.compile, which calls `prepare()` once, at its first call (Dynamo is imported then, not at import)."""
    compile_fn = torch.compile
    prepared = False

    @functools.wraps(compile_fn)
    def compile(*args, **kwargs):
        nonlocal prepared
        if not prepared:
            prepared = True
            prepare()
        return compile_fn(*args, **kwargs)

    compile.__wrapped__ = compile_fn
    torch.compile = compile


def install() -> None:
    """Route the default compiler's npu graphs to the captured graph and keep fused APIs whole in it
    (idempotent). Only the class torch.compile builds for backend="inductor" and torch.compile itself
    are touched, and Dynamo is imported at the first torch.compile call: importing Dynamo or Inductor
    here would cost every emulated process seconds."""
    global _installed
    if _installed:
        return
    wrap_compile(_prepare_backend)
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
