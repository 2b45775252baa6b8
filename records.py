"""Typed records passed between the agents (analyst, retrieval, coder, profiler).

They are pydantic models so that they serialise to JSON for checkpoints, evidence files and the
knowledge base, and so that malformed data fails at the boundary with a message naming the field.
Records owned by one subsystem live there (the sandbox's run results in `sandbox/results.py`,
recipes in `knowledge/schema.py`); what crosses agent boundaries lives here.
"""

from __future__ import annotations

import hashlib
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class Record(BaseModel):
    """Base for all records: unknown fields are rejected, so a typo never passes silently."""

    model_config = ConfigDict(extra="forbid")


class SourceSpan(Record):
    """A region of the user's source: a repo-relative POSIX path and an inclusive line range."""

    file: str = Field(description="path relative to the repository root, with '/' separators")
    line_start: int = Field(ge=1)
    line_end: int = Field(ge=1)
    function: str | None = Field(default=None, description="enclosing function, when known")

    def __str__(self) -> str:
        lines = f"{self.line_start}" if self.line_start == self.line_end else f"{self.line_start}-{self.line_end}"
        return f"{self.file}:{lines}"

    def overlaps(self, other: "SourceSpan") -> bool:
        return self.file == other.file and self.line_start <= other.line_end and other.line_start <= self.line_end


class LibrarySpan(Record):
    """A region of code installed outside the user's repository (transformers, timm, ...): a rewrite never edits
    it in place; it is patched from the user's repository (a patch module imported at the entry point)."""

    file: str = Field(description="path under its import root (site-packages), '/' separators, e.g. "
                                  "transformers/models/llama/modeling_llama.py; absolute when under none")
    line_start: int = Field(ge=1)
    line_end: int = Field(ge=1)
    module: str | None = Field(default=None, description="dotted module, e.g. transformers.models.llama.modeling_llama")
    function: str | None = Field(default=None, description="qualified name, e.g. LlamaRMSNorm.forward or apply_rotary_pos_emb")
    distribution: str | None = Field(default=None, description="the installed distribution providing it (importlib.metadata)")
    version: str | None = Field(default=None, description="that distribution's version")

    @property
    def class_name(self) -> str | None:
        """The class of a method (`LlamaRMSNorm` of `LlamaRMSNorm.forward`), None for a module-level function."""
        if not self.function or "." not in self.function:
            return None
        owner = self.function.rsplit(".", 1)[0]
        return None if owner.endswith("<locals>") else owner.rsplit(".", 1)[-1]

    @property
    def function_name(self) -> str | None:
        return self.function.rsplit(".", 1)[-1] if self.function else None

    def lines(self) -> str:
        return f"{self.line_start}" if self.line_start == self.line_end else f"{self.line_start}-{self.line_end}"

    def __str__(self) -> str:
        where = f"{self.file}:{self.function}:{self.lines()}" if self.function else f"{self.file}:{self.lines()}"
        owner = " ".join(x for x in (self.distribution, self.version) if x)
        return f"{where} ({owner})" if owner else where

    def contains(self, file: str, line: int) -> bool:
        return self.file == file and self.line_start <= line <= self.line_end


class Phase(StrEnum):
    forward = "forward"
    backward = "backward"
    optimizer = "optimizer"


class KernelKind(StrEnum):
    fused = "fused"  # one generated kernel covering several ATen ops
    extern = "extern"  # a library kernel (mm, conv, flash attention) called by the compiled code
    single = "single"  # one generated kernel covering one ATen op


class FusionGroup(Record):
    """One kernel of the reference (compiled) execution."""

    kernel: str = Field(description="kernel name, e.g. cpp_fused_add_mean_mul_pow_rsqrt_0 or extern_kernels.mm")
    aten_ops: list[str] = Field(default_factory=list, description="ATen ops the kernel covers")
    spans: list[SourceSpan] = Field(default_factory=list, description="user source lines the ops come from")
    library_lines: list[LibrarySpan] = Field(default_factory=list, description="library lines (one line each) on the "
                                             "ops' stacks, innermost first: every library frame, so that a region "
                                             "covering a caller (apply_rotary_pos_emb) finds kernels of its callees")
    phase: Phase
    kind: KernelKind
    graph: str | None = Field(default=None, description="which compiled graph (e.g. 'forward_0')")
    time_us: float | None = Field(default=None, description="measured time per step, when a trace gave it")


class TargetSpanStats(Record):
    """What the eager program does on the target device for one source span, per training step."""

    span: SourceSpan
    phase: Phase
    op_names: list[str] = Field(description="ATen / device op names in launch order (one step)")
    ops_per_step: float = Field(ge=0)
    self_time_us_per_step: float = Field(ge=0)
    shapes: list[str] = Field(default_factory=list, description="input shapes of the ops, as recorded")


class TargetProfile(Record):
    """The eager step on the target device, aggregated per source span."""

    backend: str
    device: str
    steps_profiled: int = Field(ge=1)
    step_time_us: float = Field(ge=0, description="median wall time of one step while profiled")
    total_ops_per_step: float = Field(ge=0)
    spans: list[TargetSpanStats] = Field(default_factory=list)


class IntentCategory(StrEnum):
    rmsnorm = "rmsnorm"
    layernorm = "layernorm"
    add_norm = "add_norm"
    rope = "rope"
    swiglu = "swiglu"
    geglu = "geglu"
    attention = "attention"
    softmax = "softmax"
    cross_entropy = "cross_entropy"
    gelu = "gelu"
    silu = "silu"
    elementwise_chain = "elementwise_chain"
    optimizer_step = "optimizer_step"
    zero_grad = "zero_grad"
    host_sync = "host_sync"
    redundant_cast = "redundant_cast"
    permute_reshape = "permute_reshape"
    conv_layout = "conv_layout"
    communication = "communication"  # collectives: one per parameter instead of bucketed, blocking instead of overlapped
    normalize = "normalize"
    porting_debt = "porting_debt"


class IntentSource(StrEnum):
    runtime = "runtime"  # reference kernels aligned with profiled target ops
    static = "static"  # source scan only: lower confidence
    advisor_rule = "advisor_rule"  # msprof-analyze affinity rule over eager op sequences


class Evidence(Record):
    reference_kernels: int | None = Field(default=None, ge=0, description="K: kernels the compiler used")
    target_ops: int | None = Field(default=None, ge=0, description="N: eager ops launched per step")
    target_time_us: float | None = Field(default=None, ge=0)
    target_time_share: float | None = Field(default=None, ge=0, le=1)
    kernels: list[str] = Field(default_factory=list)
    target_op_names: list[str] = Field(default_factory=list)
    detectors: list[str] = Field(default_factory=list, description="which detectors reported it")
    notes: list[str] = Field(default_factory=list)


class Intent(Record):
    """A gap between reference and target at a source region: what to rewrite, and why."""

    id: str
    category: IntentCategory
    spans: list[SourceSpan] = Field(description="in the user's repository: the region itself or, when `library` is "
                                    "set, the user's call sites that reach the library region")
    library: LibrarySpan | None = Field(default=None, description="set when the region lives in a library: its file, "
                                        "module, class and function, lines, distribution and version. Recipes that "
                                        "edit the user's files do not apply; the rewrite is a patch module in the "
                                        "user's repository")
    evidence: Evidence = Field(default_factory=Evidence)
    estimated_saving_us: float | None = Field(default=None, ge=0, description="an estimate, never a measurement")
    estimate_basis: str | None = None
    confidence: float = Field(ge=0, le=1)
    source: IntentSource

    @property
    def in_library(self) -> bool:
        return self.library is not None

    def where(self) -> str:
        """`file:lines` of the spans, or `library location via user call sites` for a library region."""
        spans = ", ".join(str(s) for s in self.spans)
        return f"{self.library} via {spans or '?'}" if self.library is not None else spans

    @staticmethod
    def make_id(category: IntentCategory | str, spans: list[SourceSpan], library: LibrarySpan | None = None) -> str:
        """Stable id: the same gap at the same place gets the same id across runs and resumes (a library region's
        place includes its library location, not its version)."""
        key = str(category) + "|" + "|".join(sorted(str(s) for s in spans))
        if library is not None:
            key += f"|lib:{library.file}:{library.function}:{library.lines()}"
        return f"{category}-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
