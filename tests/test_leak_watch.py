"""The leak watch (tests/leak_watch.py) lists and kills what a test file leaves running, and only that."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainbridge.sandbox import proc_watch

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="the leak watch reads /proc")

LEAKY = textwrap.dedent('''
    import os, subprocess, sys

    def test_orphans_a_sleeper():
        # a grandchild whose parent exits at once: an orphan, as a training script is after its launcher is killed
        launcher = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], "
                    "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); print(p.pid)")
        done = subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, check=True)
        open(os.environ["ORPHAN_PID_FILE"], "w").write(done.stdout.strip())

    def test_cleans_up_after_itself():
        p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        p.kill(); p.wait()
''')


def test_an_orphan_is_listed_with_its_file_and_killed(tmp_path):
    (tmp_path / "test_leaky.py").write_text(LEAKY, encoding="utf-8")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["trainbridge.tests.leak_watch"]\n', encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_leaky.py"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "ORPHAN_PID_FILE": str(tmp_path / "pid")})
    assert done.returncode == 0, done.stdout + done.stderr
    pid = int((tmp_path / "pid").read_text())
    deadline = time.monotonic() + 5
    while proc_watch.alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not proc_watch.alive(pid), f"the orphan {pid} still runs"
    assert "processes left behind by test files: 1 (killed)" in done.stdout, done.stdout
    assert f"test_leaky.py: pid {pid}: " in done.stdout and "time.sleep(300)" in done.stdout, done.stdout


def test_a_clean_file_prints_nothing(tmp_path):
    (tmp_path / "test_clean.py").write_text("def test_nothing():\n    assert True\n", encoding="utf-8")
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["trainbridge.tests.leak_watch"]\n', encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_clean.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "left behind" not in done.stdout, done.stdout
