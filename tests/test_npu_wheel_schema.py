"""The emulated torch_npu against the torch-npu 2.13.0 wheel's own op schemas.

The schemas are a fixture read from the wheel (tests/fixtures/npu_reference/
torch_npu_2.13.0_wheel_schemas.txt, with the wheel's sha256 in its header; regenerate it with
extract_wheel_schemas.py beside it), so the check runs offline on every machine and never skips
because a registry is out of reach. An emulated op the wheel does not declare is skipped with the
reason in pytest's summary (it is checked against op-plugin's schema in test_npu_emulation.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainbridge.tests.npu_emulation_support import EMULATED_OPS, assert_signature_matches, tnpu  # noqa: F401 (tnpu is a fixture)

WHEEL_VERSION = "2.13.0"  # pairs with the torch this project pins
SCHEMAS = Path(__file__).parent / "fixtures" / "npu_reference" / f"torch_npu_{WHEEL_VERSION}_wheel_schemas.txt"
CORE_OPS = {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention"}


def wheel_schemas() -> dict[str, str]:
    """Op name -> its schema line, as the wheel declares it."""
    lines = [line for line in SCHEMAS.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]
    return {line.split("(", 1)[0]: line for line in lines}


def test_the_fixture_comes_from_the_pinned_wheel():
    header = SCHEMAS.read_text(encoding="utf-8").splitlines()[0]
    assert f"torch_npu-{WHEEL_VERSION}-" in header and "sha256" in header, header
    assert len(wheel_schemas()) > 100  # the whole npu_* family, not a hand-picked subset


def test_the_wheel_declares_the_fused_ops_the_recipes_use():
    schemas = wheel_schemas()
    assert CORE_OPS <= set(schemas), f"missing from the wheel: {sorted(CORE_OPS - set(schemas))}"


@pytest.mark.parametrize("name", EMULATED_OPS)
def test_emulated_signature_matches_the_wheel(tnpu, name):  # noqa: F811
    schemas = wheel_schemas()
    if name not in schemas:
        pytest.skip(f"NOT CHECKED against the wheel: {name} is not in its codegen schema file "
                    "(checked against op-plugin's schema in test_npu_emulation.py instead)")
    assert_signature_matches(getattr(tnpu, name), name, schemas[name], same_default_type=False)
