"""Script-mode call overrides reach bare decorators: `@torch.compile` above a function is `torch.compile(function)`,
so `compile(disable) = true` leaves the function eager as it does `torch.compile(model)`. The later Modded-NanoGPT
records decorate their FP8 matmul kernels and their optimizer's step with a bare `@torch.compile` (record 38:
DistAdam.step), which under the NPU emulation failed in Dynamo although the run disabled the records' compile calls."""

from __future__ import annotations

import textwrap
from pathlib import Path

from trainbridge.sandbox.script.overrides import OverridePlan, compile_source, install

SOURCE = textwrap.dedent('''
    import functools
    import torch


    def tagging(fn=None, *, disable=False):
        def wrap(f):
            f.disabled = disable
            return f
        return wrap(fn) if fn is not None else wrap


    @tagging
    def bare(x):
        return x + 1


    class Opt:
        @tagging
        @functools.lru_cache
        def step(self):
            return 2


    @tagging(disable=False)
    def called(x):
        return x


    @functools.lru_cache
    def other():
        return 3
''')


def test_a_bare_decorator_gets_the_forced_keywords_of_its_call():
    plan = OverridePlan.from_overrides({"tagging(disable)": True})
    install(Path("/nonexistent-root"), OverridePlan())  # the helpers only
    namespace: dict = {"__name__": "fixture"}
    exec(compile_source(SOURCE, "fixture.py", plan, is_script=True), namespace)
    assert namespace["bare"].disabled is True and namespace["bare"](1) == 2
    assert namespace["Opt"].step.disabled is True and namespace["Opt"]().step() == 2  # in a class, over another one
    assert namespace["called"].disabled is True  # the call form, as before
    assert namespace["other"]() == 3 and not hasattr(namespace["other"], "disabled")  # other decorators stay
    assert not plan.unmatched()


def test_compile_disable_leaves_a_decorated_function_eager():
    plan = OverridePlan.from_overrides({"compile(disable)": True})
    install(Path("/nonexistent-root"), OverridePlan())
    namespace: dict = {"__name__": "fixture"}
    exec(compile_source("import torch\n\n@torch.compile\ndef f(x):\n    return x * 2\n", "fixture.py", plan,
                        is_script=True), namespace)
    assert namespace["f"].__name__ == "f" and not hasattr(namespace["f"], "_torchdynamo_orig_callable")
    assert namespace["f"](3) == 6
