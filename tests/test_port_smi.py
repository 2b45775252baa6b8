"""`trainbridge port` and a subprocess call of nvidia-smi (issue 25, item 3): `subprocess.run(["nvidia-smi"], ...)`,
which the Modded-NanoGPT records log at start, stopped a ported program on an Ascend host and under the emulation
(FileNotFoundError: there is no nvidia-smi); it becomes npu-smi's overview where npu-smi exists, else a no-op that
says so. A query or a shell string (another output format) stays reported at its line."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

from trainbridge.tools.porting import ChangeKind, SkipCategory, port_source

CODE = textwrap.dedent("""\
    import os
    import subprocess
    result = subprocess.run(["nvidia-smi"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    print("smi:", result.returncode, result.stdout.strip())
    names = subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv"])
    os.system("nvidia-smi")
""")


def test_a_logged_nvidia_smi_call_runs_as_ported_and_queries_stay_reported(tmp_path):
    result = port_source(CODE, "train.py")
    assert [(c.line, c.kind) for c in result.changes] == [(3, ChangeKind.smi_command)]
    assert [(s.line, s.category, s.blocking) for s in result.skipped] == [
        (5, SkipCategory.cuda_api, True), (6, SkipCategory.cuda_api, True)]
    ported = result.source.splitlines()
    assert "nvidia-smi" not in ported[2] and '"npu-smi", "info"' in ported[2]
    script = tmp_path / "log_smi.py"
    script.write_text("\n".join(ported[:4]) + "\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    if shutil.which("npu-smi") is None:
        assert done.stdout.strip() == "smi: 0 npu-smi: not on this host"
    assert port_source(result.source, "train.py").changes == []  # idempotent
