"""Ascend advisor's "affinity API" rules as one more detector over the eager op sequence.

msprof-analyze's advisor flags runs of eager ATen ops that a fused NPU API replaces, with regexes
over '-'-joined op names (data file beside this module). TrainBridge runs the same rules over the
forward ops of one profiled step so that it finds at least everything the advisor finds, and adds
what the advisor cannot: the exact source lines of the matched ops.

The advisor reads top-level ATen ops from the NPU timeline (``matmul``, ``softmax``); our op
table holds dispatched ops (``bmm``, ``_softmax``), so names are normalised first and pure view
bookkeeping is dropped.

Ops of a model that lives in a library (transformers' LlamaForCausalLM) all come from the user's one
`model(x)` line; the library frames each op ran under tell the regions apart: a match is located at the
innermost library function all its ops ran under (`LlamaRMSNorm.forward`; `apply_rotary_pos_emb` for a
rotary match whose ops are partly in the `rotate_half` it calls), with the user's lines as its call sites.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from trainbridge.records import Evidence, Intent, IntentCategory, IntentSource, LibrarySpan, Phase, SourceSpan
from trainbridge.tools.eager_profile import UNATTRIBUTED_FILE, EagerOp, EagerOpTable

RULES_FILE = Path(__file__).parent / "data" / "msprof_affinity_rules.yaml"
CONFIDENCE = 0.5

# Dispatched op name -> the name the advisor's timeline shows.
_RENAME = {
    "mm": "matmul", "bmm": "matmul", "addmm": "matmul", "baddbmm": "matmul", "matmul": "matmul",
    "_softmax": "softmax", "softmax": "softmax", "_log_softmax": "log_softmax",
    "native_layer_norm": "layer_norm", "native_group_norm": "group_norm",
    "native_dropout": "dropout", "split": "chunk", "split_with_sizes": "chunk", "unsafe_split": "chunk",
    "_to_copy": "type_as",
}
# Bookkeeping that the advisor's timeline does not show between the ops it matches.
_NOISE = {"_unsafe_view", "detach", "alias", "t", "expand", "clone", "lift_fresh", "empty", "empty_like", "unsqueeze", "squeeze", "select"}

_API_CATEGORY = {
    "npu_fusion_attention": IntentCategory.attention,
    "npu_rotary_mul": IntentCategory.rope,
    "npu_rms_norm": IntentCategory.rmsnorm,
    "npu_swiglu": IntentCategory.swiglu,
    "npu_geglu": IntentCategory.geglu,
    "npu_confusion_transpose": IntentCategory.permute_reshape,
    "fast_gelu": IntentCategory.gelu,
    "npu_scaled_masked_softmax": IntentCategory.softmax,
    "npu_add_layer_norm": IntentCategory.add_norm,
    "npu_group_norm_silu": IntentCategory.silu,
    "NpuFusedAdamW": IntentCategory.optimizer_step,
    "NpuFusedAdam": IntentCategory.optimizer_step,
    "NpuFusedSGD": IntentCategory.optimizer_step,
}


@dataclass(frozen=True)
class AffinityRule:
    api: str  # e.g. torch_npu.npu_rotary_mul
    pattern: str  # the advisor's regex, or "<OptimizerClass>.step" for optimizer rules
    category: IntentCategory | None  # None: an API TrainBridge has no intent category for (e.g. mindspeed ops)
    kind: str = "aten"  # "aten": op-sequence rule; "optimizer": optimizer-class rule

    @functools.cached_property
    def regex(self) -> re.Pattern:
        return translate(self.pattern)


@functools.cache
def load_rules(path: Path = RULES_FILE) -> tuple[AffinityRule, ...]:
    """Every (API, regex) pair of every CANN version in the file, once."""
    entries = yaml.safe_load(path.read_text(encoding="utf-8"))
    seen: dict[tuple[str, str], AffinityRule] = {}
    for entry in entries:
        for group_name, group in (entry.get("operator_rules") or {}).items():
            kind = "optimizer" if group_name == "Optimizer" else "aten"
            for api, patterns in ((group or {}).get("add") or {}).items():
                for pattern in patterns:
                    seen.setdefault((api, pattern), AffinityRule(api, pattern.strip(), _category(api), kind))
    return tuple(seen.values())


def _category(api: str) -> IntentCategory | None:
    return _API_CATEGORY.get(api.rsplit(".", 1)[-1])


_TOKEN = re.compile(r"^\(?([\w|]+?)_?\)?(\{\d*,?\d*\})?$")


def translate(pattern: str) -> re.Pattern:
    """The advisor's `a-(b){0,1}-c` over '-'-joined names, as a regex over names each followed by '-'
    (so optional tokens at either end work), matching whole op names only."""
    parts = []
    for token in _split_top_level(pattern.strip()):
        found = _TOKEN.match(token.strip())
        if not found:
            raise ValueError(f"unsupported advisor pattern token {token!r} in {pattern!r}")
        names = "|".join(re.escape(n.rstrip("_")) for n in found.group(1).split("|"))  # masked_fill_ == masked_fill here
        parts.append(f"(?:(?:{names})-){found.group(2) or ''}")
    return re.compile(rf"(?:^|(?<=-))({''.join(parts)})")


def _split_top_level(pattern: str) -> list[str]:
    tokens, depth, current = [], 0, ""
    for char in pattern:
        depth += char == "("
        depth -= char == ")"
        if char == "-" and depth == 0:
            tokens.append(current)
            current = ""
        else:
            current += char
    return [*tokens, current]


def normalise(name: str) -> str:
    short = name.split("::", 1)[-1].split(".", 1)[0]
    short = short[:-1] if short.endswith("_") and not short.startswith("_") else short
    return _RENAME.get(short, short)


def forward_sequence(table: EagerOpTable, step: int = 0) -> list[tuple[str, EagerOp]]:
    """The forward ops of one step as the advisor's timeline would show them: normalised names, no
    bookkeeping ops, no mask-building constants, and a matmul's internal views folded into it."""
    ops = [op for op in table.ops if op.step == step and op.phase == Phase.forward]
    sequence = [(normalise(op.name), op) for op in ops]
    sequence = [(name, op) for name, op in sequence if name not in _NOISE and name not in _CONSTANT_BUILDERS]
    kept: list[tuple[str, EagerOp]] = []
    for index, (name, op) in enumerate(sequence):
        following = sequence[index + 1] if index + 1 < len(sequence) else None
        if name == "view" and following is not None and following[0] == "matmul" and _same_line(following[1], op):
            continue  # the reshape a matmul does to its input (matmul -> view + mm / bmm)
        kept.append((name, op))
    return kept


# Constants (masks, position ids) that the rules never include: they only interrupt a sequence.
_CONSTANT_BUILDERS = {"ones", "zeros", "full", "arange", "triu", "tril", "eq", "ne", "lt", "gt", "le", "ge", "logical_not", "bitwise_not"}
_SAME_LINE_ONLY = {IntentCategory.permute_reshape}  # a reshape and a transpose on different lines are unrelated


def _same_line(a: EagerOp, b: EagerOp) -> bool:
    """Same user line and, for library code, the same library line (frames are interned per code and line)."""
    return a.span.file == b.span.file and a.span.line_start == b.span.line_start and a.library_stack[:1] == b.library_stack[:1]


def library_region(table: EagerOpTable, ops: list[EagerOp]) -> LibrarySpan | None:
    """The innermost library function every op of `ops` ran under, narrowed to the lines of it they ran on
    (`LlamaRMSNorm.forward` lines 64-67); None when one of them ran in user code only (or they share no library
    function)."""
    stacks = [table.library_of(op) for op in ops]
    if not stacks or not all(stacks):
        return None
    shared = [{_function_key(f) for f in stack} for stack in stacks[1:]]
    for frame in stacks[0]:
        key = _function_key(frame)
        if all(key in keys for keys in shared):
            lines = [f.line for stack in stacks for f in stack if _function_key(f) == key]
            return frame.function.model_copy(update={"line_start": min(lines), "line_end": max(lines)})
    return None


def _function_key(frame) -> tuple[str, str | None, int]:
    return frame.function.file, frame.function.function, frame.function.line_start


def detect(table: EagerOpTable, optimizer_class: str | None = None, rules: tuple[AffinityRule, ...] | None = None) -> list[Intent]:
    """Intents for every advisor rule that matches: op-sequence rules over the forward ops (at the
    matched ops' lines), optimizer rules on the optimizer's class (at the optimizer step's lines)."""
    sequence = forward_sequence(table)
    joined, starts = _join(name for name, _ in sequence)
    joined += "-"
    found: dict[tuple[IntentCategory, tuple[str, ...], str], tuple[AffinityRule, list[list[EagerOp]], LibrarySpan | None]] = {}
    for rule in rules if rules is not None else load_rules():
        if rule.category is None:
            continue
        if rule.kind == "optimizer":
            if optimizer_class is not None and rule.pattern == f"{optimizer_class}.step":
                ops = [op for op in table.ops if op.step == 0 and op.phase == Phase.optimizer]
                if _spans(ops):
                    found.setdefault((rule.category, tuple(str(s) for s in _spans(ops)), ""), (rule, [], None))[1].append(ops)
            continue
        for hit in rule.regex.finditer(joined):
            first, last = _op_range(starts, hit.start(1), hit.end(1))
            ops = [op for _, op in sequence[first : last + 1]]
            spans = _spans(ops)
            if not spans or (rule.category in _SAME_LINE_ONLY and (len(spans) > 1 or len({tuple(op.library_stack[:1]) for op in ops}) > 1)):
                continue
            library = library_region(table, ops)
            key = (rule.category, tuple(str(s) for s in spans), str(library) if library else "")
            found.setdefault(key, (rule, [], library))[1].append(ops)
    intents = []
    for (category, _, _), (rule, occurrences, library) in found.items():
        spans = _spans(occurrences[0])
        names = [normalise(op.name) for op in occurrences[0]]
        intents.append(
            Intent(
                id=Intent.make_id(category, spans, library),
                category=category,
                spans=spans,
                library=library,
                evidence=Evidence(
                    target_ops=len(occurrences[0]),
                    target_op_names=names,
                    detectors=["msprof_affinity"],
                    notes=[f"advisor rule {rule.api}: {rule.pattern!r} matched {len(occurrences)} time(s) per step"],
                ),
                confidence=CONFIDENCE,
                source=IntentSource.advisor_rule,
            )
        )
    return intents


def _join(names) -> tuple[str, list[int]]:
    starts, parts, offset = [], [], 0
    for name in names:
        starts.append(offset)
        parts.append(name)
        offset += len(name) + 1
    return "-".join(parts), starts


def _op_range(starts: list[int], begin: int, end: int) -> tuple[int, int]:
    import bisect

    first = bisect.bisect_right(starts, begin) - 1
    last = bisect.bisect_right(starts, max(begin, end - 1)) - 1
    return first, last


def _spans(ops: list[EagerOp]) -> list[SourceSpan]:
    lines = sorted({(op.span.file, op.span.line_start, op.span.function) for op in ops if op.span.file != UNATTRIBUTED_FILE})
    return [SourceSpan(file=file, line_start=line, line_end=line, function=function) for file, line, function in lines]
