"""Target rules of the static scan: library calls that are one kernel on CUDA but not on the NPU.

Each rule is reported only for targets whose gains list it (targets.GAINS):

- ``library_attention``: SDPA (noting transposed BNSD inputs, causal / mask), flash-attn's
  ``flash_attn_func`` / ``flash_attn_varlen_func``, ``varlen_attn``, ``flex_attention`` (also when
  compiled into another name such as ``compiled_flex_attn``), xformers' ``memory_efficient_attention``
  (BSND; a block-diagonal mask packs sequences: TND). Inference-only KV-cache calls
  (``flash_attn_with_kvcache``) are left out.
- ``library_rope``: flash-attn's rotary (``flash_attn.layers.rotary.RotaryEmbedding`` called as a
  submodule, ``apply_rotary_emb`` / ``apply_rotary_emb_func``): a CUDA kernel with no NPU build ->
  ``npu_rotary_mul``.
- ``library_rmsnorm``: ``F.rms_norm`` calls, ``nn.RMSNorm(...)`` constructions and classes
  deriving from ``nn.RMSNorm``.
- ``fp32_logits_loss``: ``F.cross_entropy`` whose input is an fp32 upcast (``.float()``,
  ``.to(torch.float32)``), through views, slicing, pointwise ops (a soft-cap on the way) and either branch
  of a conditional expression (an upcast for evaluation only).
"""

from __future__ import annotations

import re
from typing import Callable, Iterable

import libcst as cst

from trainbridge.records import IntentCategory

from .match import Found, Match, peek
from .model import Expr, FileModel, Scope, Stmt

_FLEX = re.compile(r"(^|_)flex_attn$|flex_attention$")
_FLASH = frozenset({"flash_attn_func", "flash_attn_varlen_func", "flash_attn_qkvpacked_func",
                    "flash_attn_varlen_qkvpacked_func", "varlen_attn"})
_XFORMERS = frozenset({"memory_efficient_attention", "memory_efficient_attention_forward"})
_FLASH_ROTARY = frozenset({"apply_rotary_emb", "apply_rotary_emb_func", "apply_rotary_emb_qkv_", "apply_rotary_emb_kv_"})
_TRANSPOSES = frozenset({"transpose", "permute", "swapaxes", "swapdims", "movedim"})
_RMSNORM_CLASSES = frozenset({"nn.RMSNorm", "torch.nn.RMSNorm"})
_VIEWS = frozenset({"view", "reshape", "flatten", "contiguous", "squeeze", "unsqueeze", "view_as", "reshape_as"})
_POINTWISE = frozenset({"mul", "div", "add", "sub", "neg", "tanh", "sigmoid", "clamp"})
_CODE = cst.Module([])


def _calls(files: Iterable[FileModel]) -> Iterable[tuple[FileModel, Scope, Expr]]:
    for file in files:
        for scope in file.scopes:
            for c in scope.calls:
                yield file, scope, c


_LIBRARIES = ("torch", "flash_attn", "torch_npu", "xformers")


def library_name(file: FileModel, c: Expr) -> str:
    """The library function a call calls, through import aliases (``import ... as sdpa``)."""
    if not c.method and c.callee == c.op and c.op in file.imports:
        source, name = file.imports[c.op]
        if source.split(".")[0] in _LIBRARIES:
            return name
    return c.op


def _torch_call(file: FileModel, c: Expr, name: str) -> bool:
    """``c`` calls torch's ``name``: ``F.rms_norm``, ``torch.nn.RMSNorm`` or a name imported from torch.

    A function of the same name defined in the scanned code, or imported from the user's own
    package, is not the library's.
    """
    if c.method or c.op in file.functions:
        return False
    if c.callee == c.op:
        source, imported = file.imports.get(c.op, ("", ""))
        return imported == name and source.split(".")[0] == "torch"
    return c.op == name and bool(c.callee) and c.callee.split(".")[0] in file.module_aliases


def _is_true(e: Expr | None) -> bool:
    return e is not None and peek(e).kind == "const" and peek(e).value is True


def _transposed(e: Expr) -> bool:
    x = peek(e)
    while x.kind == "call" and x.method and x.op == "contiguous":
        x = peek(x.args[0])
    return x.kind == "call" and x.op in _TRANSPOSES


def _sdpa_note(c: Expr) -> str:
    if all(i < len(c.args) and _transposed(c.args[i]) for i in range(3)):
        parts = ["F.scaled_dot_product_attention on transposed BNSD views: npu_fusion_attention(input_layout='BSND') "
                 "on the untransposed tensors drops the transposes and their copies"]
    else:
        parts = ["F.scaled_dot_product_attention (BNSD): npu_fusion_attention with input_layout='BNSD'"]
    if _is_true(c.kwargs.get("is_causal")):
        parts.append("is_causal=True is top-left causal: sparse_mode=2 with the 2048x2048 upper-triangular mask")
    if c.arg(3, "attn_mask") is not None:
        parts.append("an attn_mask: npu_fusion_attention's boolean mask is the inverse (True = excluded)")
    parts.append("scale defaults to 1.0 there, pass 1/sqrt(D)")
    return "; ".join(parts)


def _mentions_str(e: Expr, text: str, depth: int = 8) -> bool:
    """``e`` (through names) contains the string constant ``text``, e.g. a kwargs dict key."""
    x = peek(e)
    if x.kind == "str" and x.value == text:
        return True
    return depth > 0 and any(_mentions_str(a, text, depth - 1) for a in (*x.args, *x.kwargs.values()))


def _flash_note(c: Expr, name: str) -> str:
    varlen = "varlen" in name
    parts = [f"{name} (flash-attn)" + (": TND layout, actual_seq_qlen = cu_seqlens[1:]" if varlen else ": BSND layout")]
    if _is_true(c.kwargs.get("causal")):
        parts.append("causal=True is bottom-right causal: sparse_mode=3")
    if "window_size" in c.kwargs or ("***" in c.kwargs and _mentions_str(c.kwargs["***"], "window_size")):
        parts.append("window_size=(w, 0) keeps w + 1 keys: pre_tockens=w, next_tockens=0, with the mask")
    return "; ".join(parts) + " -> npu_fusion_attention"


def _attention_fn(name: str) -> bool:
    return name == "scaled_dot_product_attention" or name in _FLASH or bool(_FLEX.search(name))


def _xformers_call(file: FileModel, c: Expr) -> bool:
    """``memory_efficient_attention(...)`` from xformers: imported by name, or through a module alias (``xops.``)."""
    if c.op not in _XFORMERS or c.op in file.functions:
        return False

    def from_xformers(alias: str) -> bool:
        source = file.imports.get(alias, ("", ""))[0]
        return source.split(".")[0] == "xformers" or alias in ("xformers", "xops")

    if not c.method:
        return from_xformers(c.op if c.callee == c.op else (c.callee or "").split(".")[0])
    receiver = peek(c.args[0])  # from xformers import ops as xo; xo.memory_efficient_attention(...)
    return receiver.kind == "name" and receiver.binding is None and from_xformers(receiver.op)


def _xformers_note(c: Expr) -> str:
    mask = c.arg(3, "attn_bias")
    parts = ["xformers memory_efficient_attention (BSND, no NPU build) -> npu_fusion_attention(input_layout='BSND')"]
    if mask is not None:
        parts.append("an attn_bias: a causal LowerTriangularMask is sparse_mode=2/3; a BlockDiagonalMask of packed "
                     "sequences is input_layout='TND' with actual_seq_qlen / actual_seq_kvlen")
    parts.append("grouped-query heads expanded before it (repeat_interleave / expand) need no copy: npu_fusion_attention "
                 "takes fewer key/value heads")
    return "; ".join(parts)


def compiled_aliases(file: FileModel) -> set[str]:
    """Module-level names bound to ``torch.compile(<attention function>)``: ``fast = torch.compile(flex_attention)``."""
    out = set()
    for stmt in file.module.body:
        if not isinstance(stmt, cst.SimpleStatementLine):
            continue
        for small in stmt.body:
            if not isinstance(small, cst.Assign) or not isinstance(small.value, cst.Call) or not small.value.args:
                continue
            func = _CODE.code_for_node(small.value.func)
            compiled = _CODE.code_for_node(small.value.args[0].value).rsplit(".", 1)[-1]
            if func.rsplit(".", 1)[-1] == "compile" and _attention_fn(compiled):
                out |= {t.target.value for t in small.targets if isinstance(t.target, cst.Name)}
    return out


def library_attention(files: list[FileModel]) -> list[Match]:
    out = []
    aliases = {id(f): compiled_aliases(f) for f in files}
    for file, _, c in _calls(files):
        name = library_name(file, c)
        if c.op in aliases[id(file)] and not c.method:
            note = f"{c.op} = torch.compile(flex_attention / SDPA): " + (
                "on the NPU torch.compile falls back or needs TorchAir; npu_fusion_attention is the fused kernel "
                "(causal / sliding-window block masks: sparse_mode 2/3/4)")
        elif name == "scaled_dot_product_attention":
            note = _sdpa_note(c)
        elif name in _FLASH:
            note = _flash_note(c, name)
        elif _xformers_call(file, c):
            note = _xformers_note(c)
        elif _FLEX.search(name) and c.op not in file.functions:
            note = ("flex_attention with a block mask: causal and sliding-window masks map to npu_fusion_attention "
                    "(sparse_mode 2/3/4, pre_tockens for the window); document masks need TND or an explicit mask")
        else:
            continue
        out.append(_helper_match(IntentCategory.attention, file, c, Found(0.5, note)))
    return out


def _helper_match(category: IntentCategory, file: FileModel, c: Expr, found: Found) -> Match:
    """A finding at a library call; a function that only wraps the call is spanned whole."""
    match = Match.at_call(category, file, c, found)
    match.whole_function = True
    return match


def _class_match(file: FileModel, scope: Scope, found: Found) -> Match:
    node = scope.node
    site = Expr("other", "class", node, Stmt(node, scope.start, scope.end, scope), scope.start, scope.end)
    return Match(IntentCategory.rmsnorm, file, scope, site, scope.start, scope.end, frozenset({id(node)}), found, 100)


def library_rmsnorm(files: list[FileModel]) -> list[Match]:
    out = []
    for file, _, c in _calls(files):
        if _torch_call(file, c, "rms_norm"):
            note = "F.rms_norm: decomposes into pow/mean/add/rsqrt/mul in NPU eager; npu_rms_norm is one kernel"
        elif _torch_call(file, c, "RMSNorm"):
            note = "nn.RMSNorm: decomposes in NPU eager; npu_rms_norm is one kernel"
        else:
            continue
        out.append(_helper_match(IntentCategory.rmsnorm, file, c, Found(0.5, note)))
    for file in files:
        for scope in file.scopes:
            if isinstance(scope.node, cst.ClassDef):
                bases = {_CODE.code_for_node(b.value) for b in scope.node.bases}
                imported = {b for b in bases if file.imports.get(b, ("", ""))[1] == "RMSNorm"
                            and file.imports[b][0].split(".")[0] == "torch"}
                if bases & _RMSNORM_CLASSES or imported:
                    note = f"class {scope.qualname} derives from nn.RMSNorm: decomposes in NPU eager; npu_rms_norm is one kernel"
                    out.append(_class_match(file, scope, Found(0.5, note)))
    return out


def _flash_rotary(file: FileModel, c: Expr) -> bool:
    """A call of flash-attn's rotary: its function, or a submodule built from its RotaryEmbedding class."""
    if c.method:
        return False
    if c.op.startswith("self."):
        cls = c.stmt.scope.class_name
        value = file.module_attrs.get((cls, c.op[5:])) if cls else None
        built = peek(value) if value is not None else None
        if built is None or built.kind != "call" or built.method:
            return False
        source, name = file.imports.get(built.op, ("", ""))
        return source.split(".")[0] == "flash_attn" and name == "RotaryEmbedding"
    source, name = file.imports.get(c.op, ("", "")) if c.callee == c.op else ("", "")
    return source.split(".")[0] == "flash_attn" and name in _FLASH_ROTARY and c.op not in file.functions


def library_rope(files: list[FileModel]) -> list[Match]:
    out = []
    for file, _, c in _calls(files):
        if _flash_rotary(file, c):
            note = ("flash-attn's rotary kernel (CUDA only): npu_rotary_mul(x, cos, sin) with the same layout "
                    "('interleave' when the module was built with interleaved=True, else 'half')")
            out.append(_helper_match(IntentCategory.rope, file, c, Found(0.5, note)))
    return out


def _fp32_cast(x: Expr) -> bool:
    if x.kind != "call" or not x.method:
        return False
    if x.op == "float" and len(x.args) == 1:
        return True
    if x.op in ("to", "type"):
        dtype = peek(x.arg(1, "dtype")) if x.arg(1, "dtype") is not None else None
        return dtype is not None and dtype.kind == "attr" and dtype.op in ("float32", "float")
    return False


def _upcast_feeding(e: Expr, seen: list[Stmt], depth: int = 0) -> Expr | None:
    """The fp32 cast that ``e`` is computed from, through views and pointwise ops."""
    if depth > 10:
        return None
    x = e
    while x.kind == "name" and x.binding is not None:
        seen.append(x.binding.stmt)
        x = x.binding.value
    if _fp32_cast(x):
        return x
    if x.kind == "subscript" and x.args:
        return _upcast_feeding(x.args[0], seen, depth + 1)
    # `logits.float() if not self.training else logits` (Modded-NanoGPT records 38 on): either branch's cast counts
    branches = x.args[1:] if x.kind == "other" and x.op == "IfExp" else ()
    if (x.kind == "call" and (x.op in _VIEWS or x.op in _POINTWISE) and x.args) or branches:
        for a in branches or x.args:
            seen_as = peek(a)
            if seen_as.kind in ("name", "call", "subscript") or (seen_as.kind == "other" and seen_as.op == "IfExp"):
                branch: list[Stmt] = []
                found = _upcast_feeding(a, branch, depth + 1)
                if found is not None:
                    seen += branch
                    return found
    return None


def fp32_logits_loss(files: list[FileModel]) -> list[Match]:
    out = []
    for file, _, c in _calls(files):
        if library_name(file, c) != "cross_entropy" or not c.args or c.op in file.functions:
            continue
        seen: list[Stmt] = []
        cast = _upcast_feeding(c.args[0], seen)
        if cast is None:
            continue
        note = ("fp32 upcast of the full-vocabulary logits before F.cross_entropy: a [tokens, vocab] fp32 copy "
                "and a log_softmax + nll pair; npu_cross_entropy_loss takes the bf16 logits and reduces in fp32")
        match = _helper_match(IntentCategory.cross_entropy, file, c, Found(0.5, note))
        match.start = min([c.start, cast.start] + [s.start for s in seen])
        match.end = max([c.end] + [s.end for s in seen])
        out.append(match)
    return out


TARGET_RULES: tuple[tuple[str, Callable[[list[FileModel]], list[Match]]], ...] = (
    ("library_attention", library_attention),
    ("library_rmsnorm", library_rmsnorm),
    ("library_rope", library_rope),
    ("fp32_logits_loss", fp32_logits_loss),
)
