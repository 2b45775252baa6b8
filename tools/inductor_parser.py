"""Parse Inductor's evidence (a capture folder or a plain TORCH_COMPILE_DEBUG folder) into FusionGroups.

Reads, per compiled graph (a folder holding `output_code.py`):
- `output_code.py`: the kernel calls of `call()` in launch order: generated kernels
  (`cpp_fused_*`, `triton_poi_/red_/per_fused_*`), library calls (`extern_kernels.mm`), fallback
  ATen ops (`torch.ops.aten.*`); the `# [Provenance debug handles]`, `# Source Nodes` /
  `# Topologically Sorted Source Nodes` / `Original ATen`, `Source node to ATen node mapping`
  and `Graph fragment` comments (on call sites and, in Triton output, on kernel definitions);
- `fx_graph_transformed.py` / `fx_graph_readable.py`: node -> ATen op and `# File: path:line`;
- `inductor_provenance_tracking_node_mappings.json`: kernel `name:handle` -> post-grad nodes;
- `ir_post_fusion.txt`: scheduler node kinds (FusedSchedulerNode, OuterLoopFusedSchedulerNode,
  ExternKernelSchedulerNode, SchedulerNode, ...), counted per graph;
and, from a capture folder, `kernel_stack_traces.json` (kernel -> full Python stacks, the most
precise join key), `dynamo.json` (graph breaks, recompiles), `eager_op_counts.json` and a Chrome
trace (`trace.json`) whose kernel times are attached to the groups whose names match.

Source paths are mapped to the repository by the longest path suffix that exists under the repo
root, so evidence captured on another machine (/home/u/proj/model.py) maps to model.py; paths
outside the repo (torch, site-packages) are dropped. All functions here are pure: no torch import.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Iterable

from pydantic import Field

from trainbridge.records import FusionGroup, KernelKind, Phase, Record, SourceSpan

EVIDENCE_FORMAT = 1
MANIFEST_FILE = "manifest.json"
KERNEL_MAP_FILE = "kernel_stack_traces.json"
DYNAMO_FILE = "dynamo.json"
EAGER_COUNTS_FILE = "eager_op_counts.json"
TRACE_FILE = "trace.json"
DEBUG_DIR = "debug"
OUTPUT_CODE = "output_code.py"
PROVENANCE_FILE = "inductor_provenance_tracking_node_mappings.json"
FX_GRAPH_FILES = ("fx_graph_transformed.py", "fx_graph_readable.py")  # first wins
POST_FUSION_FILE = "ir_post_fusion.txt"

# ATen ops that only re-describe memory: a kernel covering one real op plus these is "single".
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "squeeze", "unsqueeze",
    "slice", "select", "as_strided", "alias", "detach", "unflatten", "split", "split_with_sizes",
    "chunk", "narrow", "unbind", "view_as", "expand_as", "_reshape_alias", "lift_fresh",
})
_EXCLUDED_PATH_MARKS = ("site-packages/", "dist-packages/", "/lib/python3", "<frozen", "<eval_with_key")


class EvidenceFormatError(ValueError):
    """The folder or file is not Inductor evidence this parser can read."""


# ----------------------------------------------------------------------------------------------
# Records returned


class GraphBreakInfo(Record):
    reason: str
    count: int = Field(default=1, ge=1, description="how many compilations hit it")
    location: str | None = Field(default=None, description="file:line as Dynamo printed it")
    span: SourceSpan | None = Field(default=None, description="the location mapped to the repo")


class GraphSummary(Record):
    graph: str = Field(description="e.g. forward_0")
    aot_id: str
    phase: Phase
    folder: str = Field(description="the graph's debug folder, relative to the evidence folder")
    kernel_calls: int = Field(ge=0, description="kernel launches per execution of this graph")
    calls_by_kind: dict[str, int] = Field(default_factory=dict)
    post_fusion_nodes: dict[str, int] = Field(default_factory=dict, description="ir_post_fusion.txt node kinds")
    span_source: str = Field(description="kernel_stack_traces | fx_graph | none")


class EvidenceSummary(Record):
    torch_version: str | None = None
    device: str | None = None
    graphs: list[GraphSummary] = Field(default_factory=list)
    kernels_per_step: dict[str, int] = Field(default_factory=dict, description="compiled kernel calls per phase")
    eager_ops_per_step: dict[str, int] | None = Field(default=None, description="from eager_op_counts.json")
    graph_breaks: list[GraphBreakInfo] = Field(default_factory=list)
    recompiles: list[str] = Field(default_factory=list)
    timed_groups: int = Field(default=0, ge=0, description="groups that got a time from the trace")
    notes: list[str] = Field(default_factory=list)


class ParsedEvidence(Record):
    groups: list[FusionGroup]
    summary: EvidenceSummary


# ----------------------------------------------------------------------------------------------
# Repo path mapping


class RepoPathMapper:
    """Maps a source path from any machine to a repo-relative POSIX path, or None if not in the repo."""

    def __init__(self, repo_root: Path) -> None:
        self.root = Path(repo_root).resolve()
        if not self.root.is_dir():
            raise EvidenceFormatError(f"repo root {repo_root} is not a directory")
        self._cache: dict[str, str | None] = {}

    def map(self, path: str) -> str | None:
        if path not in self._cache:
            self._cache[path] = self._map(path)
        return self._cache[path]

    def _map(self, path: str) -> str | None:
        posix = path.replace("\\", "/")
        try:  # a path under this very root maps directly, whatever it contains
            rel = Path(posix).resolve().relative_to(self.root)
            return rel.as_posix() if (self.root / rel).is_file() else None
        except (ValueError, OSError):
            pass
        if any(mark in posix for mark in _EXCLUDED_PATH_MARKS):
            return None
        parts = [p for p in PurePosixPath(posix).parts if p not in ("/", "")]
        for i in range(len(parts)):  # longest suffix first
            candidate = "/".join(parts[i:])
            if ".." not in parts[i:] and (self.root / candidate).is_file():
                return candidate
        return None


# ----------------------------------------------------------------------------------------------
# output_code.py


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


# ----------------------------------------------------------------------------------------------
# FX graphs, stacks, post-fusion IR


@dataclass(frozen=True)
class FxNode:
    name: str
    target: str | None  # "aten.pow"
    file: str | None
    line: int | None
    function: str | None


_FILE_COMMENT = re.compile(r"^\s*# File: (.+?):(\d+) in ([^,]+), code:")
_NODE_LINE = re.compile(r"^\s+(\w+)(?::\s*\"[^\"]*\")? = (.*)$")
_TORCH_OP = re.compile(r"torch\.ops\.(\w+)\.(\w+)\.")


def parse_fx_graph(text: str) -> dict[str, FxNode]:
    """Node name -> ATen target and the user source line from the `# File:` comment above it."""
    nodes: dict[str, FxNode] = {}
    loc: tuple[str, int, str] | None = None
    for line in text.splitlines():
        if not line.strip():
            loc = None
            continue
        if fm := _FILE_COMMENT.match(line):
            loc = (fm.group(1), int(fm.group(2)), fm.group(3).strip())
            continue
        if line.strip().startswith("#"):
            if "No stacktrace found" in line:
                loc = None
            continue
        nm = _NODE_LINE.match(line)
        if nm is None or nm.group(1) in ("def", "return", "class"):
            continue
        tm = _TORCH_OP.search(nm.group(2))
        target = f"{tm.group(1)}.{tm.group(2)}" if tm else None
        nodes[nm.group(1)] = FxNode(nm.group(1), target, *(loc if loc else (None, None, None)))
    return nodes


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    function: str


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def parse_stack_trace(text: str) -> list[Frame]:
    """Frames of a Python traceback-style stack, outermost first."""
    return [Frame(m.group(1), int(m.group(2)), m.group(3))
            for m in (_FRAME.match(line) for line in text.splitlines()) if m]


_POST_NODE = re.compile(r"^(\w+): (\w*SchedulerNode)\(")


def parse_post_fusion(text: str) -> list[tuple[str, str]]:
    """Top-level scheduler nodes of ir_post_fusion.txt: (name, kind), nested snodes skipped."""
    nodes: list[tuple[str, str]] = []
    nested = False
    for line in text.splitlines():
        if re.match(r"^\w+\.snodes\[\d+\] =\s*$", line):
            nested = True
            continue
        if m := _POST_NODE.match(line):
            if not nested:
                nodes.append((m.group(1), m.group(2)))
            nested = False
    return nodes


# ----------------------------------------------------------------------------------------------
# One graph -> FusionGroups


@dataclass
class _Graph:
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


def _phase_of(aot_id: str, is_backward: bool | None) -> Phase:
    if is_backward or "backward" in aot_id:
        return Phase.backward
    return Phase.forward


def _graph_label(aot_id: str, phase: Phase) -> str:
    m = re.match(r"^(\d+)_", aot_id)
    return f"{phase.value}_{m.group(1)}" if m else aot_id


def _aten_name(target: str) -> str:
    return target if "." in target else f"aten.{target}"


def _kernel_name_ops(name: str, vocabulary: set[str]) -> list[str]:
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


def _graph_groups(graph: _Graph, mapper: RepoPathMapper) -> tuple[list[FusionGroup], str]:
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
        if snap and snap["stack_traces"]:
            spans = _spans_from_stacks(snap["stack_traces"], mapper)
            used_stacks = used_stacks or bool(spans)
        if not spans:
            spans = _spans_from_nodes(post_nodes, graph.fx, mapper)
        groups.append(FusionGroup(kernel=call.name, aten_ops=aten_ops, spans=spans, phase=graph.phase,
                                  kind=_kind(call, aten_ops), graph=graph.label))
    source = "kernel_stack_traces" if used_stacks else ("fx_graph" if any(g.spans for g in groups) else "none")
    return groups, source


def _call_nodes(call: KernelCall, snap: dict | None, graph: _Graph, kdef: KernelDef | None) -> list[str]:
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


def _extern_nodes_by_order(graph: _Graph) -> dict[int, list[str]]:
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


def _aten_ops(call: KernelCall, snap: dict | None, post_nodes: list[str], graph: _Graph,
              kdef: KernelDef | None, vocabulary: set[str]) -> list[str]:
    """The ATen ops a kernel covers, as the eager program would dispatch them (before
    decomposition) when the evidence says so: the capture's `original_aten`, else Inductor's
    `Original ATen` comment, else the post-grad nodes' (decomposed) targets, else the kernel name."""
    ops = [_aten_name(a) for a in (snap or {}).get("original_aten", [])] or [_aten_name(a) for a in call.original_aten]
    if call.extern:
        own = _extern_op(call.name)
        return [own] if own in ops or not ops else [op for op in ops if op.split(".", 1)[-1] not in VIEW_OPS] or [own]
    return ops or _ops_from_nodes(post_nodes, graph.fx, kdef) or _kernel_name_ops(call.name, vocabulary)


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


# ----------------------------------------------------------------------------------------------
# The evidence folder


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EvidenceFormatError(f"{path}: cannot read {what} ({exc})") from exc


def _load_graphs(root: Path) -> list[_Graph]:
    snapshots: dict[str, dict[str, Any]] = {}
    if (root / KERNEL_MAP_FILE).is_file():
        data = _read_json(root / KERNEL_MAP_FILE, "the kernel -> stack map")
        if not isinstance(data, dict) or not isinstance(data.get("graphs"), list):
            raise EvidenceFormatError(f"{root / KERNEL_MAP_FILE}: expected {{'graphs': [...]}}")
        snapshots = {g["aot_id"]: g for g in data["graphs"] if isinstance(g, dict) and "aot_id" in g}
    graphs = []
    for code_path in sorted(root.rglob(OUTPUT_CODE)):
        folder = code_path.parent
        code = parse_output_code(code_path.read_text(encoding="utf-8", errors="replace"))
        aot_id = code.aot_id or _aot_from_folder(folder.name)
        snap = snapshots.get(aot_id)
        phase = _phase_of(aot_id, snap.get("is_backward") if snap else None)
        fx: dict[str, FxNode] = {}
        for name in reversed(FX_GRAPH_FILES):  # transformed (post-grad) overrides readable
            if (folder / name).is_file():
                fx.update(parse_fx_graph((folder / name).read_text(encoding="utf-8", errors="replace")))
        provenance: dict[str, list[str]] = {}
        pre_to_post: dict[str, list[str]] = {}
        if (folder / PROVENANCE_FILE).is_file():
            prov = _read_json(folder / PROVENANCE_FILE, "the provenance mapping")
            if isinstance(prov, dict):
                provenance, pre_to_post = prov.get("cppCodeToPost", {}), prov.get("preToPost", {})
        post = (parse_post_fusion((folder / POST_FUSION_FILE).read_text(encoding="utf-8", errors="replace"))
                if (folder / POST_FUSION_FILE).is_file() else [])
        graphs.append(_Graph(_graph_label(aot_id, phase), aot_id, phase, folder, code, fx, provenance,
                             pre_to_post, snap["kernels"] if snap else None, post))
    return sorted(graphs, key=lambda g: (g.phase != Phase.forward, _aot_index(g.aot_id), g.aot_id))


def _aot_index(aot_id: str) -> int:
    m = re.match(r"^(\d+)_", aot_id)
    return int(m.group(1)) if m else 1 << 30


def _aot_from_folder(name: str) -> str:
    m = re.search(r"__(\d+_(?:forward|backward|inference))", name)
    return m.group(1) if m else name


def parse_evidence_dir(evidence_dir: Path, repo_root: Path, trace: Path | None = None) -> ParsedEvidence:
    """Every compiled graph under `evidence_dir` -> FusionGroups (in launch order) + a summary.

    `trace`: a Chrome trace of a compiled step; defaults to `trace.json` in the folder if present.
    """
    root = Path(evidence_dir)
    if not root.is_dir():
        raise EvidenceFormatError(f"{evidence_dir} is not a folder: pass the folder a capture wrote "
                                  "(or a TORCH_COMPILE_DEBUG folder), or unpack the evidence pack first")
    mapper = RepoPathMapper(repo_root)
    graphs = _load_graphs(root)
    if not graphs:
        raise EvidenceFormatError(f"no {OUTPUT_CODE} under {root}: not Inductor debug output "
                                  "(capture with trace.enabled, or TORCH_COMPILE_DEBUG=1)")
    summary = EvidenceSummary()
    groups: list[FusionGroup] = []
    per_graph: list[tuple[_Graph, list[FusionGroup]]] = []
    for g in graphs:
        g_groups, source = _graph_groups(g, mapper)
        per_graph.append((g, g_groups))
        groups.extend(g_groups)
        summary.graphs.append(GraphSummary(
            graph=g.label, aot_id=g.aot_id, phase=g.phase, folder=g.folder.relative_to(root).as_posix(),
            kernel_calls=len(g_groups), calls_by_kind=dict(Counter(x.kind.value for x in g_groups)),
            post_fusion_nodes=dict(Counter(kind for _, kind in g.post_fusion)), span_source=source))
        summary.kernels_per_step[g.phase.value] = summary.kernels_per_step.get(g.phase.value, 0) + len(g_groups)
    _fill_side_files(root, summary, mapper)
    trace_path = Path(trace) if trace is not None else (root / TRACE_FILE if (root / TRACE_FILE).is_file() else None)
    if trace_path is not None:
        match = attach_trace_times(per_graph_calls(per_graph), parse_chrome_trace(trace_path))
        summary.timed_groups = match.timed_groups
        if match.windows == 0:
            summary.notes.append(f"{trace_path.name}: no '{_WINDOW} ...' region: not a trace of a compiled step")
        elif match.timed_groups == 0:
            summary.notes.append(f"{trace_path.name}: no kernel of the trace matched a compiled kernel")
        if match.ambiguous_windows:
            summary.notes.append(f"{trace_path.name}: {match.ambiguous_windows} compiled-graph call(s) matched "
                                 "several identical graphs; times went to the most recently compiled one")
    if summary.recompiles:
        summary.notes.append("recompilations: graphs of one frame do not all run every step, "
                             "kernels_per_step counts every compiled variant once")
    return ParsedEvidence(groups=groups, summary=summary)


def _fill_side_files(root: Path, summary: EvidenceSummary, mapper: RepoPathMapper) -> None:
    if (root / MANIFEST_FILE).is_file():
        manifest = _read_json(root / MANIFEST_FILE, "the manifest")
        summary.torch_version = manifest.get("torch")
        device = manifest.get("device") or {}
        summary.device = " ".join(str(device.get(k)) for k in ("type", "name") if device.get(k)) or None
        summary.notes.extend(manifest.get("notes", []))
    if (root / EAGER_COUNTS_FILE).is_file():
        summary.eager_ops_per_step = _read_json(root / EAGER_COUNTS_FILE, "eager op counts").get("ops_per_phase")
    if (root / DYNAMO_FILE).is_file():
        dyn = _read_json(root / DYNAMO_FILE, "the Dynamo summary")
        breaks: dict[tuple[str, str | None], GraphBreakInfo] = {}
        for b in dyn.get("graph_breaks", []):
            info = parse_graph_break(str(b.get("text", "")), mapper)
            key = (info.reason, info.location)
            if key in breaks:
                breaks[key].count += 1
            else:
                breaks[key] = info
        summary.graph_breaks = list(breaks.values())
        summary.recompiles = [r for item in dyn.get("recompiles", []) for r in _recompile_reasons(item.get("reasons"))]


def _recompile_reasons(payload: Any) -> list[str]:
    """A recompile_reasons payload (one reason, or a JSON list of them) -> reasons' first lines."""
    if isinstance(payload, str) and payload.lstrip().startswith("["):
        try:
            payload = json.loads(payload)
        except json.JSONDecodeError:
            pass
    items = payload if isinstance(payload, list) else [payload]
    return [" ".join(str(i).strip().splitlines()[0].split()) for i in items if str(i or "").strip()]


_GB_LOCATION = re.compile(r"Graph break in user code at (.+):(\d+)")
_GB_REASON = re.compile(r"Graph Break Reason: (.*?)(?:\n\s*Explanation:|\n\s*\n\s*User code traceback:|$)", re.S)


def parse_graph_break(text: str, mapper: RepoPathMapper) -> GraphBreakInfo:
    """Dynamo's graph-break message -> reason and location (mapped to the repo when inside it)."""
    reason = _GB_REASON.search(text)
    loc = _GB_LOCATION.search(text)
    span = None
    if loc:
        rel = mapper.map(loc.group(1))
        line = int(loc.group(2))
        span = SourceSpan(file=rel, line_start=line, line_end=line) if rel else None
    if reason:
        text_reason = " ".join(reason.group(1).split())
    else:
        text_reason = text.strip().splitlines()[0] if text.strip() else "unknown"
    return GraphBreakInfo(reason=text_reason, location=f"{loc.group(1)}:{loc.group(2)}" if loc else None, span=span)


# ----------------------------------------------------------------------------------------------
# Chrome trace -> kernel times


@dataclass(frozen=True)
class TraceEvent:
    name: str
    cat: str
    ts: float
    dur: float
    pid: Any
    tid: Any
    correlation: int | None = None


def parse_chrome_trace(source: Path | str | dict | list) -> list[TraceEvent]:
    """Complete ('X') events of a torch.profiler Chrome trace (CPU or CUDA), sorted by start time."""
    data = source
    if isinstance(source, (str, Path)):
        try:
            data = json.loads(Path(source).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise EvidenceFormatError(f"{source}: not a Chrome trace JSON ({exc})") from exc
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise EvidenceFormatError("not a Chrome trace: expected a list of events or {'traceEvents': [...]}")
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "name" not in e:
            continue
        args = e.get("args") or {}
        corr = args.get("correlation")
        out.append(TraceEvent(str(e["name"]), str(e.get("cat", "")), float(e.get("ts", 0)), float(e.get("dur", 0)),
                              e.get("pid"), e.get("tid"), int(corr) if isinstance(corr, (int, float)) else None))
    return sorted(out, key=lambda ev: ev.ts)


@dataclass
class GraphCalls:
    """A graph's kernel calls with the groups they produced (same order)."""

    label: str
    calls: list[KernelCall]
    groups: list[FusionGroup]


def per_graph_calls(per_graph: list[tuple[Any, list[FusionGroup]]]) -> list[GraphCalls]:
    return [GraphCalls(g.label, g.code.calls, groups) for g, groups in per_graph]


_WINDOW = "## Call CompiledFxGraph"
_PROFILE_PREFIX = re.compile(r"^graph_\d+_")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _trace_key(call: KernelCall) -> str:
    if call.extern:
        return "aten::" + call.name.split(".")[-1] if call.name.startswith("extern_kernels.") \
            else "aten::" + call.name.split(".", 1)[1]
    return call.name


@dataclass
class TraceMatch:
    timed_groups: int = 0
    windows: int = 0
    unmatched_windows: int = 0
    ambiguous_windows: int = 0  # matched several graphs equally well: given to the latest compiled


def attach_trace_times(graphs: list[GraphCalls], events: list[TraceEvent]) -> TraceMatch:
    """Set `time_us` (per execution of the graph) on groups whose kernels the trace shows.

    Each `## Call CompiledFxGraph` window of the trace is matched to the graph whose kernel
    sequence it shows; inside it, the i-th event of a kernel name is that kernel's i-th call.
    CPU kernels appear as `graph_N_<kernel>` (Inductor's cpp kernel profile); device kernels
    (cat 'kernel') are placed in the window of their launch by correlation id; library calls are
    the window's outermost `aten::<op>` events, timed on the device when they launched kernels.
    Windows that match several graphs equally well (recompiled variants with the same kernels)
    go to the graph compiled last (graphs are ordered by compile order).
    """
    result = TraceMatch()
    windows = [e for e in events if e.name.startswith(_WINDOW)]
    result.windows = len(windows)
    if not windows:
        return result
    launches = {e.correlation: e for e in events if e.correlation is not None and e.cat not in _DEVICE_CATS}
    device = [e for e in events if e.cat in _DEVICE_CATS]
    wanted = {_trace_key(c) for g in graphs for c in g.calls}
    totals: dict[tuple[int, int], float] = defaultdict(float)
    executions: Counter = Counter()
    for w in windows:
        seq = _window_sequence(w, events, device, launches, wanted)
        if not seq:
            continue
        gi, ambiguous = _best_graph(graphs, [name for name, _ in seq])
        if gi is None:
            result.unmatched_windows += 1
            continue
        result.ambiguous_windows += ambiguous
        executions[gi] += 1
        positions: dict[str, list[int]] = defaultdict(list)
        for ci, c in enumerate(graphs[gi].calls):
            positions[_trace_key(c)].append(ci)
        seen: Counter = Counter()
        for name, dur in seq:
            slots = positions.get(name, [])
            if seen[name] < len(slots):
                totals[(gi, slots[seen[name]])] += dur
            seen[name] += 1
    for (gi, ci), total in totals.items():
        graphs[gi].groups[ci].time_us = round(total / executions[gi], 3)
    result.timed_groups = len(totals)
    return result


def _inside(e: TraceEvent, w: TraceEvent) -> bool:
    return w.ts <= e.ts and e.ts + e.dur <= w.ts + w.dur and e is not w


def _window_sequence(w: TraceEvent, events: list[TraceEvent], device: list[TraceEvent],
                     launches: dict[int, TraceEvent], wanted: set[str]) -> list[tuple[str, float]]:
    host = [e for e in events if e.cat not in _DEVICE_CATS and _inside(e, w)]
    seq: list[tuple[float, str, float]] = []
    externs = [e for e in host if e.name.startswith("aten::") and e.name in wanted]
    outer = [e for e in externs if not any(o is not e and _inside(e, o) and o.name.startswith("aten::") for o in externs)]
    dev_by_launch: dict[int, list[TraceEvent]] = defaultdict(list)
    for d in device:
        launch = launches.get(d.correlation) if d.correlation is not None else None
        if launch is not None and _inside(launch, w):
            dev_by_launch[id(launch)].append(d)
            name = _PROFILE_PREFIX.sub("", d.name)
            if name in wanted:
                seq.append((launch.ts, name, d.dur))
    on_device = {name for _, name, _ in seq}  # a Triton launch also shows on the host: time it on the device
    for e in host:
        name = _PROFILE_PREFIX.sub("", e.name)
        if name in wanted and not name.startswith("aten::") and name not in on_device:
            seq.append((e.ts, name, e.dur))
    for e in outer:
        launched = [d for h in host if h.ts >= e.ts and h.ts + h.dur <= e.ts + e.dur for d in dev_by_launch.get(id(h), [])]
        seq.append((e.ts, e.name, sum(d.dur for d in launched) if launched else e.dur))
    return [(name, dur) for _, name, dur in sorted(seq, key=lambda t: t[0])]


def _best_graph(graphs: list[GraphCalls], names: list[str]) -> tuple[int | None, bool]:
    """The graph whose kernel multiset is closest to the window's; ties go to the later graph."""
    best, best_score, tied = None, 0.0, False
    have = Counter(names)
    for gi, g in enumerate(graphs):
        expect = Counter(_trace_key(c) for c in g.calls)
        common = sum((have & expect).values())
        score = common / max(sum(have.values()), sum(expect.values()), 1)
        if score > 0 and score >= best_score:
            tied = score == best_score
            best, best_score = gi, score
    return (best, tied) if best_score >= 0.5 else (None, False)
