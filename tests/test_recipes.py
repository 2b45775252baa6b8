"""Every seed recipe applied to real code, run, and compared with the original program.

For each case the program (a bundled example, or a differently written variant under
tests/fixtures/recipe_variants/) is copied to a temporary folder, the static scanner's intent of
the case's category gives the spans, and the recipe is applied exactly as the coder does
(`apply_recipe(source, recipe, span)` for each span of the intent until one applies). The
rewritten program must parse, import and train: a child process builds it through its
`trainbridge_entry`, records the first-step gradients of `loss_fn` and the losses of a few
`train_step` calls, and the parent compares them with the unmodified program's (same seed, same
batches) within the recipe's numerics class. torch_npu recipes run in a child with the NPU
emulation first on PYTHONPATH and device "npu"; their baseline is the original program on that same
emulated device (as the gate compares head and candidate on the target: the emulated device's own
op decompositions differ from the CPU's by ~1e-9, which an 'exact' recipe must not be blamed for).

All cases of one program and backend run in one child (one torch import); the children of the
bundled examples take a while and are marked slow.
"""

from __future__ import annotations

import ast
import json
import math
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
import pytest
import torch

from trainbridge.agents.analyst.static.scan import scan_repo
from trainbridge.knowledge.schema import Recipe, load_recipe_dir
from trainbridge.knowledge.store import SEED_DIR
from trainbridge.records import SourceSpan
from trainbridge.sandbox.npu_emulation import NpuSelection, selection_env
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe
from trainbridge.tools.codemods.statements import hole_spans

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
VARIANTS = Path(__file__).resolve().parent / "fixtures" / "recipe_variants"
NPU_REFERENCE = Path(__file__).parent / "fixtures" / "npu_reference"
RECIPES: dict[str, Recipe] = {r.id: r for r in load_recipe_dir(SEED_DIR)}
PYTHON = sys.executable

# Gradient agreement required of every 'tolerance' recipe, besides its own rtol/atol (README gate).
MIN_GLOBAL_COSINE = 0.9999
MIN_PARAM_COSINE = 0.999


# ------------------------------------------------------------------------------------------------
# the child: builds programs through their entry, records first-step grads and a loss trajectory

RUNNER = r'''
import contextlib, importlib, io, json, logging, math, os, random, sys, tomllib, traceback
import torch

torch.set_num_threads(1)
spec = json.load(open(sys.argv[1]))
if spec["npu"]:
    import torch_npu  # the emulation (first on PYTHONPATH): registers the npu device

class Count(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.n = 0
    def emit(self, record):
        self.n += 1

def reseed(seed):
    random.seed(seed)
    torch.manual_seed(seed)

def load(program):
    folder = program["dir"]
    sys.path.insert(0, folder)
    entry = tomllib.loads(open(os.path.join(folder, "trainbridge.toml")).read())["entry"]
    module, _, fn = entry.partition(":")
    return getattr(importlib.import_module(module), fn)

def run(program):
    entry = load(program)
    device, seed, steps = spec["device"], program["seed"], program["steps"]
    reseed(seed)
    parts = entry(device, seed)
    model, batch, loss_fn = parts["model"], parts["batch"], parts["loss_fn"]
    reseed(seed)
    model.zero_grad(set_to_none=True)
    with contextlib.redirect_stdout(io.StringIO()):
        first = loss_fn(model, batch(0))
        first.backward()
    grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}
    torch.save(grads, program["grads"])
    reseed(seed)
    parts = entry(device, seed)
    model, optimizer, batch, train_step = parts["model"], parts["optimizer"], parts["batch"], parts["train_step"]
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    counter = Count()
    root.addHandler(counter)
    out = io.StringIO()
    losses = []
    reseed(seed)
    try:
        for i in range(steps):
            with contextlib.redirect_stdout(out):
                loss = train_step(model, optimizer, batch(i))
            losses.append(float(loss.detach().float().cpu()))
    finally:
        root.removeHandler(counter)
    return {"ok": True, "first_loss": float(first.detach()), "losses": losses, "log_records": counter.n,
            "stdout_lines": len(out.getvalue().splitlines()), "param_names": [n for n, _ in model.named_parameters()]}

results = {}
for program in spec["programs"]:
    before = set(sys.modules)
    try:
        results[program["name"]] = run(program)
    except BaseException as exc:
        results[program["name"]] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                    "traceback": traceback.format_exc()[-4000:]}
    finally:
        # the next program has its own `train`/`model` modules: forget everything this one imported
        for name in set(sys.modules) - before:
            if (getattr(sys.modules[name], "__file__", None) or "").startswith(program["dir"] + os.sep):
                del sys.modules[name]
        if sys.path and sys.path[0] == program["dir"]:
            sys.path.pop(0)
json.dump(results, open(spec["out"], "w"))
'''


# ------------------------------------------------------------------------------------------------
# cases


@dataclass(frozen=True)
class Case:
    recipe: str
    program: str  # an example name or a variant folder name
    backend: str  # "cpu" or "npu" (emulated)
    category: str | None = None  # the scanner intent to take spans from ...
    nth: int = 0  # ... the nth intent of that category
    function: str | None = None  # ... or the span of this function ("file.py:Class.method")
    steps: int = 3
    expect: str = "match"  # "match": same numerics; "refused": the engine refuses; "fails": the run fails
    # loudly; "diverges": (a deliberately broken recipe) runs but the numerics check rejects it
    expect_error: str = ""  # for "fails": a regular expression the child's error must match
    mutate: tuple[str, str] | None = None  # (old, new) text replaced in the recipe's replacement: a broken recipe
    slow: bool = False

    @property
    def id(self) -> str:
        where = self.category or (self.function or "").split(":")[-1]
        suffix = "" if self.nth == 0 else f"#{self.nth}"
        mutant = "" if self.mutate is None else "~" + re.sub(r"\W+", "_", self.mutate[0]).strip("_")[:24]
        return f"{self.recipe}{mutant}@{self.program}:{where}{suffix}[{self.backend}]"

    def recipe_data(self) -> Recipe:
        recipe = RECIPES[self.recipe]
        if self.mutate is None:
            return recipe
        old, new = self.mutate
        assert old in recipe.replacement, f"mutation {old!r} not in {recipe.id}'s replacement"
        return Recipe.model_validate({**recipe.model_dump(mode="json", by_alias=True),
                                      "replacement": recipe.replacement.replace(old, new)})


def _examples(*cases: Case) -> list[Case]:
    return [Case(**{**c.__dict__, "slow": True}) for c in cases]


CASES: list[Case] = [
    # --- bundled examples (slow: real model sizes) ----------------------------------------------
    *_examples(
        Case("rmsnorm-f-rms-norm", "llama_pretrain", "cpu", "rmsnorm"),
        Case("silu-functional", "llama_pretrain", "cpu", "silu"),
        Case("attention-sdpa-causal", "llama_pretrain", "cpu", "attention"),
        Case("cross-entropy-f-cross-entropy", "llama_pretrain", "cpu", "cross_entropy"),
        Case("adamw-foreach-to-fused", "llama_pretrain", "cpu", "optimizer_step"),
        Case("host-sync-log-every", "llama_pretrain", "cpu", "host_sync"),
        Case("rmsnorm-npu-rms-norm", "llama_pretrain", "npu", "rmsnorm"),
        Case("add-rms-norm-npu", "llama_pretrain", "npu", function="model.py:DecoderLayer.forward"),
        Case("rope-npu-rotary-mul", "llama_pretrain", "npu", "rope"),
        Case("swiglu-npu-swiglu", "llama_pretrain", "npu", "swiglu"),
        Case("attention-npu-fusion-causal", "llama_pretrain", "npu", "attention"),
        Case("permute-reshape-npu-confusion-transpose", "llama_pretrain", "npu", "permute_reshape"),
        Case("adamw-npu-fused", "llama_pretrain", "npu", "optimizer_step"),
        Case("layernorm-f-layer-norm", "gpt2_pretrain", "cpu", "layernorm"),
        Case("gelu-tanh-functional", "gpt2_pretrain", "cpu", "gelu"),
        Case("attention-sdpa-masked", "gpt2_pretrain", "cpu", "attention"),
        Case("cross-entropy-f-cross-entropy", "gpt2_pretrain", "cpu", "cross_entropy"),
        Case("adamw-foreach-to-fused", "gpt2_pretrain", "cpu", "optimizer_step"),
        Case("attention-npu-fusion-masked", "gpt2_pretrain", "npu", "attention"),
        Case("permute-reshape-npu-confusion-transpose", "gpt2_pretrain", "npu", "permute_reshape"),
        Case("layernorm-f-layer-norm", "gpt2_pretrain", "npu", "layernorm"),
        # gpt2 zeroes with set_to_none=True, which NpuFusedAdamW refuses (a documented pitfall):
        # the rewritten program must fail loudly, not train on stale gradients.
        Case("adamw-npu-fused", "gpt2_pretrain", "npu", "optimizer_step", expect="fails",
             expect_error=r"set_to_none"),
        Case("conv-channels-last", "resnet_classify", "cpu", "conv_layout"),
        Case("sgd-fused", "resnet_classify", "cpu", "optimizer_step"),
        Case("layernorm-f-layer-norm", "clip_pretrain", "cpu", "layernorm"),
        Case("gelu-erf-functional", "clip_pretrain", "cpu", "gelu", nth=0),
        Case("normalize-f-normalize", "clip_pretrain", "cpu", "normalize"),
        Case("attention-sdpa-causal-conditional", "clip_pretrain", "cpu", "attention"),
        Case("cross-entropy-contrastive-diagonal", "clip_pretrain", "cpu", "cross_entropy"),
        Case("adamw-foreach-to-fused", "clip_pretrain", "cpu", "optimizer_step"),
        Case("permute-reshape-npu-confusion-transpose", "clip_pretrain", "npu", "permute_reshape"),
        Case("cross-entropy-npu-fused", "llama_pretrain", "npu", "cross_entropy"),
        Case("softmax-npu-scaled-masked", "llama_pretrain", "npu", function="model.py:causal_attention"),
        Case("softmax-npu-scaled-masked", "gpt2_pretrain", "npu", function="model.py:CausalSelfAttention.forward"),
        Case("gelu-npu-gelu", "clip_pretrain", "npu", "gelu", nth=0),
        Case("sgd-npu-fused", "resnet_classify", "npu", "optimizer_step"),
    ),
    # QuickGELU (x * sigmoid(1.702 x)) is neither GELU nor SiLU: every activation recipe refuses it.
    Case("gelu-erf-functional", "clip_pretrain", "cpu", "gelu", nth=1, expect="refused"),
    Case("gelu-tanh-functional", "clip_pretrain", "cpu", "gelu", nth=1, expect="refused"),
    Case("silu-functional", "clip_pretrain", "cpu", "gelu", nth=1, expect="refused"),
    # --- variants: other spellings, tiny models ---------------------------------------------------
    Case("rmsnorm-f-rms-norm", "variant_lm", "cpu", "rmsnorm"),
    Case("silu-functional", "variant_lm", "cpu", "silu"),
    Case("attention-sdpa-causal", "variant_lm", "cpu", "attention"),
    Case("cross-entropy-f-cross-entropy", "variant_lm", "cpu", "cross_entropy"),
    Case("adam-foreach-to-fused", "variant_lm", "cpu", "optimizer_step"),
    Case("zero-grad-set-to-none", "variant_lm", "cpu", "zero_grad"),
    Case("host-sync-inline-log-every", "variant_lm", "cpu", "host_sync", steps=12),
    Case("rmsnorm-npu-rms-norm", "variant_lm", "npu", "rmsnorm"),
    Case("add-rms-norm-npu", "variant_lm", "npu", function="lm.py:Block.forward"),
    Case("rope-npu-rotary-mul", "variant_lm", "npu", "rope"),
    Case("swiglu-npu-swiglu", "variant_lm", "npu", "swiglu"),
    Case("attention-npu-fusion-causal", "variant_lm", "npu", "attention"),
    Case("permute-reshape-npu-confusion-transpose", "variant_lm", "npu", "permute_reshape"),
    # the emulation has no TorchAir 'npu' dynamo backend: the helper must say so instead of running eager
    Case("compile-regional-npu", "variant_lm", "npu", "rope", expect="fails",
         expect_error=r"torch\.compile\(backend='npu'\) is not available"),
    Case("compile-regional", "variant_lm", "cpu", "rope", slow=True),
    Case("layernorm-f-layer-norm", "variant_clip", "cpu", "layernorm"),
    Case("gelu-erf-functional", "variant_clip", "cpu", "gelu", nth=0),
    Case("gelu-tanh-functional", "variant_clip", "cpu", "gelu", nth=1),
    Case("attention-sdpa-masked", "variant_clip", "cpu", "attention"),
    Case("normalize-f-normalize", "variant_clip", "cpu", "normalize"),
    Case("cross-entropy-contrastive-diagonal", "variant_clip", "cpu", "cross_entropy"),
    Case("adamw-foreach-to-fused", "variant_clip", "cpu", "optimizer_step"),
    Case("attention-sdpa-causal-conditional", "variant_clip", "cpu", "attention", nth=1),
    Case("geglu-npu-geglu", "variant_clip", "npu", "geglu"),
    Case("attention-npu-fusion-masked", "variant_clip", "npu", "attention"),
    Case("permute-reshape-npu-confusion-transpose", "variant_clip", "npu", "permute_reshape"),
    Case("adamw-npu-fused", "variant_clip", "npu", "optimizer_step"),
    Case("cross-entropy-npu-fused", "variant_lm", "npu", "cross_entropy"),
    Case("softmax-npu-scaled-masked", "variant_lm", "npu", function="lm.py:SelfAttention.forward"),
    # the text tower's sequence is 8 long: npu_scaled_masked_softmax needs the last two dims in [32, 4096]
    # and multiples of 32, and must say so instead of computing something
    Case("softmax-npu-scaled-masked", "variant_clip", "npu", function="model.py:MaskedAttention.forward",
         expect="fails", expect_error=r"last two dims of x must lie in \[32, 4096\]"),
    Case("gelu-npu-gelu", "variant_clip", "npu", "gelu", nth=0),
    Case("adam-npu-fused", "variant_lm", "npu", "optimizer_step"),
    Case("sgd-npu-fused", "variant_cnn", "npu", "optimizer_step"),
    Case("conv-channels-last", "variant_cnn", "cpu", "conv_layout"),
    Case("sgd-fused", "variant_cnn", "cpu", "optimizer_step"),
    Case("host-sync-log-every", "variant_cnn", "cpu", "host_sync"),
    # --- the documented traps, each put back into a recipe: the numerics check must reject them ----
    Case("attention-sdpa-masked", "variant_clip", "cpu", "attention", expect="diverges",
         mutate=("attn_mask=torch.logical_not($m)", "attn_mask=$m")),  # SDPA's True = keep
    Case("geglu-npu-geglu", "variant_clip", "npu", "geglu", expect="diverges",
         mutate=("approximate=0", "approximate=1")),  # npu_geglu's default is tanh
    Case("swiglu-npu-swiglu", "variant_lm", "npu", "swiglu", expect="diverges",
         mutate=("torch.cat(($g, $u)", "torch.cat(($u, $g)")),  # the first half is activated
    Case("attention-npu-fusion-causal", "variant_lm", "npu", "attention", expect="diverges",
         mutate=(", scale=$scale", "")),  # scale defaults to 1.0
    Case("attention-npu-fusion-causal", "variant_lm", "npu", "attention", expect="diverges",
         mutate=("atten_mask=_tb_npu_causal_mask($q.device), ", "")),  # no mask: dense, sparse_mode ignored
    # npu_add_rms_norm has no backward: from torch_npu release 26.1.0 (the emulation's default) backward
    # through it raises; before, it only warned and the grads were lost
    Case("add-rms-norm-npu", "variant_lm", "npu", function="lm.py:Block.forward", expect="fails",
         expect_error=r"derivative for npu::npu_add_rms_norm is not implemented",
         mutate=("_tb_normed, $h = _TbAddRmsNorm.apply(",
                 "_tb_normed, _tb_rstd, $h = torch_npu.npu_add_rms_norm(")),
    Case("gelu-npu-gelu", "variant_clip", "npu", "gelu", nth=0, expect="diverges",
         mutate=("torch_npu.npu_gelu($x, approximate='none')", "torch_npu.npu_fast_gelu($x)")),  # QuickGELU
    Case("softmax-npu-scaled-masked", "variant_lm", "npu", function="lm.py:SelfAttention.forward",
         expect="diverges", mutate=("_tb_npu_softmax_mask($m)", "~_tb_npu_softmax_mask($m)")),  # True = masked
    Case("softmax-npu-scaled-masked", "variant_lm", "npu", function="lm.py:SelfAttention.forward",
         expect="diverges", mutate=(", 1.0, False)", ", 0.125, False)")),  # scale applies before the mask
    Case("cross-entropy-npu-fused", "variant_lm", "npu", "cross_entropy", expect="fails",
         expect_error=r"reduction='mean' requires weight=None, ignore_index=-100 and label_smoothing=0",
         mutate=("$t.reshape(-1).long())", "$t.reshape(-1).long(), label_smoothing=0.1)")),  # fused backward's limit
    Case("cross-entropy-npu-fused", "variant_lm", "npu", "cross_entropy", expect="fails",
         expect_error=r"does not require grad",
         mutate=(".long())[0], 0)", ".long())[1].mean(), 0)")),  # output #0 is the loss, #1 log_prob (no grad)
]


def _source_dir(program: str) -> Path:
    return EXAMPLES / program if (EXAMPLES / program).is_dir() else VARIANTS / program


def _function_span(root: Path, where: str) -> SourceSpan:
    file, _, qualname = where.partition(":")
    tree = ast.parse((root / file).read_text())
    parts = qualname.split(".")
    nodes = tree.body
    node = None
    for part in parts:
        node = next(n for n in nodes if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part)
        nodes = node.body
    return SourceSpan(file=file, line_start=node.lineno, line_end=node.end_lineno, function=qualname)


@dataclass
class Applied:
    folder: Path
    file: str | None = None
    before: str = ""
    after: str = ""
    refusals: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def apply_case(case: Case, folder: Path) -> Applied:
    """Apply the case's recipe to the copied program the way the coder does; write the file."""
    recipe = case.recipe_data()
    if case.function:
        spans = [_function_span(folder, case.function)]
    else:
        intents = [i for i in scan_repo(folder) if i.category == case.category]
        assert len(intents) > case.nth, f"the scanner reports {len(intents)} {case.category} intent(s) in {case.program}"
        spans = intents[case.nth].spans
    applied = Applied(folder=folder)
    for span in spans:
        path = folder / span.file
        source = path.read_text()
        try:
            edit = apply_recipe(source, recipe, span)
        except CodemodRefused as refused:
            applied.refusals.append(str(refused))
            continue
        compile(edit.source, str(path), "exec")  # must parse
        path.write_text(edit.source)
        applied.file, applied.before, applied.after, applied.notes = span.file, source, edit.source, edit.notes
        return applied
    return applied


# ------------------------------------------------------------------------------------------------
# running groups of programs (one child per program and backend)


class Lab:
    def __init__(self, root: Path):
        self.root = root
        self.applied: dict[Case, Applied] = {}
        self.results: dict[tuple[str, str], dict] = {}
        self.baselines: dict[str, dict] = {}
        self.children = 0

    def _copy(self, program: str, name: str) -> Path:
        target = self.root / name
        if not target.exists():
            shutil.copytree(_source_dir(program), target, ignore=shutil.ignore_patterns("__pycache__"))
        return target

    def _run(self, programs: list[dict], npu: bool, timeout: float = 900) -> dict:
        self.children += 1
        spec_path = self.root / f"spec-{self.children}.json"
        out = spec_path.with_suffix(".out.json")
        spec = {"npu": npu, "device": "npu" if npu else "cpu", "programs": programs, "out": str(out)}
        spec_path.write_text(json.dumps(spec))
        runner = self.root / "runner.py"
        runner.write_text(RUNNER)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["OMP_NUM_THREADS"] = "1"
        if npu:
            selection = NpuSelection(mode="emulated", cause="not_installed", reason="recipe tests", python=PYTHON)
            env = selection_env(selection, env)
        done = subprocess.run([PYTHON, str(runner), str(spec_path)], env=env, cwd=self.root, capture_output=True,
                              text=True, timeout=timeout)
        assert done.returncode == 0 and out.exists(), f"the runner crashed:\n{done.stderr[-4000:]}"
        return json.loads(out.read_text())

    def _program(self, name: str, folder: Path, steps: int) -> dict:
        return {"name": name, "dir": str(folder), "seed": 0, "steps": steps, "grads": str(self.root / f"{name}.grads.pt")}

    def baseline(self, program: str, steps: int, backend: str = "cpu") -> dict:
        key = f"{program}-base-{steps}" + ("" if backend == "cpu" else f"-{backend}")
        if key not in self.baselines:
            folder = self._copy(program, key)
            result = self._run([self._program(key, folder, steps)], npu=backend == "npu")[key]
            assert result["ok"], f"the unmodified {program} does not run: {result.get('traceback')}"
            result["grads_path"] = str(self.root / f"{key}.grads.pt")
            self.baselines[key] = result
        return self.baselines[key]

    def result(self, case: Case) -> tuple[Applied, dict | None]:
        if case not in self.applied:
            group = [c for c in CASES if c.program == case.program and c.backend == case.backend
                     and c.expect != "refused" and c.recipe.startswith("compile-") == case.recipe.startswith("compile-")]
            programs = []
            for c in group:
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", c.id)
                folder = self._copy(c.program, name)
                self.applied[c] = applied = apply_case(c, folder)
                if applied.file is not None:
                    programs.append(self._program(name, folder, c.steps))
            results = self._run(programs, npu=case.backend == "npu") if programs else {}
            for c in group:
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", c.id)
                if name in results:
                    results[name]["grads_path"] = str(self.root / f"{name}.grads.pt")
                self.results[(c.program, c.id)] = results.get(name)
        return self.applied[case], self.results.get((case.program, case.id))


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> Lab:
    return Lab(tmp_path_factory.mktemp("recipes"))


# ------------------------------------------------------------------------------------------------
# numerics


@dataclass
class Comparison:
    global_cosine: float  # cosine of all first-step gradients, concatenated
    min_param_cosine: float  # worst per-parameter cosine among parameters whose gradient carries signal
    worst_param: str
    noise_params: list[str]  # gradients that are zero up to rounding (e.g. attention key biases): no cosine
    max_abs: float  # max |g - g_ref| over every element of every parameter
    max_ref: float  # max |g_ref|: the largest reference gradient element
    max_loss_rel: float  # max over the first loss and the train_step losses of |l - l_ref| / |l_ref|
    bit_exact: bool

    def line(self) -> str:
        return (f"grad cos {self.global_cosine:.9f} (min param {self.min_param_cosine:.6f} {self.worst_param}), "
                f"grad max-abs {self.max_abs:.2e} (max grad {self.max_ref:.2e}, ratio {self.max_abs / self.max_ref:.2e}), "
                f"loss max rel {self.max_loss_rel:.2e}, bit-exact {self.bit_exact}")


SIGNAL = 1e-4  # a parameter's gradient carries signal when its norm is above SIGNAL x the largest one's


def compare(base: dict, cand: dict) -> Comparison:
    g0 = torch.load(base["grads_path"])
    g1 = torch.load(cand["grads_path"])
    assert set(g0) == set(g1), f"gradients for different parameters: {sorted(set(g0) ^ set(g1))}"
    a = {n: g0[n].double().flatten() for n in g0}
    b = {n: g1[n].double().flatten() for n in g0}
    exact = all(torch.equal(g0[n], g1[n]) for n in g0)
    dots = sum(float(a[n] @ b[n]) for n in a)
    norms = math.sqrt(sum(float(a[n] @ a[n]) for n in a) * sum(float(b[n] @ b[n]) for n in a))
    global_cos = dots / norms if norms > 0 else 0.0
    largest = max(float(a[n].norm()) for n in a)
    min_cos, worst, noise = 1.0, "", []
    for n in a:
        if float(a[n].norm()) <= SIGNAL * largest:
            noise.append(n)
            continue
        denominator = float(a[n].norm()) * float(b[n].norm())
        cos = float(a[n] @ b[n]) / denominator if denominator > 0 else 0.0
        if cos < min_cos:
            min_cos, worst = cos, n
    max_abs = max(float((a[n] - b[n]).abs().max()) for n in a)
    max_ref = max(float(a[n].abs().max()) for n in a)
    losses0, losses1 = [base["first_loss"], *base["losses"]], [cand["first_loss"], *cand["losses"]]
    assert len(losses0) == len(losses1)
    rel = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(losses0, losses1))
    exact = exact and losses0 == losses1
    return Comparison(global_cos, min_cos, worst, noise, max_abs, max_ref, rel, exact)


def assert_within(recipe: Recipe, c: Comparison) -> None:
    """Exact: bit-identical gradients and losses. Tolerance: cosines (README gate), then
    max |g - g_ref| <= atol + rtol * max |g_ref|, and every loss within loss_rtol."""
    numerics = recipe.numerics
    if numerics.class_ == "exact":
        assert c.bit_exact, f"recipe {recipe.id} is declared exact but {c.line()}"
        return
    assert c.global_cosine >= MIN_GLOBAL_COSINE, c.line()
    assert c.min_param_cosine >= MIN_PARAM_COSINE, c.line()
    bound = numerics.atol + numerics.rtol * c.max_ref
    assert c.max_abs <= bound, f"beyond atol {numerics.atol} + rtol {numerics.rtol} x max grad: {c.line()}"
    assert c.max_loss_rel <= (numerics.loss_rtol or numerics.rtol), f"beyond loss_rtol {numerics.loss_rtol}: {c.line()}"


# ------------------------------------------------------------------------------------------------
# the cases


def _params(cases):
    return [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in cases]


def test_every_seed_recipe_has_a_real_code_case():
    covered = {c.recipe for c in CASES if c.expect in ("match", "fails") and c.mutate is None}
    assert set(RECIPES) - covered == set(), "seed recipes without a test on real code"
    on_variants = {c.recipe for c in CASES if c.program.startswith("variant_") and c.expect != "refused"}
    on_examples = {c.recipe for c in CASES if not c.program.startswith("variant_") and c.expect == "match"}
    # every recipe is also exercised on code spelled differently from the bundled examples (for the
    # recipes whose pattern no example contains, that variant is its only real-code test)
    assert set(RECIPES) - on_variants == set(), "recipes not tried on a differently written variant"
    assert on_examples | on_variants == set(RECIPES)


@pytest.mark.parametrize("case", _params([c for c in CASES if c.expect == "refused"]))
def test_recipe_refuses_code_that_only_looks_similar(case, tmp_path):
    folder = tmp_path / "program"
    shutil.copytree(_source_dir(case.program), folder)
    applied = apply_case(case, folder)
    assert applied.file is None, f"{case.recipe} rewrote code it must not touch:\n{applied.after}"
    assert applied.refusals and all("matches recipe" in r or "no expression" in r for r in applied.refusals)


@pytest.mark.parametrize("case", _params([c for c in CASES if c.expect != "refused"]))
def test_recipe_on_real_code(case, lab):
    recipe = RECIPES[case.recipe]
    assert case.backend in {t.value for t in recipe.targets}, f"{recipe.id} is not written for {case.backend}"
    applied, result = lab.result(case)
    assert applied.file is not None, f"{recipe.id} did not apply to {case.program}:\n" + "\n".join(applied.refusals)
    assert applied.after != applied.before
    cst.parse_module(applied.after)
    if case.expect == "fails":
        assert result is not None and not result["ok"], f"{case.id} was expected to fail loudly but ran"
        assert re.search(case.expect_error, result["error"]), result["traceback"]
        return
    assert result is not None and result["ok"], f"{case.id} does not run:\n{result and result.get('traceback')}"
    base = lab.baseline(case.program, case.steps, case.backend)
    assert result["param_names"] == base["param_names"], "the rewrite changed the model's parameters"
    if case.expect == "diverges":
        with pytest.raises(AssertionError) as rejected:
            assert_within(recipe, compare(base, result))
        print(f"REJECTED {case.id}: {str(rejected.value).splitlines()[0][:300]}")
        return
    comparison = compare(base, result)
    print(f"NUMERICS {case.id}: {comparison.line()}")
    assert_within(recipe, comparison)
    if recipe.category == "host_sync":
        steps = case.steps
        logged = result["log_records"] + result["stdout_lines"]
        assert base["log_records"] + base["stdout_lines"] == steps  # one log line per step before
        assert logged == len(range(0, steps, 10)), f"expected logs at steps 0, 10, ...: got {logged} of {steps}"


# ------------------------------------------------------------------------------------------------
# torch_npu calls in replacements against the op-plugin schemas


def _schemas() -> dict[str, list[tuple[str, bool, bool]]]:
    """op name -> [(parameter name, has a default, keyword-only)] from fused_api_signatures.txt."""
    out = {}
    for line in (NPU_REFERENCE / "fused_api_signatures.txt").read_text().splitlines():
        m = re.match(r"^(\w+)\((.*)\) -> ", line)
        if not m:
            continue
        params, star = [], False
        for part in _split_args(m.group(2)):
            if part == "*":
                star = True
                continue
            declaration, _, default = part.partition("=")
            params.append((declaration.split()[-1], bool(default), star))
        out[m.group(1)] = params
    return out


def _split_args(text: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in text:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _class_signatures() -> dict[str, list[str]]:
    out = {}
    for line in (NPU_REFERENCE / "torch_npu_python_api_surface.txt").read_text().splitlines():
        m = re.search(r"class (\w+)\([^)]*\)\.__init__\(self, (.*)\)\s*$", line)
        if m:
            out[m.group(1)] = [p.split("=")[0].strip() for p in _split_args(m.group(2))]
    return out


def _torch_npu_calls(code: str) -> list[ast.Call]:
    calls = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func.startswith("torch_npu."):
                calls.append(node)
    return calls


def _render_for_check(recipe: Recipe) -> str:
    """The replacement as plain Python (holes opened, placeholders as names) plus the helper code."""
    text = recipe.replacement
    for a, b in reversed(hole_spans(text)):
        text = text[:a] + text[a + 3:b - 1] + text[b:]
    text = re.sub(r"^(\s*)\$\{?matched\}?\s*$", r"\1pass", text, flags=re.MULTILINE)
    text = re.sub(r"\$\{?(\w+)\}?", lambda m: f"ph_{m.group(1)}", text)
    return text + "\n" + str(recipe.match.params.get("define") or "")


NPU_RECIPES = [r for r in RECIPES.values() if "torch_npu." in r.replacement + str(r.match.params.get("define", ""))]


@pytest.mark.parametrize("recipe", NPU_RECIPES, ids=[r.id for r in NPU_RECIPES])
def test_torch_npu_calls_match_the_op_plugin_schemas(recipe):
    assert recipe.targets == ["npu"], f"{recipe.id} calls torch_npu but targets {recipe.targets}"
    assert "import torch_npu" in recipe.imports
    schemas, classes = _schemas(), _class_signatures()
    code = _render_for_check(recipe)
    calls = _torch_npu_calls(code)
    if recipe.id == "compile-regional-npu":  # no fused op: only the backend check (tested below)
        assert not calls
        return
    assert calls, f"no torch_npu call found in {recipe.id}"
    for call in calls:
        name = ast.unparse(call.func).split(".")[-1]
        if name in classes:
            params = classes[name]
            assert len(call.args) <= len(params)
            continue
        assert name in schemas, f"{recipe.id}: torch_npu.{name} is not in fused_api_signatures.txt"
        params = schemas[name]
        positional = [p for p, _, kw_only in params if not kw_only]
        names = [p for p, _, _ in params]
        assert len(call.args) <= len(positional), f"{recipe.id}: too many positional arguments for {name}"
        given = set(positional[:len(call.args)])
        for kw in call.keywords:
            assert kw.arg in names, f"{recipe.id}: torch_npu.{name} has no parameter {kw.arg!r} (schema: {names})"
            assert kw.arg not in given, f"{recipe.id}: {kw.arg} given twice to {name}"
            given.add(kw.arg)
        missing = [p for p, has_default, _ in params if not has_default and p not in given]
        assert not missing, f"{recipe.id}: torch_npu.{name} misses required {missing}"


def test_npu_adamw_replacement_matches_the_wheel_class_signature():
    recipe = RECIPES["adamw-npu-fused"]
    classes = _class_signatures()
    assert "NpuFusedAdamW" in classes
    dropped = set(recipe.match.params["drop_kwargs"])
    # every torch.optim.AdamW keyword NpuFusedAdamW lacks must be dropped by the recipe
    torch_kwargs = {"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "foreach", "capturable",
                    "differentiable", "fused"}
    assert torch_kwargs - set(classes["NpuFusedAdamW"]) <= dropped


def test_fusion_attention_replacements_follow_the_documented_traps():
    for rid in ("attention-npu-fusion-causal", "attention-npu-fusion-masked"):
        call = _torch_npu_calls(_render_for_check(RECIPES[rid]))[0]
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert "scale" in keywords, "scale defaults to 1.0: it must be passed"
        assert "atten_mask" in keywords, "without atten_mask sparse_mode is ignored (dense attention)"
        assert ast.unparse(call.args[4]) == "'BNSD'"
    causal = RECIPES["attention-npu-fusion-causal"]
    call = _torch_npu_calls(_render_for_check(causal))[0]
    keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
    assert keywords["sparse_mode"] == "2" and keywords["next_tockens"] == "0"
    assert "2048, 2048" in causal.match.params["define"] and "diagonal=1" in causal.match.params["define"]
    assert RECIPES["attention-npu-fusion-causal"].replacement.rstrip().endswith("[0]]")


def test_geglu_and_swiglu_pass_the_non_default_halves_explicitly():
    geglu = _torch_npu_calls(_render_for_check(RECIPES["geglu-npu-geglu"]))[0]
    keywords = {k.arg: ast.unparse(k.value) for k in geglu.keywords}
    assert keywords["approximate"] == "0", "npu_geglu defaults to the tanh approximation; F.gelu is erf"
    assert keywords["activate_left"] == "False"
    swiglu = RECIPES["swiglu-npu-swiglu"]
    assert "torch.cat(($g, $u)" in swiglu.replacement, "npu_swiglu activates the first half: the gate goes first"


# ------------------------------------------------------------------------------------------------
# refusals on code that looks like a recipe's pattern but computes something else


def _apply_text(recipe_id: str, source: str, start: int, end: int):
    return apply_recipe(source, RECIPES[recipe_id], SourceSpan(file="m.py", line_start=start, line_end=end))


def test_layernorm_recipe_refuses_an_unbiased_variance():
    source = (
        "import torch\n\n\nclass Norm(torch.nn.Module):\n    def __init__(self, d):\n        super().__init__()\n"
        "        self.weight = torch.nn.Parameter(torch.ones(d))\n        self.bias = torch.nn.Parameter(torch.zeros(d))\n"
        "        self.eps = 1e-5\n\n    def forward(self, x):\n        mu = x.mean(-1, keepdim=True)\n"
        "        var = x.var(-1, keepdim=True)\n        return (x - mu) / torch.sqrt(var + self.eps) * self.weight + self.bias\n"
    )
    with pytest.raises(CodemodRefused, match="known forms"):
        _apply_text("layernorm-f-layer-norm", source, 4, 14)


def test_host_sync_recipes_refuse_when_the_synced_value_is_used_later():
    source = (
        "def train_step(model, optimizer, batch):\n    loss = model(batch)\n    loss.backward()\n"
        "    value = loss.item()\n    print(value)\n    return value\n"
    )
    with pytest.raises(CodemodRefused, match="value \\(line 6\\) is read after"):
        _apply_text("host-sync-log-every", source, 4, 5)
    with pytest.raises(CodemodRefused):
        _apply_text("host-sync-inline-log-every", "def f(loss):\n    return loss.item()\n", 2, 2)


def test_attention_recipe_refuses_a_non_causal_mask_and_a_reused_probability():
    masked = (
        "import torch\n\n\ndef attn(q, k, v, keep):\n    s = (q @ k.transpose(-2, -1)) * 0.125\n"
        "    m = torch.triu(torch.ones(8, 8, dtype=torch.bool, device=q.device), diagonal=2)\n"
        "    s = s.masked_fill(m, float('-inf'))\n    p = torch.softmax(s, dim=-1)\n    return p @ v\n"
    )
    with pytest.raises(CodemodRefused, match="no statement sequence"):  # diagonal=2 is not causal
        _apply_text("attention-sdpa-causal", masked, 5, 9)
    reused = (
        "import torch\n\n\ndef attn(q, k, v):\n    s = (q @ k.transpose(-2, -1)) * 0.125\n"
        "    m = torch.triu(torch.ones(8, 8, dtype=torch.bool, device=q.device), diagonal=1)\n"
        "    s = s.masked_fill(m, float('-inf'))\n    p = torch.softmax(s, dim=-1)\n    out = p @ v\n"
        "    return out, p\n"
    )
    with pytest.raises(CodemodRefused, match="p \\(line 10\\) is read after"):
        _apply_text("attention-sdpa-causal", reused, 5, 9)


def test_swiglu_recipe_keeps_the_gate_first_whatever_the_source_order():
    source = "import torch.nn.functional as F\n\n\ndef mlp(x, w_gate, w_up):\n    return w_up(x) * F.silu(w_gate(x))\n"
    edit = _apply_text("swiglu-npu-swiglu", source, 5, 5)
    assert "torch_npu.npu_swiglu(torch.cat((w_gate(x), w_up(x)), dim=-1), dim=-1)" in edit.source


# ------------------------------------------------------------------------------------------------
# compile-regional-npu: the helper tells TorchAir from torch_npu's silent eager fallback

FAKE_TORCH_NPU = '''
import warnings
from torch._dynamo import register_backend

def {name}(gm, example_inputs):
    return gm.forward

register_backend(name="npu")({name})
'''

COMPILE_CHILD = r'''
import sys, json
sys.path.insert(0, sys.argv[1])
import torch
sys.path.insert(0, sys.argv[2])
from lm import rope
x = torch.randn(2, 4, 8, 6)
cos, sin = torch.randn(1, 1, 8, 6), torch.randn(1, 1, 8, 6)
half = 3
expected = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
print(json.dumps({"max_abs": float((rope(x, cos, sin) - expected).abs().max())}))
'''


@pytest.mark.parametrize("torchair, backend_name, outcome", [
    (False, "_eager_npu_backend", "would silently run eager"),  # torch_npu built without torchair
    (True, "_eager_npu_backend", "would silently run eager"),
    (True, "npu_backend", "ok"),  # a real (here: trivial, graph-running) TorchAir backend
])
def test_npu_compile_helper_refuses_the_silent_eager_fallback(tmp_path, torchair, backend_name, outcome):
    fake = tmp_path / "fake"
    package = fake / "torch_npu"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_TORCH_NPU.format(name=backend_name))
    if torchair:
        (package / "dynamo" / "torchair").mkdir(parents=True)
    program = tmp_path / "program"
    shutil.copytree(VARIANTS / "variant_lm", program)
    applied = apply_case(Case("compile-regional-npu", "variant_lm", "npu", "rope"), program)
    assert applied.file == "lm.py" and "@_tb_npu_compile" in applied.after
    done = subprocess.run([PYTHON, "-c", COMPILE_CHILD, str(fake), str(program)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})
    if outcome == "ok":
        assert done.returncode == 0, done.stderr[-3000:]
        assert json.loads(done.stdout.strip().splitlines()[-1])["max_abs"] < 1e-6
    else:
        assert done.returncode != 0 and outcome in done.stderr, done.stderr[-3000:]
