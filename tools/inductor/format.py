"""The Inductor evidence format: its version, the files a capture folder holds, and what counts as a
view op. Shared by the parsers (inductor_*.py), the capture (inductor/capture.py) and evidence packs."""

from __future__ import annotations



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


class EvidenceFormatError(ValueError):
    """The folder or file is not Inductor evidence this parser can read."""
