"""Shared records and fixtures of the knowledge-base tests (tests/test_knowledge*.py): intents and
outcomes on fixed evidence, the seed recipes the tests reason about, a knowledge base in a temporary
directory, the `trainbridge kb` CLI runner and a free loopback port."""

from __future__ import annotations

import socket
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from trainbridge.knowledge.cli import kb_app
from trainbridge.knowledge.schema import Outcome
from trainbridge.knowledge.store import SEED_DIR, KnowledgeBase
from trainbridge.records import Evidence, Intent, IntentSource, SourceSpan


PYTHON = sys.executable
CHROMA = Path(sys.executable).parent / "chroma"
T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)

RMSNORM_EVIDENCE = Evidence(
    reference_kernels=1,
    target_ops=6,
    kernels=["cpp_fused_add_mean_mul_pow_rsqrt_0"],
    target_op_names=["aten::pow", "aten::mean", "aten::add", "aten::rsqrt", "aten::mul", "aten::mul"],
)
GELU_EVIDENCE = Evidence(
    reference_kernels=1,
    target_ops=7,
    kernels=["cpp_fused_add_mul_pow_tanh_1"],
    target_op_names=["aten::mul", "aten::pow", "aten::mul", "aten::add", "aten::mul", "aten::tanh", "aten::add"],
)
ADAMW_EVIDENCE = Evidence(
    target_ops=120,
    target_op_names=["aten::mul_", "aten::add_", "aten::lerp_", "aten::addcmul_", "aten::sqrt", "aten::div", "aten::addcdiv_"],
    notes=["Optimizer.step#AdamW.step"],
)


def intent(category: str, evidence: Evidence, line: int = 10) -> Intent:
    spans = [SourceSpan(file="model.py", line_start=line, line_end=line + 2)]
    return Intent(
        id=Intent.make_id(category, spans),
        category=category,
        spans=spans,
        evidence=evidence,
        confidence=0.9,
        source=IntentSource.runtime,
    )


def outcome(recipe_id: str | None, verdict: str, *, category="rmsnorm", evidence=RMSNORM_EVIDENCE, backend="npu",
            ratio=None, minutes=0, run="run-1") -> Outcome:
    return Outcome(
        run_id=run,
        intent_id=f"{category}-{minutes}",
        category=category,
        evidence=evidence,
        recipe_id=recipe_id,
        diff=f"--- a/model.py\n+++ b/model.py\n@@ -1 +1 @@\n-old {minutes}\n+new\n",
        verdict=verdict,
        ratio=ratio,
        ratio_ci=(ratio * 0.98, ratio * 1.02) if ratio else None,
        backend=backend,
        versions={"torch": "2.13.0"},
        timestamp=T0 + timedelta(minutes=minutes),
    )


def seed_recipe(recipe_id: str) -> dict:
    return yaml.safe_load((SEED_DIR / f"{recipe_id}.yaml").read_text())


# The seeds these tests reason about; other seed recipes may ship beside them, so the tests that
# depend on the exact recipe set use a folder holding only these.
OWN_SEEDS = ["adamw-foreach-to-fused", "adamw-npu-fused", "gelu-tanh-functional", "rmsnorm-f-rms-norm",
             "rmsnorm-npu-rms-norm"]


@pytest.fixture
def seeds(tmp_path):
    folder = tmp_path / "seeds"
    folder.mkdir()
    for rid in OWN_SEEDS:
        (folder / f"{rid}.yaml").write_text((SEED_DIR / f"{rid}.yaml").read_text())
    return folder


@pytest.fixture
def kb(tmp_path, seeds):
    with KnowledgeBase(tmp_path / "kb", seed_dir=seeds) as base:
        yield base


def invoke(*args: str):
    return CliRunner().invoke(kb_app, list(args), env={"COLUMNS": "200"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
