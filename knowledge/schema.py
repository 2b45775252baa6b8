"""Records of the knowledge base: `Recipe` (a rewrite, as data) and `Outcome` (one tried candidate).

A recipe is declarative data. Nothing in a recipe is imported or executed by the process that
reads the knowledge base: the codemod engine interprets ``match``, renders ``replacement`` into
the user's source, and the candidate only ever runs inside the sandbox.

``match`` is ``{kind: ..., params: {...}}``. Kinds the engine is expected to interpret (each
declares the parameters it needs; ``$name`` in a parameter string binds a placeholder):

- ``expression``: a Python expression with metavariables, matched syntactically (libcst)::

      {kind: expression, params: {pattern: "$x * torch.rsqrt($x.pow(2).mean(-1, keepdim=True) + $eps)"}}

  Required: ``pattern``. Optional: ``alternatives`` (more patterns binding the same names).
- ``call``: a call of a qualified callable, optionally constrained on keyword arguments::

      {kind: call, params: {func: torch.optim.AdamW, kwargs: {foreach: false}}}

  Required: ``func``. Optional: ``kwargs`` (required literal values; ``"$name"`` binds the value),
  ``drop_kwargs`` (keywords the replacement removes), ``absent_kwargs`` (keywords that must not be
  given, e.g. ``fused`` for a recipe that adds ``fused=True``). Binds ``$args``: the call's other arguments
  as written, and ``$func``: the callee as written.
- ``op_sequence``: a regular expression over the eager ATen op names of a region, '-'-joined
  (the msprof-analyze advisor's form)::

      {kind: op_sequence, params: {regex: "(pow)?-(mean)?-(add)?-rsqrt-mul-(type_as)?"}}

  Required: ``regex`` (must compile). Identifies a region; a ``semantic`` or ``expression``
  pattern in ``alternatives`` says how to rewrite it.
- ``semantic``: a whole function or a module's ``forward`` is run next to the replacement on the
  shapes captured from the real step, comparing outputs and gradients (robust to how the code is
  written)::

      {kind: semantic, params: {scope: module_forward, signature: [x], attributes: [weight, eps]}}

  Required: ``scope`` (``function`` or ``module_forward``) and ``signature`` (argument names,
  bound as placeholders); optional ``attributes`` (module attributes, bound as ``$self_<name>``),
  ``alternatives`` (syntactic forms: the fast path), and for a function matched by behaviour
  ``candidates`` (replacements, tried in order) with ``probe`` (input shape sets, ``{x: {shape: [..],
  dtype: float32}}``): the coder runs the function and each candidate in a sandboxed child and writes
  in the first one whose outputs and input gradients agree (agents/coder/semantic_match.py). A ``module_forward``
  matched so runs on a stand-in module holding its ``attributes`` (probe inputs ``self_<name>``); ``buffers`` names
  attributes the class must not make parameters.

- ``statements``: a sequence of statement patterns matched against consecutive statements of one
  block inside the span (a metavariable binds the same code in every statement it appears in)::

      {kind: statements, params: {pattern: |
          $s = ($q @ $k.transpose(-2, -1)) * $scale
          $s = $s.masked_fill($m, float("-inf"))
          $p = torch.softmax($s, dim=-1)
          $_[$p @ $v]
      }}

  Required: ``pattern`` (multi-line text, or a list whose items are one statement each or a list
  of alternative spellings of that statement). Optional: ``alternatives`` (whole other
  sequences), ``all_in_span``, ``slack`` (how many matched statements may lie outside the span,
  default 1), ``helpers`` (as for ``expression``), ``modules`` (metavariable -> the module kinds it must
  be, by the name of the class the file constructs it from: ``{norm: [RMSNorm]}`` refuses a LayerNorm). The last slot may be the hole ``$_[E]``: the statement that contains E exactly once;
  ``$_[T]`` in the replacement renders that statement with E replaced by T. The replacement is
  statements; ``$matched`` (alone on its line) renders the matched statements as written, so
  ``$matched`` followed by new lines inserts code after them. The rewrite is refused when a name
  the removed statements assigned is still read afterwards but no longer assigned unconditionally.
- ``decorate``: the function (``scope: function``) or the ``forward`` of the class
  (``scope: module_forward``) overlapping the span gets the replacement as a decorator::

      {kind: decorate, params: {scope: function}}     # replacement: "torch.compile"

- ``library_patch``: a region that lives in a library (``Intent.library``) is rewritten from the user's
  repository: the replacement is one function definition (keeping the library function's signature) that a patch
  module, ``trainbridge_patches.py`` beside the entry script, installs by assignment on the library's class or module,
  when the installed version lies in ``versions`` (the range the recipe was checked against)::

      {kind: library_patch, params: {module: transformers.models.llama.modeling_llama,
                                     function: LlamaRMSNorm.forward, versions: ">=4.48,<6"}}

  Required: ``module``, ``function`` (``func`` or ``Class.method``) and ``versions``; optional ``distribution``
  (default: the module's top package). ``imports`` go to the patch module's top (tools/codemods/library_patch.py).

Every kind also takes ``define``: module-level helper code (``def``, ``class`` and ``NAME = value``
statements, no ``$``) inserted once after the file's imports, e.g. an ``autograd.Function``
around a fused op without a registered backward. It is data like the rest: inserted, never run
by the engine.

New kinds are added by adding an entry to ``MATCH_KINDS`` (the engine must interpret them).

``replacement`` is template text with ``$name`` / ``${name}`` placeholders (``$$`` is a literal
``$``); every placeholder must be bound by the match.

``also`` lists companion edits: calls the new API needs changed wherever the repository makes them, each an
expression pattern, its replacement and why (the torch_npu fused optimizers raise on
``zero_grad(set_to_none=True)`` and keep gradients in one buffer, so their recipes turn every ``$o.zero_grad()``
into ``$o.zero_grad(set_to_none=False)``). The coder applies them to every tracked Python file of the candidate
and says in the commit message which lines changed.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import datetime, timezone
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    ValidationError,
    field_validator,
    model_validator,
)

from trainbridge.knowledge.versions import check_range
from trainbridge.records import Evidence, IntentCategory


class Target(StrEnum):
    cpu = "cpu"
    cuda = "cuda"
    npu = "npu"


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid", validate_by_name=True, validate_by_alias=True, serialize_by_alias=True
    )


# kind -> (required params, names it binds implicitly)
MATCH_KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "expression": (("pattern",), ()),
    "call": (("func",), ("args", "func")),
    "op_sequence": (("regex",), ()),
    "semantic": (("scope", "signature"), ()),
    "statements": (("pattern",), ("matched",)),
    "decorate": (("scope",), ()),
    "library_patch": (("module", "function", "versions"), ()),
}

_SLUG = r"^[a-z0-9][a-z0-9_.-]*[a-z0-9]$"
_PLACEHOLDER = re.compile(r"\$(?:([_a-zA-Z][_a-zA-Z0-9]*)|\{([_a-zA-Z][_a-zA-Z0-9]*)\})")


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []


def placeholders(text: str) -> set[str]:
    """The ``$name`` / ``${name}`` placeholders used in a template (``$$`` is a literal dollar)."""
    return {a or b for a, b in _PLACEHOLDER.findall(text.replace("$$", ""))}


class MatchSpec(_Model):
    """What a recipe applies to: a pattern kind and its parameters (data, interpreted elsewhere)."""

    kind: str = Field(description="one of MATCH_KINDS: expression | call | op_sequence | semantic | statements | decorate "
                                  "| library_patch")
    params: dict[str, JsonValue] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_kind(self) -> "MatchSpec":
        if self.kind not in MATCH_KINDS:
            raise ValueError(f"unknown match kind {self.kind!r}; expected one of {sorted(MATCH_KINDS)}")
        required, _ = MATCH_KINDS[self.kind]
        missing = [p for p in required if p not in self.params]
        if missing:
            raise ValueError(f"match kind {self.kind!r} needs params {missing}")
        if self.kind == "op_sequence":
            try:
                re.compile(str(self.params["regex"]))
            except re.error as exc:
                raise ValueError(f"params.regex does not compile: {exc}") from None
        if self.kind == "library_patch":
            check_range(str(self.params["versions"]))
            if not re.match(r"^[A-Za-z_][\w.]*$", str(self.params["module"])) or not re.match(
                    r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)?$", str(self.params["function"])):
                raise ValueError("params.module must be a dotted module and params.function 'func' or 'Class.method'")
        if self.kind == "semantic":
            if self.params["scope"] not in ("function", "module_forward"):
                raise ValueError("params.scope must be 'function' or 'module_forward'")
            if not isinstance(self.params["signature"], list):
                raise ValueError("params.signature must be a list of argument names")
        return self

    def bound_names(self) -> set[str]:
        """Placeholder names this match binds, which the replacement may use."""
        names = set(MATCH_KINDS[self.kind][1])
        for text in _strings(self.params):
            names |= placeholders(text)
        if self.kind == "semantic":
            names |= {str(n) for n in self.params["signature"]}  # type: ignore[union-attr]
            names |= {f"self_{a}" for a in self.params.get("attributes", []) or []}  # type: ignore[union-attr]
        return names


class Precondition(_Model):
    """A checkable condition for a recipe to be legal, e.g. ``dtype x in [float16, bfloat16]``."""

    kind: Literal["shape", "dtype", "layout", "backend_version", "device", "contiguity", "value"]
    subject: str = Field(description="what is checked: a placeholder ('x', 'x.shape[-1]') or a package ('torch_npu')")
    op: Literal["eq", "ne", "lt", "le", "gt", "ge", "in", "not_in", "divisible_by", "between"]
    value: JsonValue
    note: str = ""

    @model_validator(mode="after")
    def _check_value(self) -> "Precondition":
        if self.op in ("in", "not_in") and not isinstance(self.value, list):
            raise ValueError(f"op {self.op!r} needs a list value")
        if self.op == "between" and not (isinstance(self.value, list) and len(self.value) == 2):
            raise ValueError("op 'between' needs a [low, high] value")
        if self.op == "divisible_by" and not (isinstance(self.value, int) and self.value > 0):
            raise ValueError("op 'divisible_by' needs a positive integer value")
        return self


class PrecisionReference(_Model):
    """The original region computed in higher precision, for the gate only (never committed, never a candidate):
    the same match as the recipe's, this replacement (and `define`, a helper it calls) instead of the rewrite's.
    A rewrite that computes in fp32 where the original rounds to bf16 moves a bf16 program's trajectory; it passes
    when it matches this reference where it does not match the original (agents/profiler/gate.py)."""

    replacement: str = Field(min_length=1)
    define: str | None = Field(default=None, description="a helper the replacement calls, defined once per file")
    imports: list[str] = Field(default_factory=list)


class Numerics(_Model):
    """How close the rewritten region must stay to the original: bit-exact or within tolerances."""

    class_: Literal["exact", "tolerance"] = Field(alias="class")
    rtol: float | None = Field(default=None, ge=0)
    atol: float | None = Field(default=None, ge=0)
    loss_rtol: float | None = Field(default=None, ge=0, description="relative loss drift allowed over the check steps")
    grad_cosine_min: float | None = Field(default=None, gt=0, le=1, description="per-parameter gradient cosine floor, "
                                          "when the gate's default (0.9999) is tighter than the rewrite's rounding allows")
    timed_delta_cosine_min: float | None = Field(default=None, gt=0, le=1, description=(
        "per-parameter floor on the cosine of its change over the timed steps, candidate vs baseline, when the gate's "
        "default (0.99) is tighter than the rewrite's rounding allows once an optimizer amplifies it (never below the "
        "gate's own floor for a drifting baseline, 0.9)"))
    timed_delta_norm_rtol: float | None = Field(default=None, gt=0, le=1, description=(
        "per-parameter relative difference of the size of its change over the timed steps, when the gate's default "
        "(0.1) is tighter than the rewrite's rounding allows once an optimizer amplifies it (never above the gate's own "
        "cap for a drifting baseline, 0.25)"))
    precision_change: str | None = Field(default=None, min_length=10, description=(
        "how the rewrite rounds differently from the original (a fused kernel computing in fp32 and rounding once, a "
        "reassociated product): a rewrite that passes is flagged for review with this sentence in the run's report"))
    precision_reference: PrecisionReference | None = Field(default=None, description=(
        "the original region in higher precision: the gate also compares the candidate with it when the candidate "
        "does not match the original (needs precision_change)"))

    @model_validator(mode="after")
    def _check_class(self) -> "Numerics":
        if self.class_ == "tolerance" and (self.rtol is None or self.atol is None):
            raise ValueError("class 'tolerance' needs rtol and atol")
        if self.class_ == "exact" and any(v is not None for v in (self.rtol, self.atol, self.loss_rtol, self.grad_cosine_min,
                                                                   self.timed_delta_cosine_min, self.timed_delta_norm_rtol,
                                                                   self.precision_change, self.precision_reference)):
            raise ValueError("class 'exact' takes no rtol/atol/loss_rtol/grad_cosine_min/timed_delta_cosine_min/"
                             "timed_delta_norm_rtol/precision_change/precision_reference")
        if self.precision_reference is not None and self.precision_change is None:
            raise ValueError("precision_reference needs precision_change: the sentence the report flags for review")
        return self


class Provenance(_Model):
    kind: Literal["seed", "learned", "llm"]
    notes: str = ""
    sources: list[str] = Field(default_factory=list, description="where the facts come from (docs, commits, runs)")


class RecipeStats(_Model):
    """Outcome counts, maintained by the knowledge base from recorded outcomes."""

    tried: int = Field(default=0, ge=0)
    accepted: int = Field(default=0, ge=0)
    rejected: int = Field(default=0, ge=0)
    best_ratio: float | None = Field(
        default=None, gt=0, description="lowest accepted candidate/baseline step-time ratio (0.8 = 20% faster)"
    )

    @model_validator(mode="after")
    def _check_counts(self) -> "RecipeStats":
        if self.accepted + self.rejected > self.tried:
            raise ValueError("accepted + rejected cannot exceed tried")
        return self


class CompanionEdit(_Model):
    """A call the rewritten API needs changed wherever the repository makes it (the fused NPU optimizer raises on
    ``zero_grad(set_to_none=True)``, and trains on stale gradients after a module's ``zero_grad()`` sets them to
    None): an expression rewrite applied to every matching expression of every Python file of the candidate."""

    pattern: str = Field(min_length=1, description="an expression pattern, as match kind 'expression' takes it")
    alternatives: list[str] = Field(default_factory=list)
    replacement: str = Field(min_length=1)
    why: str = Field(min_length=1, description="what the rewritten API needs (said in the commit message)")

    @model_validator(mode="after")
    def _check_names(self) -> "CompanionEdit":
        bound = set().union(*(placeholders(text) for text in (self.pattern, *self.alternatives)))
        unbound = placeholders(self.replacement) - bound
        if unbound:
            raise ValueError(f"companion edit replacement uses unbound placeholder(s): {sorted(unbound)}")
        return self


class Recipe(_Model):
    """A rewrite in the knowledge base (see the module docstring for ``match`` and ``replacement``)."""

    id: str = Field(pattern=_SLUG, description="slug, e.g. 'rmsnorm-f-rms-norm'")
    title: str = Field(min_length=1)
    category: IntentCategory
    targets: list[Target] = Field(min_length=1)
    match: MatchSpec
    replacement: str = Field(min_length=1)
    imports: list[str] = Field(default_factory=list)
    preconditions: list[Precondition] = Field(default_factory=list)
    numerics: Numerics
    pitfalls: list[str] = Field(default_factory=list)
    keywords: list[str] = Field(
        default_factory=list, description="op / kernel names of the regions this rewrites (used for retrieval)"
    )
    also: list[CompanionEdit] = Field(default_factory=list, description="calls the new API needs changed elsewhere in "
                                      "the repository (applied with the rewrite, in every Python file of the candidate)")
    requires: list[Literal["torchair"]] = Field(
        default_factory=list, description="what the host must have for the rewrite to run at all (torchair: torch_npu's "
        "TorchAir compiler, on a real NPU host): a run on a host without it does not try the recipe")
    provenance: Provenance
    stats: RecipeStats = Field(default_factory=RecipeStats)

    @field_validator("targets")
    @classmethod
    def _unique_targets(cls, targets: list[Target]) -> list[Target]:
        if len(set(targets)) != len(targets):
            raise ValueError("targets must not repeat")
        return targets

    @field_validator("imports")
    @classmethod
    def _import_lines(cls, imports: list[str]) -> list[str]:
        for line in imports:
            if not re.match(r"^(import [\w.]+( as \w+)?|from [\w.]+ import [\w, ]+( as \w+)?)$", line.strip()):
                raise ValueError(f"not an import line: {line!r}")
        return imports

    @model_validator(mode="after")
    def _placeholders_bound(self) -> "Recipe":
        unbound = placeholders(self.replacement) - self.match.bound_names()
        if unbound:
            raise ValueError(f"replacement uses placeholders the match does not bind: {sorted(unbound)}")
        return self

    def content_key(self) -> str:
        """Hash of everything but the stats: tells whether two versions of a recipe say the same."""
        data = self.model_dump(mode="json", exclude={"stats"})
        return hashlib.sha256(_canonical_json(data).encode()).hexdigest()

    def embedding_text(self) -> str:
        """The text the knowledge base embeds for similarity search."""
        parts = [self.title, str(self.category), " ".join(self.keywords), self.match.kind]
        parts += _strings(self.match.params)
        parts.append(self.replacement)
        return "\n".join(p for p in parts if p)


PENDING_VERDICT = "speed_unmeasured_numerics_ok"


class Outcome(_Model):
    """One tried candidate and its verdict: what was tried where, and what the gate measured."""

    id: str = Field(default="", description="stable id; derived from the content when empty")
    run_id: str = Field(min_length=1)
    intent_id: str = Field(min_length=1)
    category: IntentCategory
    evidence: Evidence = Field(default_factory=Evidence)
    recipe_id: str | None = Field(default=None, description="None for a patch the LLM wrote without a recipe")
    diff: str = ""
    verdict: str = Field(min_length=1, description="'accepted', or the reason it was rejected")
    ratio: float | None = Field(default=None, gt=0, description="candidate/baseline step time (< 1 = faster)")
    ratio_ci: tuple[float, float] | None = Field(default=None, description="confidence interval of ratio")
    backend: Target
    versions: dict[str, str] = Field(default_factory=dict, description="e.g. torch, torch_npu, CANN")
    timestamp: AwareDatetime = Field(default_factory=lambda: datetime.now(timezone.utc))

    @property
    def accepted(self) -> bool:
        return self.verdict == "accepted"

    @property
    def pending(self) -> bool:
        """Numerics verified on the NPU emulation, speed not measured yet: neither a win nor a loss."""
        return self.verdict.startswith(PENDING_VERDICT)

    @model_validator(mode="after")
    def _fill_id(self) -> "Outcome":
        if self.ratio_ci is not None and self.ratio_ci[0] > self.ratio_ci[1]:
            raise ValueError("ratio_ci must be (low, high)")
        if not self.id:
            data = self.model_dump(mode="json", exclude={"id"})
            self.id = "outcome-" + hashlib.sha1(_canonical_json(data).encode()).hexdigest()[:16]
        return self

    def evidence_text(self) -> str:
        """The text the knowledge base embeds: category plus the evidence's op and kernel names."""
        return evidence_text(str(self.category), self.evidence)


def evidence_text(category: str, evidence: Evidence) -> str:
    parts = [category, " ".join(evidence.kernels), " ".join(evidence.target_op_names)]
    parts += evidence.detectors + evidence.notes
    return "\n".join(p for p in parts if p)


def _canonical_json(data: Any) -> str:
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


class OutcomeHit(_Model):
    """One past outcome found near an intent's evidence (what the store's nearest-outcome query gives
    the retrieval agent's ranking)."""

    recipe_id: str
    accepted: bool
    similarity: float
    ratio: float | None = None


class RecipeFileError(ValueError):
    """A recipe file that cannot be loaded; the message names the file and the field."""


def _format_errors(name: str, exc: ValidationError) -> str:
    lines = []
    for err in exc.errors(include_url=False):
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{name}: {loc}: {msg}" if loc else f"{name}: {msg}")
    return "\n".join(lines)


def parse_recipe(data: Any, name: str = "<recipe>") -> Recipe:
    """Validate one recipe mapping; errors are a `RecipeFileError` naming ``name`` and the field."""
    if not isinstance(data, dict):
        raise RecipeFileError(f"{name}: a recipe must be a mapping of fields, got {type(data).__name__}")
    try:
        return Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeFileError(_format_errors(name, exc)) from None


def load_recipe_file(path: str | Path) -> Recipe:
    """Load and validate one YAML recipe file.

    Raises `RecipeFileError` with lines like ``rmsnorm.yaml: numerics.rtol: Input should be a valid
    number`` so the author knows which file and field to fix.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeFileError(f"{path.name}: cannot read recipe file: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecipeFileError(f"{path.name}: not valid YAML: {exc}") from None
    return parse_recipe(data, path.name)


def load_recipe_dir(directory: str | Path) -> list[Recipe]:
    """All ``*.yaml`` recipes of a folder, sorted by file name; duplicate ids are an error."""
    recipes: list[Recipe] = []
    seen: dict[str, str] = {}
    for path in sorted(Path(directory).glob("*.yaml")):
        recipe = load_recipe_file(path)
        if recipe.id in seen:
            raise RecipeFileError(f"{path.name}: id: {recipe.id!r} is already used by {seen[recipe.id]}")
        seen[recipe.id] = path.name
        recipes.append(recipe)
    return recipes


__all__ = [
    "MATCH_KINDS",
    "MatchSpec",
    "Numerics",
    "Outcome",
    "Precondition",
    "Provenance",
    "Recipe",
    "RecipeFileError",
    "RecipeStats",
    "Target",
    "evidence_text",
    "load_recipe_dir",
    "load_recipe_file",
    "parse_recipe",
    "placeholders",
]
