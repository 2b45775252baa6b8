"""The emulated torch_npu against the torch-npu 2.13.0 wheel's own op schemas.

The wheel is fetched from the package registry in this test's setup (`pip download --no-deps`, no
install: it is read as data) and the test is skipped, saying why, when the registry is unreachable.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from trainbridge.tests.test_npu_emulation import EMULATED_OPS, assert_signature_matches, tnpu  # noqa: F401 (tnpu is a fixture)

WHEEL_VERSION = "2.13.0"  # pairs with the torch this project pins
SCHEMA_FILE = "torch_npu/csrc/aten/npu_native_functions_by_codegen.yaml"
CORE_OPS = {"npu_rms_norm", "npu_rotary_mul", "npu_swiglu", "npu_fusion_attention"}


@pytest.fixture(scope="module")
def wheel_schemas(tmp_path_factory) -> dict[str, str]:
    target = tmp_path_factory.mktemp("torch_npu_wheel")
    fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                              f"torch-npu=={WHEEL_VERSION}", "-d", str(target)], capture_output=True, text=True, timeout=600)
    wheels = list(target.glob("torch_npu-*.whl"))
    if fetched.returncode != 0 or not wheels:
        pytest.skip(f"could not download torch-npu=={WHEEL_VERSION} from the package registry: {fetched.stderr.strip()[-300:]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        text = wheel.read(SCHEMA_FILE).decode("utf-8")
    schemas: dict[str, str] = {}
    for line in text.splitlines():
        found = re.match(r"\s*-?\s*func:\s*((\w+)\(.*\) -> .*)$", line)
        if found:
            schemas.setdefault(found.group(2), found.group(1))
    return schemas


def test_the_wheel_declares_the_fused_ops_the_recipes_use(wheel_schemas):
    assert CORE_OPS <= set(wheel_schemas), f"missing from the wheel: {sorted(CORE_OPS - set(wheel_schemas))}"


@pytest.mark.parametrize("name", EMULATED_OPS)
def test_emulated_signature_matches_the_wheel(tnpu, wheel_schemas, name):  # noqa: F811
    if name not in wheel_schemas:
        pytest.skip(f"{name} is not in the wheel's codegen schema file (checked against op-plugin's schema instead)")
    assert_signature_matches(getattr(tnpu, name), name, wheel_schemas[name], same_default_type=False)
