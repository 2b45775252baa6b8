"""GPU-only attention carried to the NPU by the port: FlexAttention block masks, flash-attn and the FA3 hub kernel.

Runs after the `Planner` on the same tree and adds to its `Plan`:
- `create_block_mask(mask_mod, ...)` and `BlockMask.from_kv_blocks(..., mask_mod=...)` whose mask_mod
  attention_masks.py can read (causal, sliding window, documents) become `_tb_npu_mask(...)` /
  `_tb_npu_kv_block_mask(...)`, and `flex_attention(...)` becomes `_tb_npu_flex_attention(...)`;
  in a file where some mask cannot be carried, every FlexAttention site is left and reported;
- `flash_attn_func` / `flash_attn_varlen_func` of `flash_attn`, of FA3's `flash_attn_interface`, and
  of a FlashAttention kernel loaded with `kernels.get_kernel(...)`, become `_tb_npu_flash_attn(...)` /
  `_tb_npu_flash_attn_varlen(...)` (the hub object itself `_TbNpuFlashAttention3`);
- top-level imports of flash_attn / flash_attn_interface / kernels whose every use was carried are removed.
The helpers (attention_helpers.py) are written into the file after its imports by `insert_helpers`.
Each carried site is a PortChange with the precision/behaviour note that applies to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from libcst.metadata import CodeRange, ParentNodeProvider, PositionProvider, QualifiedNameProvider

from trainbridge.tools.porting.apply import TORCH_NPU_IMPORT
from trainbridge.tools.porting.attention_masks import MaskSpec, NotCarried, read_mask_mod
from trainbridge.tools.porting.planner import Plan
from trainbridge.tools.porting.results import ChangeKind, PortChange, SkipCategory, Skipped

FLEX = "torch.nn.attention.flex_attention."
FLASH_MODULES = ("flash_attn", "flash_attn_interface")
FLASH_FUNCS = {"flash_attn_func": "_tb_npu_flash_attn", "flash_attn_varlen_func": "_tb_npu_flash_attn_varlen"}
FLASH_KEYWORDS = {"softmax_scale", "causal", "window_size", "dropout_p", "deterministic", "cu_seqlens_q",
                  "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"}
FLASH_POSITIONAL = {"flash_attn_func": 3, "flash_attn_varlen_func": 7}
HUB_FLASH = re.compile(r"flash[-_]?attn|flash[-_]attention", re.IGNORECASE)
HUB_CLASS = "_TbNpuFlashAttention3"
HELPERS_FILE = Path(__file__).with_name("attention_helpers.py")
HELPERS_HEADER = "# --- trainbridge port --to npu: FlexAttention / flash-attn on torch_npu.npu_fusion_attention ---"
HELPER_NAMES = re.compile(r"\b(_tb_npu_|_TbNpu)\w*")
FIRST_HELPER = "_tb_npu_band_attention"

FLEX_NOTE = ("npu_fusion_attention: scale 1/sqrt(D) passed (its default is 1.0); causal = sparse_mode 2 (top-left, "
             "as q_idx >= kv_idx); window W = sparse_mode 4 with pre_tockens=W-1, next_tockens=0; documents = "
             "input_layout TND with one sequence per run of equal ids (batch size 1). Precision: the NPU kernel's "
             "accumulation order differs from FlexAttention's; bf16 outputs differ in the last bits")
COMPILE_NOTE = " Inside torch.compile such a host read is a graph break (an error with fullgraph=True: drop fullgraph)"
FULLGRAPH_NOTE = ("the attention carried to npu_fusion_attention reads window sizes and sequence boundaries on the "
                  "host (graph breaks), which fullgraph=True refuses; the compiled model runs as more than one graph")
MASK_NOTE = ("read when the mask is built, as create_block_mask does: a tensor window and the document boundaries "
             "are copied to the host there (one device sync per mask, not per layer)." + COMPILE_NOTE)
KV_BLOCK_NOTE = ("behaviour change: the block-granular window of BlockMask.from_kv_blocks becomes a token window of "
                 "(most KV blocks a query block reads) x BLOCK_SIZE tokens (or the mask_mod's own window where that is "
                 "smaller), read on the host when the mask is built; a query near the start of a block may see up to "
                 "BLOCK_SIZE-1 more past keys than under FlexAttention. The mask_mod's causal/document terms are "
                 "exact." + COMPILE_NOTE)
FLASH_NOTE = ("npu_fusion_attention: scale = softmax_scale or 1/sqrt(D); causal = sparse_mode 3 (bottom-right, as "
              "flash-attn); window_size=(w, 0) = sparse_mode 4 with pre_tockens=w, next_tockens=0; returns the "
              "attention output only (FA3 builds that return (out, lse) differ); dropout_p becomes keep_prob with "
              "the NPU's own random masks; deterministic is ignored")
VARLEN_NOTE = ("; varlen: input_layout TND with actual_seq_qlen/kvlen = cu_seqlens[1:] read on the host (one device "
               "sync per call), empty sequences dropped, tokens after the last offset attended as one more sequence "
               "(flash-attn leaves them unset)." + COMPILE_NOTE)
CARRY_HINT = ("npu_fusion_attention expresses causal (sparse_mode 2/3), sliding windows (sparse_mode 4 with "
              "pre_tockens/next_tockens) and documents (input_layout TND); write the mask_mod as a conjunction of "
              "`q_idx >= kv_idx`, `q_idx - kv_idx < W` and `docs[q_idx] == docs[kv_idx]`, or call "
              "torch_npu.npu_fusion_attention by hand with an explicit atten_mask (True = excluded, sparse_mode=0)")


@dataclass
class _Site:
    call: cst.Call
    line: int
    span: CodeRange
    replacement: cst.BaseExpression | None = None  # None: only the callee is renamed
    target: cst.CSTNode | None = None  # the node replaced (the call, its callee, or the hub expression)
    kind: ChangeKind = ChangeKind.flex_attention
    note: str = ""
    problem: str | None = None  # why it cannot be carried


@dataclass
class _Import:
    statement: cst.CSTNode  # Import / ImportFrom
    top_level: bool
    line: int
    locals: list[str]


@dataclass
class AttentionPlan:
    needs_helpers: bool = False
    removed_import_lines: set[int] = field(default_factory=set)


class AttentionPlanner(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider, QualifiedNameProvider, ParentNodeProvider)

    def __init__(self, relpath: str, module: cst.Module, code: str, plan: Plan) -> None:
        super().__init__()
        self.relpath, self.module, self.lines, self.plan = relpath, module, code.splitlines(), plan
        self.result = AttentionPlan()
        self.masks: list[_Site] = []
        self.flex: list[_Site] = []
        self.flash: list[_Site] = []
        self.hub: dict[str, _Site] = {}  # local name bound to a hub kernel -> its site
        self.hub_sites: list[_Site] = []
        self.attr_calls: list[tuple[cst.Call, str, str]] = []  # (call, root name, function)
        self.imports: list[_Import] = []
        self.names: list[tuple[str, CodeRange]] = []
        self.carried_spans: list[CodeRange] = []
        self.compiles: list[cst.Name] = []  # the `True` of torch.compile(..., fullgraph=True)

    # -- helpers -------------------------------------------------------------------------------

    def _span(self, node: cst.CSTNode) -> CodeRange:
        return self.get_metadata(PositionProvider, node)

    def _qnames(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in self.get_metadata(QualifiedNameProvider, node, set())}

    def _parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self.get_metadata(ParentNodeProvider, node, None)

    def _code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def _site(self, call: cst.Call, **kw) -> _Site:
        span = self._span(call)
        return _Site(call=call, line=span.start.line, span=span, **kw)

    # -- collection ----------------------------------------------------------------------------

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            name = self._code(alias.name)
            if name.split(".")[0] in FLASH_MODULES + ("kernels",):
                local = self._code(alias.asname.name) if alias.asname else name.split(".")[0]
                self._add_import(node, [local])
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.relative or node.module is None:
            return False
        module = self._code(node.module)
        if module.split(".")[0] in FLASH_MODULES + ("kernels",) and not isinstance(node.names, cst.ImportStar):
            self._add_import(node, [self._code(a.asname.name if a.asname else a.name) for a in node.names])
        return False

    def _add_import(self, node: cst.CSTNode, local: list[str]) -> None:
        line = self._parent(node)
        top = isinstance(line, cst.SimpleStatementLine) and len(line.body) == 1 and isinstance(self._parent(line), cst.Module)
        self.imports.append(_Import(node, top, self._span(node).start.line, local))

    def visit_Name(self, node: cst.Name) -> None:
        self.names.append((node.value, self._span(node)))

    def visit_Call(self, node: cst.Call) -> None:
        qnames = self._qnames(node.func)
        if FLEX + "flex_attention" in qnames:
            self.flex.append(self._flex_call(node))
        elif FLEX + "create_block_mask" in qnames:
            self.masks.append(self._mask_call(node, kv_blocks=False))
        elif FLEX + "BlockMask.from_kv_blocks" in qnames:
            self.masks.append(self._mask_call(node, kv_blocks=True))
        elif "torch.compile" in qnames and any(a.keyword is None for a in node.args):  # compile(model), no decorator
            self.compiles.extend(a.value for a in node.args if a.keyword is not None and a.keyword.value == "fullgraph"
                                 and isinstance(a.value, cst.Name) and a.value.value == "True")
        elif "kernels.get_kernel" in qnames:
            self._hub_call(node)
        elif any(q.split(".")[0] in FLASH_MODULES for q in qnames):
            name = next(q for q in qnames if q.split(".")[0] in FLASH_MODULES)
            self.flash.append(self._flash_call(node, name.split(".")[-1], name))
        elif isinstance(node.func, cst.Attribute) and node.func.attr.value in FLASH_FUNCS:
            root = node.func.value
            while isinstance(root, cst.Attribute):
                root = root.value
            if isinstance(root, cst.Name):
                self.attr_calls.append((node, root.value, node.func.attr.value))

    # -- FlexAttention -------------------------------------------------------------------------

    def _flex_call(self, call: cst.Call) -> _Site:
        site = self._site(call, target=call.func, replacement=cst.Name("_tb_npu_flex_attention"),
                          kind=ChangeKind.flex_attention, note=FLEX_NOTE)
        positional = [a for a in call.args if a.keyword is None]
        if any(a.star for a in call.args) or len(positional) > 3:
            site.problem = "flex_attention with *args or a score_mod/block_mask passed by position"
        for arg in call.args:
            key = arg.keyword.value if arg.keyword else None
            if key == "score_mod" and self._code(arg.value) != "None":
                site.problem = "flex_attention with a score_mod (npu_fusion_attention has no score hook; pse adds a bias)"
            if key == "return_lse" and self._code(arg.value) != "False":
                site.problem = "flex_attention with return_lse (npu_fusion_attention's softmax_max/sum are max and sum, not lse)"
        return site

    def _mask_mod_def(self, call: cst.Call, name: str) -> cst.FunctionDef | None:
        node: cst.CSTNode | None = call
        while node is not None:
            if isinstance(node, (cst.FunctionDef, cst.Module)):
                body = node.body if isinstance(node, cst.Module) else getattr(node.body, "body", [])
                for statement in body:
                    if isinstance(statement, cst.FunctionDef) and statement.name.value == name:
                        return statement
            node = self._parent(node)
        return None

    def _mask_call(self, call: cst.Call, kv_blocks: bool) -> _Site:
        site = self._site(call, target=call, kind=ChangeKind.flex_block_mask)
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        positional = [a.value for a in call.args if a.keyword is None and not a.star]
        mod = keywords.get("mask_mod", positional[0] if positional and not kv_blocks else None)
        what = "BlockMask.from_kv_blocks" if kv_blocks else "create_block_mask"
        if not isinstance(mod, cst.Name):
            site.problem = f"{what} without a mask_mod named by a def in scope"
            return site
        func = self._mask_mod_def(call, mod.value)
        if func is None:
            site.problem = f"mask_mod `{mod.value}` is not a def in an enclosing scope of this {what}"
            return site
        try:
            spec = read_mask_mod(self.module, func)
        except NotCarried as exc:
            site.problem = f"{exc} (mask_mod `{mod.value}`, line {self._span(func).start.line})"
            return site
        if kv_blocks:
            site.replacement, site.problem = self._kv_blocks_call(call, positional, keywords, spec)
            site.note = KV_BLOCK_NOTE
        else:
            window = f", window={spec.window}" if spec.window else ""
            docs = f", docs={spec.docs}" if spec.docs else ""
            site.replacement = cst.parse_expression(f"_tb_npu_mask({spec.causal}{window}{docs})")
            site.note = MASK_NOTE
        return site

    def _kv_blocks_call(self, call, positional, keywords, spec: MaskSpec):
        if any(a.star for a in call.args):
            return None, "BlockMask.from_kv_blocks with *args"
        if not spec.causal:
            return None, "BlockMask.from_kv_blocks whose mask_mod is not causal (its block counts are read as a causal window)"
        num = keywords.get("kv_num_blocks", positional[0] if positional else None)
        full = keywords.get("full_kv_num_blocks", positional[2] if len(positional) > 2 else None)
        size = keywords.get("BLOCK_SIZE", keywords.get("KV_BLOCK_SIZE", positional[4] if len(positional) > 4 else None))
        if "Q_BLOCK_SIZE" in keywords and size is not None and self._code(keywords["Q_BLOCK_SIZE"]) != self._code(size):
            return None, "BlockMask.from_kv_blocks with different query and key block sizes"
        if num is None:
            return None, "BlockMask.from_kv_blocks without kv_num_blocks"
        args = [self._code(num), self._code(full) if full is not None else "None",
                self._code(size) if size is not None else "128", "True"]
        window = f", window={spec.window}" if spec.window else ""
        docs = f", docs={spec.docs}" if spec.docs else ""
        return cst.parse_expression(f"_tb_npu_kv_block_mask({', '.join(args)}{window}{docs})"), None

    # -- flash-attn and the kernels hub --------------------------------------------------------------

    def _flash_call(self, call: cst.Call, func: str, qname: str) -> _Site:
        site = self._site(call, target=call.func, kind=ChangeKind.flash_attention)
        if func not in FLASH_FUNCS:
            site.problem = (f"`{qname}` has no NPU port in trainbridge (flash_attn_func and flash_attn_varlen_func "
                            "do): call torch_npu.npu_fusion_attention by hand (split packed qkv; BSND/TND layouts)")
            return site
        site.replacement = cst.Name(FLASH_FUNCS[func])
        site.note = FLASH_NOTE + (VARLEN_NOTE if func == "flash_attn_varlen_func" else "")
        positional = [a for a in call.args if a.keyword is None]
        unknown = sorted({a.keyword.value for a in call.args if a.keyword is not None} - FLASH_KEYWORDS)
        if any(a.star for a in call.args):
            site.problem = f"`{func}` called with *args/**kwargs: the port cannot see which options are set"
        elif len(positional) > FLASH_POSITIONAL[func]:
            site.problem = (f"`{func}` with options passed by position (flash-attn 2 and 3 order them differently): "
                            "pass them by keyword")
        elif unknown:
            site.problem = (f"`{func}` with {', '.join(unknown)}: npu_fusion_attention has no such option (softcap, "
                            "alibi_slopes, return_attn_probs, seqused_*, descale, ...); port this call by hand")
        return site

    def _hub_call(self, call: cst.Call) -> None:
        repo = call.args[0].value if call.args else None
        name = repo.evaluated_value if isinstance(repo, cst.SimpleString) else None
        if not isinstance(name, str) or not HUB_FLASH.search(name):
            return  # another hub kernel: the planner's kernels_hub report stands
        outer: cst.CSTNode = call
        parent = self._parent(call)
        if isinstance(parent, cst.Attribute) and parent.value is call and parent.attr.value == "flash_attn_interface":
            outer = parent
        site = self._site(call, target=outer, replacement=cst.Name(HUB_CLASS), kind=ChangeKind.flash_attention,
                          note=f"the FlashAttention kernel {name!r} from the kernels hub becomes {HUB_CLASS}, whose "
                               "flash_attn_func / flash_attn_varlen_func run npu_fusion_attention")
        self.hub_sites.append(site)
        assign = self._parent(outer)
        if isinstance(assign, cst.Assign) and len(assign.targets) == 1 and isinstance(assign.targets[0].target, cst.Name):
            self.hub[assign.targets[0].target.value] = site

    # -- decisions -----------------------------------------------------------------------------

    def leave_Module(self, original_node: cst.Module) -> None:
        for call, root, func in self.attr_calls:
            if root in self.hub:
                self.flash.append(self._flash_call(call, func, f"{root}.{func}"))
        flex_blocked = [s for s in self.masks + self.flex if s.problem]
        for site in self.masks + self.flex:
            if site.problem:
                self._skip(site, SkipCategory.flex_attention, f"not carried to the NPU: {site.problem}. {CARRY_HINT}")
            elif flex_blocked:
                where = ", ".join(str(s.line) for s in flex_blocked)
                self._skip(site, SkipCategory.flex_attention, "left unchanged: this file's FlexAttention masks are "
                           f"carried together, and the ones at line(s) {where} cannot be (reported there)")
            else:
                self._carry(site)
        for site in self.flash:
            if site.problem:
                self._skip(site, SkipCategory.flash_attn, f"not carried to the NPU: {site.problem}")
            else:
                self._carry(site)
        for site in self.hub_sites:
            self._carry(site)
        self._remove_imports()
        if self.result.needs_helpers:
            for flag in self.compiles:
                self.plan.exprs[id(flag)] = cst.Name("False")
                self.plan.changes.append(PortChange(
                    file=self.relpath, line=self._span(flag).start.line, kind=ChangeKind.attention_fullgraph,
                    before="fullgraph=True", after="fullgraph=False", review=FULLGRAPH_NOTE))

    def _skip(self, site: _Site, category: SkipCategory, reason: str) -> None:
        code = self.lines[site.line - 1].strip() if site.line <= len(self.lines) else ""
        self.plan.skipped.append(Skipped(file=self.relpath, line=site.line, category=category, code=code[:200],
                                         reason=reason, blocking=True))

    def _carry(self, site: _Site) -> None:
        self.result.needs_helpers = True
        self.plan.exprs[id(site.target)] = site.replacement
        before = self._code(site.target)
        after = self.module.code_for_node(site.replacement)
        if site.target is site.call:
            self._drop_planner_changes(site)
        else:
            args = self._code(site.call)[len(self._code(site.call.func)):] if site.target is site.call.func else ""
            before, after = before + args, after + args
        self.plan.changes.append(PortChange(file=self.relpath, line=site.line, kind=site.kind, before=before,
                                            after=after, review=site.note))
        self.carried_spans.append(self._span(site.target))
        self.plan.skipped[:] = [s for s in self.plan.skipped if not (
            s.line == site.line and s.category in (SkipCategory.flash_attn, SkipCategory.kernels_hub))]

    def _drop_planner_changes(self, site: _Site) -> None:
        """The planner's changes inside a call this module replaced whole (e.g. device="cuda") are gone with it."""
        code = self._code(site.call)
        self.plan.changes[:] = [c for c in self.plan.changes if not (
            site.span.start.line <= c.line <= site.span.end.line and c.kind != site.kind and c.before in code)]

    def _remove_imports(self) -> None:
        def covered(span: CodeRange) -> bool:
            return any((s.start.line, s.start.column) <= (span.start.line, span.start.column)
                       and (span.end.line, span.end.column) <= (s.end.line, s.end.column) for s in self.carried_spans)

        for imp in self.imports:
            span = self._span(imp.statement)
            uses = [r for name, r in self.names if name in imp.locals and not (span.start.line <= r.start.line <= span.end.line)]
            if not imp.top_level or not uses or not all(covered(r) for r in uses):
                continue
            self.plan.exprs[id(imp.statement)] = cst.RemoveFromParent()
            self.result.removed_import_lines.add(imp.line)
            self.plan.changes.append(PortChange(file=self.relpath, line=imp.line, kind=ChangeKind.flash_attention,
                                                before=self._code(imp.statement), after="",
                                                review="import removed: every use was carried to npu_fusion_attention"))
        self.plan.skipped[:] = [s for s in self.plan.skipped if not (
            s.line in self.result.removed_import_lines and s.category in (SkipCategory.flash_attn, SkipCategory.kernels_hub))]


def plan_attention(wrapper: cst.MetadataWrapper, relpath: str, code: str, plan: Plan) -> AttentionPlan:
    """Add the attention rewrites of the file in `wrapper` to `plan` (after the Planner has run)."""
    planner = AttentionPlanner(relpath, wrapper.module, code, plan)
    wrapper.visit(planner)
    return planner.result


def _helper_statements() -> list[cst.BaseStatement]:
    module = cst.parse_module(HELPERS_FILE.read_text(encoding="utf-8"))
    body = [s for s in module.body if not (isinstance(s, cst.SimpleStatementLine) and isinstance(
        s.body[0], (cst.Import, cst.ImportFrom, cst.Expr)))]
    return body


def _insertion_index(module: cst.Module) -> int:
    """Before the first top-level def/class, or the first statement naming a helper, whichever is first (the
    helpers read torch and torch_npu only when called, so imports below them are fine)."""
    for index, statement in enumerate(module.body):
        if isinstance(statement, (cst.FunctionDef, cst.ClassDef)) or HELPER_NAMES.search(module.code_for_node(statement)):
            return index
    return len(module.body)


def _imports(module: cst.Module, name: str) -> bool:
    return any(isinstance(s, cst.SimpleStatementLine) and any(
        isinstance(small, cst.Import) and any(module.code_for_node(a.name) == name and a.asname is None
                                              for a in small.names) for small in s.body) for s in module.body)


def insert_helpers(module: cst.Module, attention: AttentionPlan) -> cst.Module:
    """Write the helpers after the module's leading imports (once), importing torch/torch_npu where missing."""
    if not attention.needs_helpers or any(isinstance(s, cst.FunctionDef) and s.name.value == FIRST_HELPER
                                          for s in module.body):
        return module
    body = list(module.body)
    index = _insertion_index(module)
    missing = [name for name in ("torch", "torch_npu") if not _imports(module, name)]
    new = [cst.parse_statement(TORCH_NPU_IMPORT if name == "torch_npu" else f"import {name}\n") for name in missing]
    new += _helper_statements()
    new[0] = new[0].with_changes(leading_lines=[cst.EmptyLine(), cst.EmptyLine(),
                                                cst.EmptyLine(comment=cst.Comment(HELPERS_HEADER))])
    if index < len(body):
        blank = sum(1 for line in body[index].leading_lines if line.comment is None)
        body[index] = body[index].with_changes(
            leading_lines=[cst.EmptyLine()] * max(0, 2 - blank) + list(body[index].leading_lines))
    return module.with_changes(body=body[:index] + new + body[index:])
