"""Every TRAINBRIDGE_* variable is one typed setting, read when asked, documented in the README (issue 27)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainbridge.settings import INTERNAL, SettingsError, settings, variables

ROOT = Path(__file__).resolve().parents[1]
NOT_PACKAGE = {"tests", "benchmarks", "examples", ".venv"}


def names_in_package_source() -> dict[str, str]:
    """Every TRAINBRIDGE_* name the installed package's source spells out -> one file that does."""
    found: dict[str, str] = {}
    for path in sorted(ROOT.rglob("*.py")):
        if path.relative_to(ROOT).parts[0] in NOT_PACKAGE:
            continue
        for name in re.findall(r"\bTRAINBRIDGE_[A-Z][A-Z_]*[A-Z]\b", path.read_text(encoding="utf-8")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    return found


def test_every_variable_the_package_reads_is_a_setting_or_an_internal_message():
    documented = {name for name, _ in variables()} | set(INTERNAL)
    stray = {name: where for name, where in names_in_package_source().items() if name not in documented}
    assert not stray, f"TRAINBRIDGE_* names that settings.py does not document: {stray}"
    assert all(description for _, description in variables())


def test_the_readme_lists_every_setting():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("## Environment variables"):]
    missing = [name for name, _ in variables() if f"`{name}`" not in table and name.removeprefix("TRAINBRIDGE_LLM") not in table]
    assert not missing, f"settings missing from the README's 'Environment variables' table: {missing}"


def test_settings_are_read_when_asked_and_homes_follow_them(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINBRIDGE_HOME", raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    assert settings().data_dir("runs") == tmp_path / "xdg" / "trainbridge" / "runs"
    monkeypatch.setenv("TRAINBRIDGE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRAINBRIDGE_GATE_PAIRING", "sequential")
    monkeypatch.setenv("TRAINBRIDGE_CONFINE", "0")
    current = settings()
    assert current.data_dir("kb") == tmp_path / "home" / "kb" and current.GATE_PAIRING == "sequential" and not current.CONFINE
    monkeypatch.setenv("TRAINBRIDGE_HOME", "")  # empty is unset, as before
    assert settings().HOME is None


@pytest.mark.parametrize("name, value, said", [("TRAINBRIDGE_GATE_SPAWN", "thread", "'fork-server' or 'exec'"),
                                               ("TRAINBRIDGE_CONFINE", "maybe", "boolean"),
                                               ("TRAINBRIDGE_EMULATED_NPU_COUNT", "0", "greater than or equal to 1")])
def test_a_value_that_does_not_parse_is_one_line_naming_the_variable(monkeypatch, name, value, said):
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as raised:
        settings()
    message = str(raised.value)
    assert message.startswith(f"{name}={value!r}: ") and said in message and "\n" not in message
    assert "pydantic" not in message
