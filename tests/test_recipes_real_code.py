"""Recipes where real code writes the op (issue 13): inside methods, nested functions and the forwards
of classes at any depth; regional compile on methods; optimizers whose options come through a
variable or ``**kwargs``; and refusals that name the form they saw and why."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from trainbridge.records import SourceSpan
from recipe_lab import RECIPES
from trainbridge.tools.codemods import scopes
from trainbridge.tools.codemods.engine import CodemodRefused, apply_recipe


def _src(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _line(source: str, needle: str) -> int:
    return next(i for i, line in enumerate(source.splitlines(), 1) if needle in line)


def _apply(recipe_id: str, source: str, first: str, last: str | None = None, file: str = "m.py"):
    span = SourceSpan(file=file, line_start=_line(source, first), line_end=_line(source, last or first))
    return apply_recipe(source, RECIPES[recipe_id], span)


# --- where the region lives -----------------------------------------------------------------------

NESTED = _src('''
    import torch


    def build(dim):
        class Norm(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = torch.nn.Parameter(torch.ones(dim))
                self.eps = 1e-6

            def forward(self, x):
                return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

        def helper(t):
            def inner(u):
                return u * 2
            return inner(t)

        return Norm(), helper


    if True:
        class Guarded(torch.nn.Module):
            def forward(self, x):
                return x + 1
''')


def test_definitions_at_any_depth_have_owners_and_qualified_names():
    wrapper = MetadataWrapper(cst.parse_module(NESTED))
    module, positions = wrapper.module, wrapper.resolve(PositionProvider)
    names = {s.qualname: s for s in scopes.definitions(module)}
    assert set(names) == {"build", "build.<locals>.Norm.__init__", "build.<locals>.Norm.forward",
                          "build.<locals>.helper", "build.<locals>.helper.<locals>.inner", "Guarded.forward"}
    assert names["build.<locals>.Norm.forward"].is_method and names["build.<locals>.helper.<locals>.inner"].nested
    at = _line(NESTED, "return u * 2")
    inner = scopes.innermost_function(module, positions, SourceSpan(file="m.py", line_start=at, line_end=at))
    assert inner.qualname == "build.<locals>.helper.<locals>.inner"
    whole_class = SourceSpan(file="m.py", line_start=_line(NESTED, "class Norm"), line_end=_line(NESTED, "return self.weight"))
    assert scopes.innermost_function(module, positions, whole_class).function.name.value == "forward"  # not __init__
    assert scopes.module_forward(module, positions, whole_class).owner.name.value == "Norm"


def test_semantic_recipe_rewrites_the_forward_of_a_class_defined_inside_a_function():
    edit = _apply("rmsnorm-f-rms-norm", NESTED, "class Norm", "return self.weight")
    assert "return torch.nn.functional.rms_norm(x, (x.shape[-1],), self.weight, self.eps)" in edit.source
    assert "return u * 2" in edit.source and "return x + 1" in edit.source  # nothing else moved


# --- regional compile on methods ---------------------------------------------------------------

MODULE = _src('''
    import torch
    from torch import nn

    SCALE = 2.0


    class Block(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.gates = nn.Parameter(torch.ones(2))

        @staticmethod
        def _swap(x):
            half = x.shape[-1] // 2
            return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

        def mix(self, x, x0):
            return self.gates[0] * x + self.gates[1] * x0

        @torch.compile
        def compiled(self, x):
            return x * SCALE

        def forward(self, x, x0):
            def soft_cap(t):
                return 15 * torch.tanh(t / 15)
            return soft_cap(self.mix(x, x0))
''')


@pytest.mark.parametrize("needle, decorated", [
    ("return self.gates[0]", "    @torch.compile(dynamic=False)\n    def mix(self, x, x0):"),
    ("half = x.shape", "    @staticmethod\n    @torch.compile(dynamic=False)\n    def _swap(x):"),  # staticmethod outermost
    ("return 15 * torch.tanh", "        @torch.compile(dynamic=False)\n        def soft_cap(t):"),  # the nested helper
])
def test_regional_compile_decorates_the_enclosing_method(needle, decorated):
    edit = _apply("compile-regional", MODULE, needle)
    assert decorated in edit.source
    assert edit.source.count("torch.compile(dynamic=False)") == 1
    compile(edit.source, "m.py", "exec")


def test_regional_compile_on_the_npu_decorates_a_method_with_the_fallback_checking_helper():
    edit = _apply("compile-regional-npu", MODULE, "return self.gates[0]")
    assert "    @_tb_npu_compile\n    def mix(self, x, x0):" in edit.source
    assert "def _tb_npu_compile(fn):" in edit.source and "_eager_npu_backend" in edit.source
    assert "import torch_npu" in edit.source


LOOP_HOLDER = _src('''
    import torch


    def main(model, optimizer, data):
        for x, y in data:
            h = x * torch.sigmoid(x)
            loss = torch.nn.functional.mse_loss(model(h), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()


    def run(trainer):
        scale = torch.sigmoid(torch.ones(1)) * 2
        trainer.train()
        return scale
''')


@pytest.mark.parametrize("needle, words", [
    ("h = x * torch.sigmoid(x)", r"main \(line 4\) .* holds the training loop \(loss.backward\(\)\)"),
    ("scale = torch.sigmoid", r"holds the training loop \(trainer.train\(\)\)"),
])
def test_regional_compile_never_compiles_a_function_that_holds_the_loop(needle, words):
    """Issue 26: the last rung compiled a Hugging Face user's whole `def main():`, its batches drawn from other random
    numbers under compile, and the gate rejected it four times for numerics."""
    with pytest.raises(CodemodRefused, match=words):
        _apply("compile-regional", LOOP_HOLDER, needle)


@pytest.mark.parametrize("needle, words", [
    ("self.gates = nn.Parameter", r"special method __init__"),
    ("return x * SCALE", r"already compiled \(@torch.compile\)"),
    ("SCALE = 2.0", r"line 4 is module-level code \(SCALE = 2.0\)"),
])
def test_regional_compile_refuses_and_says_what_it_saw(needle, words):
    with pytest.raises(CodemodRefused, match=words):
        _apply("compile-regional", MODULE, needle)


def test_optimizer_loop_compile_only_takes_a_step_method():
    source = _src('''
        import torch


        class Momentum(torch.optim.Optimizer):
            def __init__(self, params, lr=0.1):
                super().__init__(params, dict(lr=lr))

            @torch.no_grad()
            def step(self):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.add_(p.grad, alpha=-group["lr"])


        def build(model):
            return Momentum(model.parameters())
    ''')
    edit = _apply("optimizer-loop-compile", source, "for p in group", "p.add_")
    assert "    @torch.no_grad()\n    @torch.compile(dynamic=False)\n    def step(self):" in edit.source
    with pytest.raises(CodemodRefused, match=r"lies in build\(\), not in step"):
        _apply("optimizer-loop-compile", source, "return Momentum")


# --- optimizers built with variables and **kwargs ------------------------------------------------

NANOGPT = _src('''
    import inspect

    import torch


    def configure(model, lr, betas, device_type):
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1}]
        use_fused = "fused" in inspect.signature(torch.optim.AdamW).parameters and device_type == "cuda"
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")
        return optimizer
''')


def test_fused_adamw_through_extra_args_is_passed_explicitly():
    edit = _apply("adamw-fused", NANOGPT, "optimizer = torch.optim.AdamW")
    assert "optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)" in edit.source
    assert any("dropped **extra_args: it only ever holds fused (line 9)" in n for n in edit.notes), edit.notes
    changed = [a for a, b in zip(NANOGPT.splitlines(), edit.source.splitlines()) if a != b]
    assert changed == ["    optimizer = torch.optim.AdamW(groups, lr=lr, betas=betas, **extra_args)"]  # one line


def test_npu_fused_adamw_drops_the_cuda_only_extra_args():
    edit = _apply("adamw-npu-fused", NANOGPT, "optimizer = torch.optim.AdamW")
    assert "optimizer = torch_npu.optim.NpuFusedAdamW(groups, lr=lr, betas=betas)" in edit.source


def test_fused_through_a_variable_becomes_fused_true():
    source = "import torch\n\n\ndef make(ps, use_fused):\n    return torch.optim.AdamW(ps, lr=1e-3, fused=use_fused)\n"
    edit = _apply("adamw-fused", source, "return torch.optim")
    assert "return torch.optim.AdamW(ps, lr=1e-3, fused=True)" in edit.source
    assert any("fused=use_fused" in n for n in edit.notes)
    literal = source.replace("fused=use_fused", "fused=False")
    with pytest.raises(CodemodRefused, match=r"already passes fused=False"):
        _apply("adamw-fused", literal, "return torch.optim")


def test_extra_args_with_other_keys_are_kept_or_refused():
    other = NANOGPT.replace("extra_args = dict(fused=True) if use_fused else dict()",
                            "extra_args = dict(eps=1e-8)")
    kept = _apply("adamw-fused", other, "optimizer = torch.optim.AdamW")
    assert "torch.optim.AdamW(groups, lr=lr, betas=betas, **extra_args, fused=True)" in kept.source
    mixed = NANOGPT.replace("dict(fused=True) if use_fused else dict()", "dict(fused=True, eps=1e-8) if use_fused else dict()")
    with pytest.raises(CodemodRefused, match=r"saw AdamW\(\.\.\., \*\*extra_args\) whose 'fused' comes from extra_args "
                                             r"\(line 9\) together with eps: split them"):
        _apply("adamw-fused", mixed, "optimizer = torch.optim.AdamW")
    blocked = NANOGPT.replace("dict(fused=True) if use_fused else dict()", "{'differentiable': True}")
    with pytest.raises(CodemodRefused, match=r"whose 'differentiable' comes from extra_args \(line 9\)"):
        _apply("adamw-fused", blocked, "optimizer = torch.optim.AdamW")


def test_kwargs_whose_keys_are_unknown_are_refused_with_their_source():
    source = "import torch\n\n\ndef make(ps, **optim_kwargs):\n    return torch.optim.AdamW(ps, lr=1e-3, **optim_kwargs)\n"
    with pytest.raises(CodemodRefused, match=r"saw AdamW\(\.\.\., \*\*optim_kwargs\): optim_kwargs is a parameter of "
                                             r"make\(\): its keys come from the caller; it may hold fused, differentiable"):
        _apply("adamw-fused", source, "return torch.optim")
    config = "import torch\n\n\ndef make(ps, cfg):\n    extra = cfg.optimizer_args()\n    return torch.optim.AdamW(ps, **extra)\n"
    with pytest.raises(CodemodRefused, match=r"its keys are not known statically: extra = cfg.optimizer_args\(\) \(line 5\)"):
        _apply("adamw-fused", config, "return torch.optim")
    later = NANOGPT.replace("        optimizer = torch", "        extra_args['foreach'] = False\n        optimizer = torch")
    edit = _apply("adamw-fused", later, "optimizer = torch.optim.AdamW")  # foreach is dropped, fused overridden
    assert "torch.optim.AdamW(groups, lr=lr, betas=betas, fused=True)" in edit.source


def test_a_call_recipe_that_finds_no_call_names_what_the_span_calls():
    source = _src('''
        import torch


        def update(params, lr):
            for p in params:
                p.grad.mul_(0.9)
                p.add_(p.grad, alpha=-lr)
    ''')
    with pytest.raises(CodemodRefused, match=r"no call of torch.optim.AdamW .*: the span calls p.grad.mul_, p.add_"):
        _apply("adamw-fused", source, "for p in params", "p.add_")


# --- library calls inside methods on the NPU target ----------------------------------------------

def test_library_calls_in_methods_get_npu_helpers_once_per_file():
    source = _src('''
        import torch.nn.functional as F
        from torch import nn
        from torch.nn.functional import scaled_dot_product_attention as sdpa


        class Attention(nn.Module):
            def forward(self, q, k, v):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return sdpa(y, k, v, is_causal=True)
    ''')
    once = _apply("attention-sdpa-npu-fusion", source, "y = F.scaled")
    assert "y = _tb_npu_sdpa(q, k, v, is_causal=True)" in once.source
    twice = _apply("attention-sdpa-npu-fusion", once.source, "return sdpa(")  # the import alias resolves
    assert "return _tb_npu_sdpa(y, k, v, is_causal=True)" in twice.source
    assert twice.source.count("def _tb_npu_sdpa(") == 1 and twice.source.count("def _tb_npu_causal_mask(") == 1


def test_rms_norm_statements_match_under_any_attribute_names_and_keep_the_casts():
    source = _src('''
        import torch
        from torch import nn


        class Norm(nn.Module):
            def forward(self, h):
                kept = h.dtype
                wide = h.to(torch.float32)
                ms = wide.square().mean(-1, keepdim=True)
                wide = wide * torch.rsqrt(ms + self.tiny)
                return self.scale * wide.to(kept)
    ''')
    edit = _apply("rmsnorm-statements-f-rms-norm", source, "ms = wide", "return self.scale")
    assert "wide = torch.nn.functional.rms_norm(wide, (wide.shape[-1],), eps=self.tiny)\n" in edit.source
    assert "wide = h.to(torch.float32)" in edit.source and "return self.scale * wide.to(kept)" in edit.source
    reused = source.replace("return self.scale * wide.to(kept)", "return self.scale * wide.to(kept), ms")
    with pytest.raises(CodemodRefused, match=r"ms \(line 11\) is read after"):
        _apply("rmsnorm-statements-f-rms-norm", reused, "ms = wide", "return self.scale")


def test_normalize_times_sqrt_d_is_rms_norm_but_another_scale_is_not():
    source = "import math\nimport torch.nn.functional as F\n\n\ndef f(x, g):\n    return F.normalize(x, dim=-1) * math.sqrt(x.shape[-1]) * g\n"
    edit = _apply("rmsnorm-normalize-f-rms-norm", source, "return F.normalize")
    assert "torch.nn.functional.rms_norm(x, (x.shape[-1],), eps=1e-24 / x.shape[-1]) * g" in edit.source
    with pytest.raises(CodemodRefused, match="no expression"):
        _apply("rmsnorm-normalize-f-rms-norm", source.replace("math.sqrt(x.shape[-1])", "2.0"), "return F.normalize")


def test_rotate_half_under_another_name_is_accepted_only_for_its_body():
    source = _src('''
        import torch
        from torch import nn


        class Rotary(nn.Module):
            @staticmethod
            def _swap_halves(x):
                half = x.shape[-1] // 2
                return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

            def forward(self, q, cos, sin):
                return q * cos + Rotary._swap_halves(q) * sin
    ''')
    edit = _apply("rope-npu-rotary-mul", source, "return q * cos")
    assert "return torch_npu.npu_rotary_mul(q, _tb_rope_table(cos, q), _tb_rope_table(sin, q), rotary_mode=\"half\")" in edit.source
    other_way = source.replace("torch.cat((-x[..., half:], x[..., :half]), dim=-1)", "torch.cat((x[..., half:], -x[..., :half]), dim=-1)")
    with pytest.raises(CodemodRefused, match=r"_swap_halves\(\) computes something else"):
        _apply("rope-npu-rotary-mul", other_way, "return q * cos")


EAGER = _src('''
    import math

    import torch
    from torch import nn


    def with_mask(scores, mask):
        return scores if mask is None else scores + mask


    class Attention(nn.Module):
        def eager(self, query, key, value, mask):
            scores = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(self.head_dim)
            scores = with_mask(scores, mask)
            probs = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            return torch.matmul(probs, value)
''')


def test_eager_attention_with_the_programs_mask_helper_becomes_sdpa():
    edit = _apply("attention-sdpa-additive-mask", EAGER, "scores = torch.matmul", "return torch.matmul")
    assert ("return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, "
            "scale=self.head_dim ** -0.5)") in edit.source
    assert "def with_mask(scores, mask):" in edit.source  # the helper stays: others may call it
    boolean = EAGER.replace("scores if mask is None else scores + mask", "scores.masked_fill(mask, float('-inf'))")
    with pytest.raises(CodemodRefused, match=r"with_mask\(\) computes something else"):
        _apply("attention-sdpa-additive-mask", boolean, "scores = torch.matmul", "return torch.matmul")


def test_a_split_heads_merge_is_fused_only_when_the_transposed_name_is_not_used_again():
    source = _src('''
        import torch.nn.functional as F


        def merge(q, k, v, wo, b, s):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
            return wo(out.reshape(b, s, -1))
    ''')
    edit = _apply("permute-reshape-npu-confusion-transpose-split", source, "out = F.", "return wo")
    assert "return wo(_tb_npu_confusion_transpose(F.scaled_dot_product_attention(q, k, v, is_causal=True), [b, s, -1]))" \
        in edit.source
    assert edit.source.count("scaled_dot_product_attention(") == 1  # the attention is computed once
    twice = source.replace("return wo(out.reshape(b, s, -1))", "return wo(out.reshape(b, s, -1)) + out.sum()")
    with pytest.raises(CodemodRefused, match=r"out is read again in the statement the rewrite ends at"):
        _apply("permute-reshape-npu-confusion-transpose-split", twice, "out = F.", "return wo")
