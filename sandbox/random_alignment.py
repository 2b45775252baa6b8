"""Random ops drawn alike on both sides of a gate, so numerics compare like with like (issue 30, item 2).

A compiled region draws its random numbers (dropout masks, `torch.rand*` inside the graph) from Inductor's own
generator, not from the eager generator the baseline's dropout draws from: a regional compile of a model with
dropout is then compared against different masks, and an honest rewrite fails numerics (gradient cosine ~0.7
on the issue's model). Inductor's `fallback_random` makes compiled random ops call the eager ones, drawing the
same numbers in the same order. Every gate child (both sides, every round, the drift child too) turns it on
before the workload's code runs, so the checks and the timed steps see one program: a compiled candidate's
random ops are timed as eager ones (its gain, if any, is read a little low, never high).

The probe says when it mattered: `aligned_by()` names the alignment when this process compiled a graph.
"""

from __future__ import annotations

import sys

FALLBACK_RANDOM = "inductor_fallback_random"
ALIGNED_NOTE = ("random ops aligned: the compiled graphs drew eager's random numbers (Inductor's fallback_random, "
                "on both sides and in the timed steps)")


def align() -> None:
    """Compiled random ops draw from the eager generator in this process (call before the workload runs)."""
    import torch._inductor.config as inductor_config

    inductor_config.fallback_random = True


def aligned_by() -> str | None:
    """`FALLBACK_RANDOM` when this process compiled at least one graph with random ops aligned; else None."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    inductor_config = sys.modules.get("torch._inductor.config")
    if dynamo_utils is None or inductor_config is None or not getattr(inductor_config, "fallback_random", False):
        return None
    return FALLBACK_RANDOM if dynamo_utils.counters["stats"]["unique_graphs"] > 0 else None
