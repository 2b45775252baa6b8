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

This module reads the evidence folder and returns its records; each file format has its own parser:
inductor/output_code.py, inductor/fx.py, inductor/groups.py (one graph -> FusionGroups),
inductor/trace.py (Chrome trace -> kernel times), repo_paths.py, inductor/format.py (file names).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import Field

from trainbridge.records import FusionGroup, Phase, Record, SourceSpan
from trainbridge.tools.inductor.format import (  # noqa: F401 - the format's names, re-exported for importers
    DEBUG_DIR,
    DYNAMO_FILE,
    EAGER_COUNTS_FILE,
    EVIDENCE_FORMAT,
    FX_GRAPH_FILES,
    KERNEL_MAP_FILE,
    MANIFEST_FILE,
    OUTPUT_CODE,
    POST_FUSION_FILE,
    PROVENANCE_FILE,
    TRACE_FILE,
    VIEW_OPS,
    EvidenceFormatError,
)
from trainbridge.tools.inductor.fx import FxNode, parse_fx_graph, parse_post_fusion
from trainbridge.tools.inductor.groups import Graph, graph_groups, graph_label, phase_of
from trainbridge.tools.inductor.output_code import parse_output_code
from trainbridge.tools.inductor.trace import CALL_WINDOW, attach_trace_times, parse_chrome_trace, per_graph_calls
from trainbridge.tools.repo_paths import RepoPathMapper


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


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EvidenceFormatError(f"{path}: cannot read {what} ({exc})") from exc


def _load_graphs(root: Path) -> list[Graph]:
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
        phase = phase_of(aot_id, snap.get("is_backward") if snap else None)
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
        graphs.append(Graph(graph_label(aot_id, phase), aot_id, phase, folder, code, fx, provenance,
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
    per_graph: list[tuple[Graph, list[FusionGroup]]] = []
    for g in graphs:
        g_groups, source = graph_groups(g, mapper)
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
            summary.notes.append(f"{trace_path.name}: no '{CALL_WINDOW} ...' region: not a trace of a compiled step")
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
