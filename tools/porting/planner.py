"""Pass 1 of a port: read the original tree and decide what to rewrite and what to report.

Decisions are keyed by node identity (the tree is kept alive until `apply.Applier` has run), so
the rewrite pass is mechanical and every change carries the original file:line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import libcst as cst
from libcst.metadata import ParentNodeProvider, PositionProvider, QualifiedNameProvider

from trainbridge.tools.porting import npu_surface as surface
from trainbridge.tools.porting.fp8 import plan_fp8
from trainbridge.tools.porting.triton_kernels import plan_triton
from trainbridge.tools.porting.results import ChangeKind, PortChange, SkipCategory, Skipped
from trainbridge.tools.porting.rules import (
    BACKEND_MODULES,
    COMPILE_MODES,
    CUDA_MODULES,
    FSTRING_DEVICE_HEAD,
    amp_verdict,
    convert_string,
    dotted,
    dotted_expr,
    member_verdict,
)

@dataclass
class Plan:
    names: dict[int, str] = field(default_factory=dict)  # Name node -> new identifier
    attrs: dict[int, str] = field(default_factory=dict)  # Attribute node -> new .attr
    exprs: dict[int, object] = field(default_factory=dict)  # node -> replacement node/sentinel, or fn(updated node)
    strings: dict[int, str] = field(default_factory=dict)  # SimpleString -> new code; FormattedStringText -> new text
    needs_npu_first: set[int] = field(default_factory=set)  # statements that need torch_npu imported before them
    statement_lines: dict[int, int] = field(default_factory=dict)  # top-level statement -> original line
    changes: list[PortChange] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)


@dataclass
class _Binding:
    """A local name bound to torch.cuda / torch.cuda.amp by an import, rewritten only if every use ports."""

    local: str
    statement: cst.CSTNode  # the Import/ImportFrom
    line: int
    apply: list[tuple[str, int, object]]  # ("names"|"exprs", node id, value) to apply when all uses port
    change: PortChange
    rename_refs: bool  # `from torch import cuda` (no alias): uses are renamed cuda -> npu


class Planner(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, relpath: str, module: cst.Module, code: str) -> None:
        super().__init__()
        self.relpath, self.module, self.lines = relpath, module, code.splitlines()
        self.plan = Plan()
        self._bindings: list[_Binding] = []
        self._refs: dict[str, list[tuple[cst.Name, int, bool, str]]] = {}  # local -> (node, line, ok, before)
        self._triton_kernels: set[str] = set()
        self._seen: set[tuple[int, SkipCategory, str]] = set()

    # -- helpers ----------------------------------------------------------------------------------

    def _line(self, node: cst.CSTNode) -> int:
        return self.get_metadata(PositionProvider, node).start.line

    def _qnames(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def _parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.get_metadata(ParentNodeProvider, node, None)

    def _code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def _skip(self, node: cst.CSTNode, category: SkipCategory, reason: str, *, blocking: bool = True,
              line: int | None = None) -> None:
        line = line or self._line(node)
        if (line, category, reason) in self._seen:
            return
        self._seen.add((line, category, reason))
        construct = self.lines[line - 1].strip() if line <= len(self.lines) else self._code(node).splitlines()[0]
        self.plan.skipped.append(Skipped(file=self.relpath, line=line, category=category, code=construct[:200],
                                         reason=reason, blocking=blocking))

    def _change(self, node: cst.CSTNode, kind: ChangeKind, before: str, after: str) -> PortChange:
        change = PortChange(file=self.relpath, line=self._line(node), kind=kind, before=before, after=after)
        self.plan.changes.append(change)
        return change

    def _outer_attribute(self, node: cst.CSTNode) -> cst.CSTNode:
        """The longest attribute chain `node.a.b...` that starts at `node`."""
        while isinstance(parent := self._parent(node), cst.Attribute) and parent.value is node:
            node = parent
        return node

    def _member_of(self, node: cst.CSTNode) -> tuple[str | None, cst.CSTNode]:
        parent = self._parent(node)
        if isinstance(parent, cst.Attribute) and parent.value is node:
            return parent.attr.value, parent
        return None, node

    # -- module structure --------------------------------------------------------------------------

    def visit_Module(self, node: cst.Module) -> None:
        for statement in node.body:
            self.plan.statement_lines[id(statement)] = self._line(statement)

    def leave_Module(self, original_node: cst.Module) -> None:
        for binding in self._bindings:
            refs = self._refs.pop(binding.local, [])
            bad = sorted({line for _, line, ok, _ in refs if not ok})
            if bad:
                where = ", ".join(str(line) for line in bad)
                self._skip(binding.statement, SkipCategory.cuda_api,
                           f"left unchanged: `{binding.local}` is also used at line(s) {where} for something torch.npu "
                           "lacks (reported there); port those uses by hand, then this import", line=binding.line)
                continue
            for table, key, value in binding.apply:
                getattr(self.plan, table)[key] = value
            self.plan.changes.append(binding.change)
            if binding.rename_refs:
                for ref, line, _, before in refs:
                    self.plan.names[id(ref)] = "npu"
                    self.plan.changes.append(PortChange(file=self.relpath, line=line, kind=ChangeKind.device_module,
                                                        before=before, after="npu" + before[len(binding.local):]))
        for refs in self._refs.values():  # bound some other way (assignment, star import): not ours to rename
            for ref, line, ok, before in refs:
                if ok:
                    self._skip(ref, SkipCategory.cuda_api, f"`{before}` reaches torch.cuda through a name TrainBridge "
                               "did not bind by import; replace it with torch.npu by hand", line=line)
        plan_fp8(self)  # FP8 ops -> bf16 (fp8.py)
        plan_triton(self)  # Triton launches -> the PyTorch ops their kernels compute (triton_kernels.py)

    # -- imports -----------------------------------------------------------------------------------

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            name = dotted(alias.name)
            if self._third_party(node, name):
                continue
            if name in CUDA_MODULES and alias.asname is not None:
                local = dotted(alias.asname.name)
                after = f"import {CUDA_MODULES[name]} as {local}"
                self._bind(node, local, [("exprs", id(alias.name), dotted_expr(CUDA_MODULES[name]))],
                           ChangeKind.import_rewrite, f"import {name} as {local}", after, rename_refs=False)
            elif name.startswith("torch.cuda."):
                parts = name.split(".")
                verdict = amp_verdict(parts[3] if len(parts) > 3 else None) if parts[2] == "amp" else member_verdict(parts[2])
                if verdict:
                    self._skip(node, *verdict)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.relative:
            return False
        module = dotted(node.module)
        if self._third_party(node, module):
            return False
        aliases = [] if isinstance(node.names, cst.ImportStar) else list(node.names)
        if module in CUDA_MODULES:
            if not aliases:
                self._skip(node, SkipCategory.cuda_api, f"`from {module} import *`: import the names you use from "
                           f"{CUDA_MODULES[module]} instead")
                return False
            check = member_verdict if module == "torch.cuda" else amp_verdict
            verdicts = [(alias, check(alias.name.value)) for alias in aliases]
            for alias, verdict in verdicts:
                if verdict:
                    self._skip(node, *verdict)
            if any(v for _, v in verdicts):
                return False
            new_module = CUDA_MODULES[module]
            before = self._code(node).splitlines()[0]
            after = before.replace(f"from {module} ", f"from {new_module} ", 1)
            module_bound = [a for a in aliases if module == "torch.cuda" and a.name.value == "amp"]
            if module_bound:  # `from torch.cuda import amp`: every use of the name must port too
                local = dotted(module_bound[0].asname.name) if module_bound[0].asname else "amp"
                self._bind(node, local, [("exprs", id(node.module), dotted_expr(new_module))],
                           ChangeKind.import_rewrite, before, after, rename_refs=False)
            else:
                self.plan.exprs[id(node.module)] = dotted_expr(new_module)
                self._change(node, ChangeKind.import_rewrite, before, after)
        elif module.startswith("torch.cuda."):
            parts = module.split(".")
            verdict = (SkipCategory.cuda_api, f"import from {CUDA_MODULES['torch.cuda.amp']} instead") \
                if parts[2] == "amp" else member_verdict(parts[2])
            if verdict:
                self._skip(node, *verdict)
            else:
                self.plan.exprs[id(node.module)] = dotted_expr("torch_npu.npu." + ".".join(parts[2:]))
                self._change(node, ChangeKind.import_rewrite, f"from {module}", "from torch_npu.npu." + ".".join(parts[2:]))
        elif module == "torch":
            for alias in aliases:
                if alias.name.value == "cuda":
                    local = dotted(alias.asname.name) if alias.asname else "cuda"
                    before = "from torch import cuda" + (f" as {local}" if alias.asname else "")
                    self._bind(node, local, [("names", id(alias.name), "npu")], ChangeKind.import_rewrite, before,
                               before.replace("import cuda", "import npu"), rename_refs=alias.asname is None)
                    statement = self._parent(node)
                    if statement is not None:
                        self.plan.needs_npu_first.add(id(statement))
        return False

    def _third_party(self, node: cst.CSTNode, module: str) -> bool:
        top = module.split(".")[0]
        if top == "triton":
            self._skip(node, SkipCategory.triton, surface.TRITON_REASON)
        elif top.startswith("flash_attn"):
            self._skip(node, SkipCategory.flash_attn, surface.FLASH_ATTN_REASON)
        elif top == "kernels":
            self._skip(node, SkipCategory.kernels_hub, surface.KERNELS_HUB_REASON)
        else:
            return False
        return True

    def _bind(self, node: cst.CSTNode, local: str, apply: list, kind: ChangeKind, before: str, after: str, *,
              rename_refs: bool) -> None:
        change = PortChange(file=self.relpath, line=self._line(node), kind=kind, before=before, after=after)
        self._bindings.append(_Binding(local, node, self._line(node), apply, change, rename_refs))

    # -- names and attributes ----------------------------------------------------------------------

    def visit_Name(self, node: cst.Name) -> None:
        qnames = self._qnames(node)
        if qnames & CUDA_MODULES.keys():
            amp = "torch.cuda.amp" in qnames
            member, outer = self._member_of(node)
            if not amp and member == "amp":
                member2, outer2 = self._member_of(outer)
                verdict, outer = amp_verdict(member2), outer2
            else:
                verdict = amp_verdict(member) if amp else member_verdict(member)
            if verdict:
                self._skip(outer, *verdict)
            self._refs.setdefault(node.value, []).append((node, self._line(node), verdict is None, self._code(outer)))
        else:
            self._check_qualified(node, qnames)

    def visit_Attribute(self, node: cst.Attribute) -> None:
        qnames = self._qnames(node)
        if "torch.cuda" in qnames:
            self._cuda_module(node)
        elif "torch.distributed.Backend.NCCL" in qnames:
            self.plan.attrs[id(node)] = "HCCL"
            before = self._code(node)
            self._change(node, ChangeKind.dist_backend, before, before[: -len("NCCL")] + "HCCL")
        elif "torch.version.cuda" in qnames:
            self._skip(node, SkipCategory.cuda_api, surface.VERSION_CUDA_REASON, blocking=False)
        elif node.attr.value == "is_cuda" and not any(q.startswith("torch.") for q in qnames):
            self.plan.attrs[id(node)] = "is_npu"
            before = self._code(node)
            self._change(node, ChangeKind.to_npu_method, before, before[: -len("is_cuda")] + "is_npu")
        else:
            self._check_qualified(node, qnames)

    def _cuda_module(self, node: cst.Attribute) -> None:
        member, outer = self._member_of(node)
        if member == "amp":
            member2, outer2 = self._member_of(outer)
            verdict, outer = amp_verdict(member2), outer2
        else:
            verdict = member_verdict(member)
        if verdict:
            self._skip(outer, *verdict)
            return
        self.plan.attrs[id(node)] = "npu"
        before, module_code = self._code(outer), self._code(node)
        self._change(outer, ChangeKind.device_module, before, module_code[: -len("cuda")] + "npu" + before[len(module_code):])

    def _check_qualified(self, node: cst.CSTNode, qnames: set[str]) -> None:
        backend = next((m for m in BACKEND_MODULES if m in qnames), None)
        if backend:
            member, _ = self._member_of(node)
            hint = surface.BACKEND_FLAG_HINTS.get(member or "", "it configures a CUDA library that does not exist on "
                                                  "the NPU; check what the code relies on")
            self._skip(self._outer_attribute(node), SkipCategory.backend_flag,
                       f"`{backend}.{member or ''}` has no NPU equivalent: {hint}", blocking=False)
        elif "torch._scaled_mm" in qnames or any(q.startswith(("torch.float8_", "torch.float4_")) for q in qnames):
            self._skip(node, SkipCategory.fp8, surface.FP8_REASON)

    # -- calls, decorators, strings ------------------------------------------------------------------

    def visit_Call(self, node: cst.Call) -> None:
        func = node.func
        qnames = self._qnames(func)
        if "torch.compile" in qnames:
            self._check_compile(node, node.args)
        elif any(q.startswith("torch.optim.") for q in qnames) and any(
                a.keyword is not None and a.keyword.value == "fused" and isinstance(a.value, cst.Name) and a.value.value == "True"
                for a in node.args):
            self._fused_optimizer(node)
        elif qnames & {"torch.utils.cpp_extension.load", "torch.utils.cpp_extension.load_inline"}:
            self._check_extension(node)
        elif "torch.utils.cpp_extension.CUDAExtension" in qnames:
            self._skip(node, SkipCategory.cuda_extension, surface.CUDA_EXTENSION_REASON)
        elif "torch.nn.attention.sdpa_kernel" in qnames:
            self._skip(node, SkipCategory.backend_flag, "`torch.nn.attention.sdpa_kernel` has no NPU equivalent: "
                       + surface.BACKEND_FLAG_HINTS["sdp_kernel"], blocking=False)
        elif any(q.split(".")[0].startswith("flash_attn") for q in qnames):
            self._skip(node, SkipCategory.flash_attn, surface.FLASH_ATTN_REASON)
        elif any(q.split(".")[0] == "kernels" for q in qnames):
            self._skip(node, SkipCategory.kernels_hub, surface.KERNELS_HUB_REASON)
        elif isinstance(func, cst.Subscript) and dotted(func.value) in self._triton_kernels:
            self._skip(node, SkipCategory.triton, f"launch of Triton kernel `{dotted(func.value)}`: "
                       + surface.TRITON_REASON)
        elif isinstance(func, cst.Attribute) and func.attr.value == "cuda" and "torch.cuda" not in qnames:
            self.plan.attrs[id(func)] = "npu"
            before = self._code(func)
            self._change(node, ChangeKind.to_npu_method, before + "(...)", before[: -len("cuda")] + "npu(...)")

    def _fused_optimizer(self, node: cst.Call) -> None:
        """`fused=True` asks for the CUDA fused kernels: the port makes it `foreach=True` (multi-tensor updates, the same
        math on any device; `fused=False` where the call already says foreach), and the loop's recipes take it to
        torch_npu's NpuFused* optimizers with their numerics checked."""
        has_foreach = any(a.keyword is not None and a.keyword.value == "foreach" for a in node.args)
        for arg in node.args:
            if arg.keyword is not None and arg.keyword.value == "fused":
                after = arg.with_changes(value=cst.Name("False")) if has_foreach else \
                    arg.with_changes(keyword=cst.Name("foreach"))
                self.plan.exprs[id(arg)] = after
                self._change(node, ChangeKind.fused_optimizer, self._code(arg).strip().rstrip(","),
                             "fused=False" if has_foreach else "foreach=True")

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        for decorator in node.decorators:
            target = decorator.decorator
            qnames = self._qnames(target.func if isinstance(target, cst.Call) else target)
            if any(q.split(".")[0] == "triton" for q in qnames):
                self._triton_kernels.add(node.name.value)
                self._skip(decorator, SkipCategory.triton, f"Triton kernel `{node.name.value}`: " + surface.TRITON_REASON)
                break
            if "torch.compile" in qnames and not isinstance(target, cst.Call):
                self._check_compile(decorator, ())

    def _check_compile(self, node: cst.CSTNode, args) -> None:
        kwargs = {a.keyword.value: a.value for a in args if a.keyword is not None}
        backend = kwargs.get("backend")
        value = backend.evaluated_value if isinstance(backend, cst.SimpleString) else None
        if backend is None or value == "inductor":
            said = "without backend= uses Inductor" if backend is None else "with backend='inductor'"
            self._skip(node, SkipCategory.compile, f"torch.compile {said}: " + surface.COMPILE_INDUCTOR_REASON)
        elif value == "cudagraphs":
            self._skip(node, SkipCategory.compile, "torch.compile backend='cudagraphs' records CUDA graphs. "
                       + surface.CUDA_GRAPH_REASON)
        mode = kwargs.get("mode")
        if isinstance(mode, cst.SimpleString) and mode.evaluated_value in COMPILE_MODES:
            self._skip(node, SkipCategory.compile, surface.COMPILE_MODE_REASON.format(mode=mode.evaluated_value),
                       blocking=False)

    def _check_extension(self, node: cst.Call) -> None:
        """load(name, sources, ...) with .cu files, load_inline(name, cpp_sources, cuda_sources, ...), with_cuda=True."""
        kwargs = {a.keyword.value: a.value for a in node.args if a.keyword is not None}
        positional = [a.value for a in node.args if a.keyword is None]
        inline = "torch.utils.cpp_extension.load_inline" in self._qnames(node.func)
        if inline and len(positional) > 2:
            kwargs.setdefault("cuda_sources", positional[2])
        sources = kwargs.get("sources", positional[1] if len(positional) > 1 and not inline else None)
        files = [e.value.evaluated_value for e in getattr(sources, "elements", [])
                 if isinstance(e.value, cst.SimpleString)]
        given = {k for k in ("cuda_sources", "extra_cuda_cflags")
                 if k in kwargs and not (isinstance(kwargs[k], cst.Name) and kwargs[k].value == "None")}
        with_cuda = isinstance(kwargs.get("with_cuda"), cst.Name) and kwargs["with_cuda"].value == "True"
        if any(str(f).endswith((".cu", ".cuh")) for f in files) or given or with_cuda:
            self._skip(node, SkipCategory.cuda_extension, surface.CUDA_EXTENSION_REASON)

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        value = node.evaluated_value
        if isinstance(value, str) and "nvidia-smi" in value:
            if not self._smi_command(node):
                self._skip(node, SkipCategory.cuda_api, surface.NVIDIA_SMI_REASON)
        converted = convert_string(value) if isinstance(value, str) else None
        if converted:
            kind, new = converted
            code = f"{node.prefix}{node.quote}{new}{node.quote}"
            self.plan.strings[id(node)] = code
            self._change(node, kind, node.value, code)

    def _smi_command(self, node: cst.SimpleString) -> bool:
        """`["nvidia-smi"]` as a call's first argument (`subprocess.run(["nvidia-smi"], stdout=...)`, which the
        Modded-NanoGPT records log): npu-smi's overview where npu-smi exists, else a no-op that says so, so the ported
        program runs on an Ascend host and under the emulation. Other nvidia-smi uses (queries, a shell string) are
        reported: their output format has no NPU counterpart."""
        element = self._parent(node)
        listed = self._parent(element) if isinstance(element, cst.Element) else None
        arg = self._parent(listed) if isinstance(listed, cst.List) and len(listed.elements) == 1 else None
        call = self._parent(arg) if isinstance(arg, cst.Arg) and arg.keyword is None else None
        if node.evaluated_value != "nvidia-smi" or not isinstance(call, cst.Call) or call.args[0] is not arg:
            return False
        self.plan.exprs[id(listed)] = cst.parse_expression(surface.SMI_COMMAND)
        self._change(node, ChangeKind.smi_command, self._code(listed), surface.SMI_COMMAND)
        return True

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        head = node.parts[0] if node.parts else None
        rest = node.parts[1:]
        if (isinstance(head, cst.FormattedStringText) and FSTRING_DEVICE_HEAD.fullmatch(head.value)
                and (not rest or isinstance(rest[0], cst.FormattedStringExpression))):
            self.plan.strings[id(head)] = "npu" + head.value[4:]
            before = self._code(node)
            self._change(node, ChangeKind.device_string, before, before.replace(head.value, "npu" + head.value[4:], 1))
