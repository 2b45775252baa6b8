"""One compiled graph -> FusionGroups: each kernel call with the ATen ops it covers, its kind (fused,
library extern, single) and the source spans of those ops (kernel stacks first, FX nodes second): the user's lines
(`spans`) and the library lines (`library_lines`: transformers' LlamaRMSNorm.forward, ...) the ops ran under."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from trainbridge.records import FusionGroup, KernelKind, LibrarySpan, Phase, SourceSpan
from trainbridge.tools.inductor.format import VIEW_OPS
from trainbridge.tools.inductor.fx import FxNode, parse_stack_trace
from trainbridge.tools.inductor.output_code import KernelCall, KernelDef, OutputCode
from trainbridge.tools.library_code import library_path, library_span
from trainbridge.tools.repo_paths import RepoPathMapper


@dataclass
class Graph:
    label: str
    aot_id: str
    phase: Phase
    folder: Path
    code: OutputCode
    fx: dict[str, FxNode]
    provenance: dict[str, list[str]]  # kernel "name:handle" -> post-grad nodes
    pre_to_post: dict[str, list[str]]  # Dynamo (pre-grad) node -> post-grad nodes
    snapshot: dict[str, dict[str, list[str]]] | None
    post_fusion: list[tuple[str, str]]


def phase_of(aot_id: str, is_backward: bool | None) -> Phase:
    if is_backward or "backward" in aot_id:
        return Phase.backward
    return Phase.forward


def graph_label(aot_id: str, phase: Phase) -> str:
    m = re.match(r"^(\d+)_", aot_id)
    return f"{phase.value}_{m.group(1)}" if m else aot_id


def _aten_name(target: str) -> str:
    return target if "." in target else f"aten.{target}"


def kernel_name_ops(name: str, vocabulary: set[str]) -> list[str]:
    """Last resort: split `cpp_fused_add_mean_mul_pow_rsqrt_0` on ATen names known from the graph."""
    m = re.match(r"^(?:cpp|triton_\w{3})_fused_(.*?)(?:_\d+)?$", name)
    if not m:
        return []
    rest, ops = m.group(1), []
    while rest:
        match = max((v for v in vocabulary if rest.startswith(v) and (len(rest) == len(v) or rest[len(v)] == "_")),
                    key=len, default=None)
        if match is None:
            if rest.startswith("_"):  # the separator between two op names
                rest = rest[1:]
                continue
            return []  # a token no op of the graph explains: cannot split reliably
        ops.append(f"aten.{match}")
        rest = rest[len(match):]
    return ops


def graph_groups(graph: Graph, mapper: RepoPathMapper) -> tuple[list[FusionGroup], str]:
    groups: list[FusionGroup] = []
    order = {name: i for i, name in enumerate(graph.fx)}
    vocabulary = {n.target.split(".", 1)[1] for n in graph.fx.values() if n.target and n.target.startswith("aten.")}
    used_stacks = False
    extern_nodes = _extern_nodes_by_order(graph)
    for ci, call in enumerate(graph.code.calls):
        snap = (graph.snapshot or {}).get(call.handle or "", None)
        kdef = graph.code.defs.get(call.name)
        post_nodes = _call_nodes(call, snap, graph, kdef) or extern_nodes.get(ci, [])
        post_nodes = sorted(dict.fromkeys(post_nodes), key=lambda n: order.get(n, len(order)))

        aten_ops = _aten_ops(call, snap, post_nodes, graph, kdef, vocabulary)

        spans: list[SourceSpan] = []
        library: list[LibrarySpan] = []
        if snap and snap["stack_traces"]:
            spans = _spans_from_stacks(snap["stack_traces"], mapper)
            library = _library_lines_from_stacks(snap["stack_traces"], mapper)
            used_stacks = used_stacks or bool(spans) or bool(library)
        if not spans and not library:
            spans = _spans_from_nodes(post_nodes, graph.fx, mapper)
            library = _library_lines_from_nodes(post_nodes, graph.fx)
        groups.append(FusionGroup(kernel=call.name, aten_ops=aten_ops, spans=spans, library_lines=library,
                                  phase=graph.phase, kind=_kind(call, aten_ops), graph=graph.label))
    source = "kernel_stack_traces" if used_stacks else ("fx_graph" if any(g.spans or g.library_lines for g in groups) else "none")
    return groups, source


def _call_nodes(call: KernelCall, snap: dict | None, graph: Graph, kdef: KernelDef | None) -> list[str]:
    """Post-grad (FX graph) nodes a kernel call covers, from the most precise evidence present.

    `Source Nodes` name Dynamo's pre-grad nodes in a forward graph (another namespace than the
    FX graph files: `mul` there is not `mul` here), but the backward graph's own nodes."""
    if snap and snap.get("post_grad_nodes"):
        return list(snap["post_grad_nodes"])
    if call.handle and graph.provenance.get(call.handle):
        return list(graph.provenance[call.handle])
    if kdef and kdef.node_mapping:
        return [n for nodes in kdef.node_mapping.values() for n in nodes]
    if graph.pre_to_post:
        names = [post for n in call.source_nodes for post in graph.pre_to_post.get(n, [])]
    elif graph.phase == Phase.backward:
        names = call.source_nodes
    else:
        names = []
    return [n for n in names if n in graph.fx]


def _extern_nodes_by_order(graph: Graph) -> dict[int, list[str]]:
    """Last resort for library calls: the k-th `extern_kernels.mm` call is the k-th `aten.mm` node
    of the FX graph, when both counts agree (Inductor keeps library calls in graph order)."""
    calls: dict[str, list[int]] = defaultdict(list)
    for ci, c in enumerate(graph.code.calls):
        if c.extern:
            calls[_extern_op(c.name)].append(ci)
    out: dict[int, list[str]] = {}
    for op, indices in calls.items():
        nodes = [n.name for n in graph.fx.values() if n.target == op]
        if len(nodes) == len(indices):
            out.update({ci: [node] for ci, node in zip(indices, nodes)})
    return out


def _aten_ops(call: KernelCall, snap: dict | None, post_nodes: list[str], graph: Graph,
              kdef: KernelDef | None, vocabulary: set[str]) -> list[str]:
    """The ATen ops a kernel covers, as the eager program would dispatch them (before
    decomposition) when the evidence says so: the capture's `original_aten`, else Inductor's
    `Original ATen` comment, else the post-grad nodes' (decomposed) targets, else the kernel name."""
    ops = [_aten_name(a) for a in (snap or {}).get("original_aten", [])] or [_aten_name(a) for a in call.original_aten]
    if call.extern:
        own = _extern_op(call.name)
        return [own] if own in ops or not ops else [op for op in ops if op.split(".", 1)[-1] not in VIEW_OPS] or [own]
    return ops or _ops_from_nodes(post_nodes, graph.fx, kdef) or kernel_name_ops(call.name, vocabulary)


def _extern_op(name: str) -> str:
    """extern_kernels.mm -> aten.mm; aten.set_ -> aten.set_."""
    return f"aten.{name.split('.', 1)[1]}" if name.startswith("extern_kernels.") else name


def _ops_from_nodes(nodes: list[str], fx: dict[str, FxNode], kdef: KernelDef | None) -> list[str]:
    ops: list[str] = []
    for n in nodes:
        target = fx[n].target if n in fx else (kdef.fragment_targets.get(n) if kdef else None)
        if target and target not in ops:
            ops.append(target)
    return ops


def _kind(call: KernelCall, aten_ops: list[str]) -> KernelKind:
    if call.extern:
        return KernelKind.extern
    real = {op.split(".", 1)[-1] for op in aten_ops} - VIEW_OPS
    if len(real) >= 2:
        return KernelKind.fused
    if not aten_ops and "_fused_" in call.name:  # no op list at all: trust the name
        return KernelKind.fused
    return KernelKind.single


def _spans_from_stacks(stacks: Iterable[str], mapper: RepoPathMapper) -> list[SourceSpan]:
    spans: dict[tuple[str, int], SourceSpan] = {}
    for stack in stacks:
        for frame in reversed(parse_stack_trace(stack)):  # innermost frame inside the repo
            rel = mapper.map(frame.file)
            if rel is not None:
                spans.setdefault((rel, frame.line), SourceSpan(file=rel, line_start=frame.line,
                                                               line_end=frame.line, function=frame.function))
                break
    return [spans[k] for k in sorted(spans)]


def _library_lines_from_stacks(stacks: Iterable[str], mapper: RepoPathMapper) -> list[LibrarySpan]:
    """Every library frame of the stacks below their innermost repository frame, innermost first, once each."""
    lines: dict[tuple[str, int], LibrarySpan] = {}
    for stack in stacks:
        for frame in reversed(parse_stack_trace(stack)):
            if mapper.map(frame.file) is not None:
                break  # the user's code: what calls the library is the user's call site
            rel = library_path(frame.file)
            if rel is not None and (rel, frame.line) not in lines:
                lines[(rel, frame.line)] = library_span(rel, frame.line, frame.line, frame.function)
    return list(lines.values())


def _library_lines_from_nodes(nodes: list[str], fx: dict[str, FxNode]) -> list[LibrarySpan]:
    """The `# File:` comments of the FX graph name the innermost frame only: library lines where that is a library's."""
    lines: dict[tuple[str, int], LibrarySpan] = {}
    for n in nodes:
        node = fx.get(n)
        rel = library_path(node.file) if node is not None and node.file is not None and node.line is not None else None
        if rel is not None and (rel, node.line) not in lines:
            lines[(rel, node.line)] = library_span(rel, node.line, node.line, node.function)
    return list(lines.values())


def _spans_from_nodes(nodes: list[str], fx: dict[str, FxNode], mapper: RepoPathMapper) -> list[SourceSpan]:
    spans: dict[tuple[str, int], SourceSpan] = {}
    for n in nodes:
        node = fx.get(n)
        if node is None or node.file is None or node.line is None:
            continue
        rel = mapper.map(node.file)
        if rel is not None:
            spans.setdefault((rel, node.line), SourceSpan(file=rel, line_start=node.line, line_end=node.line,
                                                          function=node.function))
    return [spans[k] for k in sorted(spans)]
