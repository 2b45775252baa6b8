"""Inductor's `output_code.py`: the kernel calls of `call()` in launch order (generated kernels,
library calls, fallback ATen ops) with the provenance, source-node and graph-fragment comments."""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass
class KernelCall:
    """One kernel launch in a graph's call(), in launch order."""

    name: str
    handle: str | None = None  # "name:N" from the provenance comment
    extern: bool = False
    source_nodes: list[str] = field(default_factory=list)
    original_aten: list[str] = field(default_factory=list)


@dataclass
class KernelDef:
    name: str
    source_nodes: list[str] = field(default_factory=list)
    original_aten: list[str] = field(default_factory=list)
    node_mapping: dict[str, list[str]] = field(default_factory=dict)  # source node -> ATen nodes
    fragment_targets: dict[str, str] = field(default_factory=dict)  # ATen node -> "aten.op"


@dataclass
class OutputCode:
    aot_id: str | None
    defs: dict[str, KernelDef]
    calls: list[KernelCall]


_AOT_ID = re.compile(r"^# AOT ID: \['([^']+)'\]", re.M)
_DEF = re.compile(r"^(\w+) = async_compile\.(\w+)\(", re.M)
_SRC_NODES = re.compile(r"#\s*(?:Topologically Sorted |Unsorted )?Source Nodes: \[([^\]]*)\], Original ATen: \[([^\]]*)\]")
_MAPPING_LINE = re.compile(r"^#\s+(\w+) => (.+)$")
_FRAGMENT = re.compile(r"^#\s+%(\w+) .*?call_function\[target=torch\.ops\.(\w+)\.(\w+)\.")
_HANDLE = re.compile(r"# \[Provenance debug handles\] (\S+)")
_RUN_CALL = re.compile(r"^\s*(\w+)\.run\(")
_EXTERN_CALL = re.compile(r"^\s*(?:\w+ = )?extern_kernels\.(\w+)\(")
_FALLBACK_CALL = re.compile(r"^\s*(?:\w+ = )?torch\.ops\.(\w+)\.(\w+)(?:\.\w+)?\(")
_PLAIN_CALL = re.compile(r"^\s*(\w+)\(")


def _split_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def parse_output_code(text: str) -> OutputCode:
    """Kernel definitions (with their header comments) and the launches of call(), in order."""
    lines = text.splitlines()
    aot = _AOT_ID.search(text)
    defs: dict[str, KernelDef] = {}
    for m in _DEF.finditer(text):
        kdef = KernelDef(m.group(1))
        line_no = text.count("\n", 0, m.start())
        header: list[str] = []
        j = line_no - 1
        while j >= 0 and lines[j].startswith("#"):
            header.append(lines[j])
            j -= 1
        in_mapping = in_fragment = False
        for h in reversed(header):
            if sm := _SRC_NODES.search(h):
                kdef.source_nodes, kdef.original_aten = _split_list(sm.group(1)), _split_list(sm.group(2))
            elif h.startswith("# Source node to ATen node mapping"):
                in_mapping, in_fragment = True, False
            elif h.startswith("# Graph fragment"):
                in_mapping, in_fragment = False, True
            elif in_mapping and (mm := _MAPPING_LINE.match(h)):
                kdef.node_mapping[mm.group(1)] = _split_list(mm.group(2))
            elif in_fragment and (fm := _FRAGMENT.match(h)):
                kdef.fragment_targets[fm.group(1)] = f"{fm.group(2)}.{fm.group(3)}"
        defs[kdef.name] = kdef
    return OutputCode(aot.group(1) if aot else None, defs, _parse_calls(lines, defs))


def _call_body(lines: list[str]) -> list[str]:
    for i, line in enumerate(lines):
        stripped = line.lstrip()
        if stripped.startswith("def call(") and not stripped.startswith("def call_"):
            indent = len(line) - len(stripped)
            body = []
            for nxt in lines[i + 1:]:
                if nxt.strip() and len(nxt) - len(nxt.lstrip()) <= indent:
                    break
                body.append(nxt)
            return body
    return []


def _parse_calls(lines: list[str], defs: dict[str, KernelDef]) -> list[KernelCall]:
    calls: list[KernelCall] = []
    pending_handles: list[str] = []
    pending_nodes: tuple[list[str], list[str]] | None = None
    for line in _call_body(lines):
        s = line.strip()
        if s.startswith("#"):
            if hm := _HANDLE.search(s):
                pending_handles.append(hm.group(1))
            elif sm := _SRC_NODES.search(s):
                pending_nodes = (_split_list(sm.group(1)), _split_list(sm.group(2)))
            continue
        call = _match_call(line, defs)
        if call is None:
            continue
        handle = next((h for h in pending_handles if h.rsplit(":", 1)[0] == call.name), None)
        call.handle = handle
        if pending_nodes is not None:
            call.source_nodes, call.original_aten = pending_nodes
        elif call.name in defs:
            call.source_nodes, call.original_aten = defs[call.name].source_nodes, defs[call.name].original_aten
        calls.append(call)
        pending_handles, pending_nodes = [], None
    return calls


def _match_call(line: str, defs: dict[str, KernelDef]) -> KernelCall | None:
    if m := _EXTERN_CALL.match(line):
        return KernelCall(f"extern_kernels.{m.group(1)}", extern=True)
    if m := _FALLBACK_CALL.match(line):
        return KernelCall(f"{m.group(1)}.{m.group(2)}", extern=True)
    if (m := _RUN_CALL.match(line)) and (m.group(1) in defs or m.group(1).startswith("triton_")):
        return KernelCall(m.group(1))
    if (m := _PLAIN_CALL.match(line)) and m.group(1) in defs:
        return KernelCall(m.group(1))
    return None
