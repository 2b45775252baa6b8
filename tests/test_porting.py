"""`trainbridge port --to npu`: the libcst port of CUDA programs, its report, and its CLI.

Real inputs: copies of the bundled examples and a CUDA-only fixture program
(tests/fixtures/gpu_program, expectations as `# port-skip:` / `# port-change:` comments on the
lines themselves). Checks of the output use Python's `ast`, not the porter's own machinery.
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import git
import pytest
import typer

from trainbridge.tools.porting import ChangeKind, SkipCategory, port_repo, port_source
from trainbridge.tools.porting.npu_surface import NPU_DEVICE_MODULE
from trainbridge.tools.porting.cli import PortError, port_command, port_to_branch, run_port

MAIN = Path(__file__).resolve().parents[1]
EXAMPLES = MAIN / "examples"
GPU_PROGRAM = Path(__file__).resolve().parent / "fixtures" / "gpu_program"
API_SURFACE = Path(__file__).parent / "fixtures" / "npu_reference" / "torch_npu_python_api_surface.txt"
EXAMPLE_NAMES = ["llama_pretrain", "gpt2_pretrain", "resnet_classify", "clip_pretrain"]
_CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
_NPU_DEVICE = re.compile(r"npu(:\d+)?")


# ---------------------------------------------------------------- helpers (independent of the porter)


def cuda_leftovers(tree: ast.AST) -> list[str]:
    """Device references that still point at CUDA: literals, torch.cuda / .cuda(), nccl."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                _CUDA_DEVICE.fullmatch(node.value) or node.value == "nccl"):
            found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.Attribute) and node.attr in ("cuda", "is_cuda"):
            found.append(f"line {node.lineno}: .{node.attr}")
    return found


def references_npu(tree: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                _NPU_DEVICE.fullmatch(node.value) or node.value == "hccl"):
            return True
        if isinstance(node, ast.Attribute) and node.attr in ("npu", "is_npu"):
            return True
    return False


def torch_npu_imports(tree: ast.AST) -> list[int]:
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Import)
            and any(alias.name == "torch_npu" for alias in node.names)]


def markers(root: Path, tag: str) -> set[tuple[str, int, str]]:
    """(file, line, value) for every `# <tag>: a, b` / `// <tag>: a` comment under root."""
    found = set()
    for path in sorted(root.rglob("*")):
        if path.suffix not in (".py", ".cu"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = re.search(rf"(?:#|//) {tag}: ([\w, ]+)$", line)
            if match:
                found |= {(path.relative_to(root).as_posix(), number, v.strip()) for v in match.group(1).split(",")}
    return found


def copy_example(name: str, dest: Path) -> Path:
    return Path(shutil.copytree(EXAMPLES / name, dest / name, ignore=shutil.ignore_patterns("__pycache__")))


def write_all(root: Path, result) -> None:
    for ported in result.files:
        (root / ported.file).write_text(ported.source)


# ---------------------------------------------------------------- the bundled examples


@pytest.mark.parametrize("name", EXAMPLE_NAMES)
def test_example_ports_to_npu_and_is_idempotent(name, tmp_path):
    root = copy_example(name, tmp_path)
    originals = {p.relative_to(root).as_posix(): p.read_text() for p in root.glob("*.py")}
    first = port_repo(root)
    assert {f.file for f in first.files} == set(originals)
    assert [s for s in first.skipped if s.blocking] == []  # the examples use nothing that needs manual porting
    write_all(root, first)
    for path in sorted(root.glob("*.py")):
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(), filename=rel)
        assert cuda_leftovers(tree) == [], rel
        imports = torch_npu_imports(tree)
        assert len(imports) == (1 if references_npu(tree) else 0), (rel, imports)
        # only the reported lines changed (plus the added import): formatting and comments are kept
        diff = list(difflib.ndiff(originals[rel].splitlines(), path.read_text().splitlines()))
        removed = {i + 1 for i, line in enumerate(l for l in diff if not l.startswith(("+", "?"))) if line.startswith("-")}
        reported = {c.line for f in first.files if f.file == rel for c in f.changes if c.kind != ChangeKind.import_torch_npu}
        assert removed == reported, rel
        assert sum(1 for line in diff if line.startswith("+ ")) == len(removed) + len(imports)
    train = ast.parse((root / "train.py").read_text())
    assert references_npu(train) and torch_npu_imports(train)
    second = port_repo(root)
    assert [f.file for f in second.files if f.changed] == []
    assert second.changes == [] and second.skipped == first.skipped


def test_llama_train_port_reads_as_expected(tmp_path):
    root = copy_example("llama_pretrain", tmp_path)
    result = port_repo(root)
    train = next(f for f in result.files if f.file == "train.py")
    lines = train.source.splitlines()
    assert lines[lines.index("import torch") + 1].startswith("import torch_npu")
    assert '    device = args.device or ("npu" if torch.npu.is_available() else "cpu")' in lines
    assert '    if device.startswith("npu"):' in lines
    assert "        torch.npu.synchronize()" in lines
    model = next(f for f in result.files if f.file == "model.py")
    assert not model.changed and model.changes == []  # device=q.device: nothing CUDA-specific


# ---------------------------------------------------------------- the CUDA-only fixture program


@pytest.fixture(scope="module")
def gpu_port():
    return port_repo(GPU_PROGRAM)


def test_fixture_reports_every_unportable_construct_at_its_line(gpu_port):
    expected = markers(GPU_PROGRAM, "port-skip")
    reported = {(s.file, s.line, s.category.value) for s in gpu_port.skipped}
    assert reported == expected
    categories = {s.category for s in gpu_port.skipped}
    assert {SkipCategory.triton, SkipCategory.flash_attn, SkipCategory.fp8, SkipCategory.cuda_graph,
            SkipCategory.cuda_extension, SkipCategory.cuda_source, SkipCategory.kernels_hub, SkipCategory.nvtx,
            SkipCategory.compile, SkipCategory.backend_flag, SkipCategory.cuda_api} <= categories


def test_fixture_changes_exactly_the_marked_lines(gpu_port):
    expected = markers(GPU_PROGRAM, "port-change")
    reported = {(c.file, c.line, c.kind.value) for c in gpu_port.changes if c.kind != ChangeKind.import_torch_npu}
    assert reported == expected


def test_fixture_blocking_flags_and_reasons(gpu_port):
    by_category: dict[SkipCategory, set[bool]] = {}
    for item in gpu_port.skipped:
        by_category.setdefault(item.category, set()).add(item.blocking)
        assert item.reason and item.code
    for category in (SkipCategory.triton, SkipCategory.flash_attn, SkipCategory.fp8, SkipCategory.cuda_graph,
                     SkipCategory.cuda_extension, SkipCategory.kernels_hub):
        assert by_category[category] == {True}, category
    assert by_category[SkipCategory.backend_flag] == {False}
    flash = next(s for s in gpu_port.skipped if s.category == SkipCategory.flash_attn)
    assert "npu_fusion_attention" in flash.reason and "sparse_mode=3" in flash.reason
    graph = next(s for s in gpu_port.skipped if s.category == SkipCategory.cuda_graph)
    assert "NPUGraph" in graph.reason


# FP8 carried to bf16 and Triton launches carried to PyTorch ops run on any device: no torch_npu import for them alone
DEVICE_NEUTRAL = {ChangeKind.fp8_matmul, ChangeKind.fp8_dtype, ChangeKind.triton_launch, ChangeKind.triton_removed,
                  ChangeKind.triton_import}


def test_fixture_port_leaves_skipped_code_untouched_and_parses(gpu_port, tmp_path):
    root = Path(shutil.copytree(GPU_PROGRAM, tmp_path / "gpu"))
    write_all(root, gpu_port)
    for ported in gpu_port.files:
        tree = ast.parse(ported.source)
        original = (GPU_PROGRAM / ported.file).read_text()
        skipped_lines = {s.line for s in ported.skipped}
        new_lines = ported.source.splitlines()
        for line in skipped_lines:
            assert original.splitlines()[line - 1] in new_lines, (ported.file, line)
        if any(c.kind not in DEVICE_NEUTRAL for c in ported.changes):
            assert len(torch_npu_imports(tree)) == 1
    train = (root / "train.py").read_text()
    assert "from torch_npu.npu.amp import GradScaler, autocast  # port-change: import_rewrite" in train
    assert 'os.environ["ASCEND_RT_VISIBLE_DEVICES"] = str(rank)' in train
    assert 'dist.init_process_group(backend="hccl", rank=rank, world_size=world_size)' in train
    assert 'torch.autocast("npu", dtype=torch.bfloat16), torch.npu.amp.autocast()' in train
    assert "graph = torch.cuda.CUDAGraph()" in train  # not ported: reported instead
    assert port_repo(root).changes == []


# ---------------------------------------------------------------- port_source on small programs


def port(code: str, relpath: str = "prog.py"):
    result = port_source(code, relpath)
    again = port_source(result.source, relpath)
    assert again.source == result.source and again.changes == [], "porting twice must be a no-op"
    ast.parse(result.source)
    return result


def test_aliases_device_strings_and_formats():
    code = ('import torch as th\n\nth.cuda.manual_seed_all(0)\nx = th.zeros(3, device="cuda:1")  # keep me\n'
            'y = x.to(th.device("cuda", 0), non_blocking=True)\nz = [t.cuda(non_blocking=True) for t in (x, y)]\n'
            'd = f"cuda:{rank}"\ne = "cuda:{}".format(rank)\nf = "cuda:%d" % rank\n')
    result = port(code)
    assert result.source.splitlines() == [
        "import torch as th", "import torch_npu  # noqa: F401  (registers the npu device, torch.npu and hccl)", "",
        "th.npu.manual_seed_all(0)", 'x = th.zeros(3, device="npu:1")  # keep me',
        'y = x.to(th.device("npu", 0), non_blocking=True)', "z = [t.npu(non_blocking=True) for t in (x, y)]",
        'd = f"npu:{rank}"', 'e = "npu:{}".format(rank)', 'f = "npu:%d" % rank']
    assert [(c.line, c.kind) for c in result.changes] == [
        (1, ChangeKind.import_torch_npu), (3, ChangeKind.device_module), (4, ChangeKind.device_string),
        (5, ChangeKind.device_string), (6, ChangeKind.to_npu_method), (7, ChangeKind.device_string),
        (8, ChangeKind.device_string), (9, ChangeKind.device_string)]


def test_prose_flags_and_non_device_strings_are_left_alone():
    code = ('"""Runs on cuda when available."""\nimport torch\n\n'
            'def main(args, model):\n    if args.cuda:  # a CLI flag, not torch.cuda\n        model = model.cuda()\n'
            '    print("cuda is great", "cudnn", "cuda_graph")\n    return model\n')
    result = port(code)
    assert "if args.cuda:  # a CLI flag, not torch.cuda" in result.source
    assert "model = model.npu()" in result.source
    assert 'print("cuda is great", "cudnn", "cuda_graph")' in result.source
    assert result.source.startswith('"""Runs on cuda when available."""\nimport torch\nimport torch_npu')


def test_amp_and_distributed():
    code = ("import torch\nimport torch.distributed as dist\nfrom torch.cuda import amp\n\n"
            "scaler = torch.cuda.amp.GradScaler()\nwith amp.autocast(dtype=torch.float16):\n    pass\n"
            'dist.init_process_group("nccl")\ndist.new_group(backend=dist.Backend.NCCL)\n'
            'dist.init_process_group(backend="cpu:gloo,cuda:nccl")\n'
            'with torch.amp.autocast(device_type="cuda"):\n    pass\n')
    result = port(code)
    for line in ("from torch_npu.npu import amp", "scaler = torch.npu.amp.GradScaler()",
                 "with amp.autocast(dtype=torch.float16):", 'dist.init_process_group("hccl")',
                 "dist.new_group(backend=dist.Backend.HCCL)", 'dist.init_process_group(backend="cpu:gloo,npu:hccl")',
                 'with torch.amp.autocast(device_type="npu"):'):
        assert line in result.source.splitlines(), line
    assert result.skipped == []


def test_from_torch_import_cuda_is_renamed_with_torch_npu_loaded_first():
    code = "from torch import cuda\n\ncuda.synchronize()\nn = cuda.device_count()\n"
    result = port(code)
    assert result.source.splitlines() == [
        "import torch_npu  # noqa: F401  (registers the npu device, torch.npu and hccl)", "from torch import npu", "",
        "npu.synchronize()", "n = npu.device_count()"]


def test_binding_with_an_unsupported_use_is_left_whole_and_reported():
    code = "from torch import cuda\n\ncuda.synchronize()\ng = cuda.CUDAGraph()\n"
    result = port(code)
    assert result.source == code and not result.changed
    assert {(s.line, s.category) for s in result.skipped} == {(1, SkipCategory.cuda_api), (4, SkipCategory.cuda_graph)}
    assert "line(s) 4" in next(s for s in result.skipped if s.line == 1).reason


def test_from_import_with_a_member_torch_npu_lacks_is_left_and_reported():
    code = "import torch\nfrom torch.cuda import synchronize, get_arch_list\nfrom torch.cuda.amp import custom_fwd\n"
    result = port(code)
    assert result.source == code
    assert [(s.line, s.category) for s in result.skipped] == [(2, SkipCategory.cuda_api), (3, SkipCategory.cuda_api)]
    assert "custom_fwd(device_type='npu'" in result.skipped[1].reason


def test_module_aliases_streams_and_unsupported_members():
    code = ("import torch\nimport torch.cuda as tc\nfrom torch.cuda.amp import (\n    autocast as ac,  # mixed precision\n"
            "    GradScaler,\n)\n\n\ndef run(x):\n    mod = torch.cuda\n    tc.synchronize()\n"
            "    with torch.cuda.device(1), ac():\n        s = torch.cuda.Stream()\n"
            "        e = torch.cuda.Event(enable_timing=True)\n    torch.cuda.memory._record_memory_history()\n"
            "    return x\n")
    result = port(code)
    lines = result.source.splitlines()
    assert lines[1:8] == ["import torch_npu  # noqa: F401  (registers the npu device, torch.npu and hccl)",
                          "import torch_npu.npu as tc", "from torch_npu.npu.amp import (",
                          "    autocast as ac,  # mixed precision", "    GradScaler,", ")", ""]
    for line in ("    with torch.npu.device(1), ac():", "        s = torch.npu.Stream()",
                 "        e = torch.npu.Event(enable_timing=True)", "    mod = torch.cuda",
                 "    torch.cuda.memory._record_memory_history()"):
        assert line in lines, line
    assert [(s.line, s.category) for s in result.skipped] == [(10, SkipCategory.cuda_api), (15, SkipCategory.cuda_api)]
    assert "no `memory`" in result.skipped[1].reason


def test_import_goes_after_docstring_and_future_without_torch_import():
    code = '"""Doc."""\n\nfrom __future__ import annotations\n\nimport os\n\n\ndef f(x):\n    return x.cuda()\n'
    result = port(code)
    assert result.source == ('"""Doc."""\n\nfrom __future__ import annotations\n\n'
                             "import torch_npu  # noqa: F401  (registers the npu device, torch.npu and hccl)\n"
                             "import os\n\n\ndef f(x):\n    return x.npu()\n")


def test_compile_backends_and_extensions():
    code = ("import torch\nfrom torch.utils import cpp_extension\n\n"
            'a = torch.compile(f, backend="npu")\nb = torch.compile(f, backend="aot_eager")\n'
            'c = torch.compile(f, backend="inductor", mode="reduce-overhead")\n'
            'ext = cpp_extension.load_inline("x", cpp_sources=[src], cuda_sources=[cu])\n'
            'cpu_ext = cpp_extension.load("y", sources=["y.cpp"])\n'
            'pos = cpp_extension.load_inline("z", [src], [cu])\nno_cu = cpp_extension.load_inline("w", [src], cuda_sources=None)\n'
            'flag = cpp_extension.load("v", ["v.cpp"], with_cuda=True)\ng = torch.compile(f, backend="cudagraphs")\n')
    result = port(code)
    assert [(s.line, s.category, s.blocking) for s in result.skipped] == [
        (6, SkipCategory.compile, True), (6, SkipCategory.compile, False), (7, SkipCategory.cuda_extension, True),
        (9, SkipCategory.cuda_extension, True), (11, SkipCategory.cuda_extension, True), (12, SkipCategory.compile, True)]
    assert "CUDA graph" in result.skipped[-1].reason
    # nothing here has an NPU spelling to rewrite; backend="npu" needs torch_npu (TorchAir) loaded, though
    assert [c.kind for c in result.changes] == [ChangeKind.import_torch_npu]
    assert result.source.replace("import torch_npu  # noqa: F401  (registers the npu device, torch.npu and hccl)\n",
                                 "") == code


def test_cuda_version_checks_nvidia_smi_and_fused_optimizers_are_reported_at_their_lines():
    """Issue 25: a ported speedrun kept `nvidia-smi` calls, `torch.version.cuda` and `AdamW(fused=True)` without a word."""
    code = ("import os, subprocess\nimport torch\n\nprint(torch.version.cuda)\nsubprocess.run([\"nvidia-smi\"])\n"
            'os.system("nvidia-smi --query-gpu=name --format=csv")\nopt = torch.optim.AdamW(params, lr=1e-3, fused=True)\n'
            "sgd = torch.optim.SGD(params, lr=0.1, fused=False)\nlabel = 'nvidia smi is not called here'\n")
    result = port(code)
    # subprocess.run(["nvidia-smi"]) becomes npu-smi's overview or a no-op (tests/test_port_smi.py); a shell string stays
    assert [(s.line, s.category, s.blocking) for s in result.skipped] == [
        (4, SkipCategory.cuda_api, False), (6, SkipCategory.cuda_api, True)]
    assert "npu-smi info" in result.skipped[1].reason
    assert "None with an NPU build" in result.skipped[0].reason
    assert [c.line for c in result.changes if c.kind == ChangeKind.smi_command] == [5]
    # fused=True (CUDA's fused kernels) becomes foreach=True: the same update on any device; fused=False stays
    assert "opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)\n" in result.source
    assert "sgd = torch.optim.SGD(params, lr=0.1, fused=False)\n" in result.source
    assert [(c.line, c.kind, c.after) for c in result.changes if c.kind == ChangeKind.fused_optimizer] == [
        (7, ChangeKind.fused_optimizer, "foreach=True")]


def test_fused_true_beside_foreach_becomes_fused_false():
    result = port("import torch\nopt = torch.optim.Adam(ps, foreach=True, fused=True)\n")
    assert "opt = torch.optim.Adam(ps, foreach=True, fused=False)\n" in result.source and not result.skipped


def test_unparsable_file_is_left_and_reported():
    code = "print 'python 2'\nx = 'cuda'\n"
    result = port_source(code, "old.py")
    assert result.source == code and not result.changed
    assert [(s.line, s.category) for s in result.skipped] == [(1, SkipCategory.parse_error)]


@pytest.mark.skipif(not API_SURFACE.is_file(), reason="the reference torch_npu API surface file is not on this host")
def test_npu_device_module_table_matches_the_wheel_surface():
    text = API_SURFACE.read_text()
    listed = ast.literal_eval(text.split("## torch_npu/npu/__init__.py __all__", 1)[1].strip().splitlines()[0].strip())
    assert NPU_DEVICE_MODULE == frozenset(listed)


# ---------------------------------------------------------------- the command


def test_run_port_copies_into_empty_out_dir_and_never_touches_the_repo(tmp_path):
    repo = copy_example("gpt2_pretrain", tmp_path)
    before = {p.name: p.read_bytes() for p in repo.iterdir() if p.is_file()}
    outcome = run_port(repo, to="npu", out_dir=tmp_path / "ported")
    assert {p.name: p.read_bytes() for p in repo.iterdir() if p.is_file()} == before
    # the example's torchrun variant (train_ddp.py: nccl, cuda devices) is ported too
    assert outcome.files_written == ["train.py", "train_ddp.py"]
    assert "hccl" in (tmp_path / "ported" / "train_ddp.py").read_text()
    assert (tmp_path / "ported" / "trainbridge.toml").read_bytes() == before["trainbridge.toml"]
    assert "torch.npu.synchronize()" in (tmp_path / "ported" / "train.py").read_text()
    report = json.loads(outcome.report_json.read_text())
    assert report["files_written"] == ["train.py", "train_ddp.py"] and len(report["changes"]) == len(outcome.result.changes)
    assert "## Changes" in outcome.report_md.read_text()
    # a git repository, so that `trainbridge run` works on it at once (issue 25): the original, then the port
    log = subprocess.run(["git", "log", "--format=%s", "--name-only"], cwd=tmp_path / "ported", capture_output=True,
                         text=True, check=True).stdout
    assert log.startswith("ported to npu by trainbridge port (2 file(s) rewritten)\n\ntrain.py\ntrain_ddp.py\n"), log
    assert "the original, copied from" in log
    assert subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path / "ported", capture_output=True, text=True).stdout == ""
    with pytest.raises(PortError, match="overlaps the repository"):
        run_port(repo, out_dir=repo / "ported")
    with pytest.raises(PortError, match="supported targets"):
        run_port(repo, to="cuda", out_dir=tmp_path / "x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    with pytest.raises(PortError, match="neither empty nor a git worktree"):
        run_port(repo, out_dir=tmp_path / "full")


def test_dry_run_writes_nothing_and_prints_tables(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    repo = Path(shutil.copytree(GPU_PROGRAM, tmp_path / "gpu"))
    before = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*"))
    port_command(repo, to="npu", out_dir=None, run_id=None, workspace=None, dry_run=True, report_dir=None,
                 strict=False)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == before
    out = capsys.readouterr().out
    assert "Not ported" in out and "ops/triton_ops.py:16" in out and "dry run: nothing written" in out


def test_command_mounts_on_a_typer_app(tmp_path):
    from typer.testing import CliRunner

    app = typer.Typer()
    app.callback()(lambda: None)
    app.command("port")(port_command)
    repo = Path(shutil.copytree(GPU_PROGRAM, tmp_path / "gpu"))
    runner = CliRunner()
    bad = runner.invoke(app, ["port", str(repo), "--to", "cuda", "--dry-run"])
    assert bad.exit_code == 2 and "supported targets are npu" in bad.output
    strict = runner.invoke(app, ["port", str(repo), "--dry-run", "--strict"], env={"COLUMNS": "250"})
    assert strict.exit_code == 1, strict.output
    out = tmp_path / "out"
    ok = runner.invoke(app, ["port", str(repo), "--out", str(out)], env={"COLUMNS": "250"})
    assert ok.exit_code == 0, ok.output
    changed = sorted(f.file for f in port_repo(repo).changed_files)  # with the ops the port carries (FP8, Triton)
    assert {"ops/compiled.py", "ops/fp8_linear.py", "ops/triton_ops.py", "train.py"} <= set(changed)
    assert "ops/triton_ops.py:16" in ok.output and f"wrote {len(changed)} file(s) into {out}" in ok.output
    report = json.loads((tmp_path / "out.port-report" / "port-report.json").read_text())
    assert sorted(report["files_written"]) == changed


def _git_repo(root: Path) -> git.Repo:
    repo = git.Repo.init(root, initial_branch="main")
    with repo.config_writer() as config:
        config.set_value("user", "name", "Alice")
        config.set_value("user", "email", "alice@example.com")
    repo.git.add("-A")
    repo.git.commit("-m", "initial")
    return repo


def test_run_port_into_a_worktree_ports_the_committed_files_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    root = copy_example("resnet_classify", tmp_path / "user")
    repo = _git_repo(root)
    repo.git.worktree("add", "-q", str(tmp_path / "wt"), "-b", "port-wt")
    (root / "train.py").write_text((root / "train.py").read_text() + "\nUNCOMMITTED = 'cuda'\n")  # not in the run
    edited = (root / "train.py").read_bytes()
    outcome = run_port(root, out_dir=tmp_path / "wt")
    assert outcome.files_written == ["train.py"]
    ported = (tmp_path / "wt" / "train.py").read_text()
    assert "torch.npu.synchronize()" in ported and "UNCOMMITTED" not in ported
    assert (root / "train.py").read_bytes() == edited
    assert (tmp_path / "wt.port-report" / "port-report.md").is_file()


def test_port_to_branch_commits_on_the_port_branch_once(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    root = copy_example("llama_pretrain", tmp_path / "user")
    repo = _git_repo(root)
    head = repo.head.commit.hexsha
    first = port_to_branch(root, "r1", tmp_path / "ws")
    assert first.branch == "trainbridge/r1.port" and first.commit
    assert repo.head.commit.hexsha == head and repo.active_branch.name == "main" and not repo.is_dirty(untracked_files=True)
    commit = repo.commit(first.commit)
    assert commit.parents[0].hexsha == head
    assert sorted(commit.stats.files) == ["train.py"]
    assert "torch.npu.synchronize()" in (commit.tree / "train.py").data_stream.read().decode()
    second = port_to_branch(root, "r1", tmp_path / "ws")
    assert second.commit == first.commit and repo.commit("trainbridge/r1.port").hexsha == first.commit
    assert first.report_md.is_file()


# ---------------------------------------------------------------- the ported program runs


def _steps(output: str) -> list[str]:
    return re.findall(r"^step (\d+) loss (\S+)", output, re.MULTILINE)


@pytest.mark.slow
def test_ported_llama_runs_two_steps_on_the_npu_emulation(tmp_path):
    try:
        from trainbridge.sandbox.npu_emulation import emulation_path
    except ImportError:
        pytest.skip("the torch_npu emulation layer (trainbridge.sandbox.npu_emulation) is not available")
    original = copy_example("llama_pretrain", tmp_path / "original")
    ported = tmp_path / "ported"
    run_port(original, out_dir=ported)
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CUDA_VISIBLE_DEVICES")}
    base.update(OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    # record the device the ported main() picks by itself (the original would pick cpu here)
    probe = ("import torch, torch_npu, train; assert torch_npu.__trainbridge_emulated__; "
             "entry = train.trainbridge_entry; "
             "train.trainbridge_entry = lambda device, seed: (print('DEVICE', device), entry(device, seed))[1]")
    emulated = {**base, "PYTHONPATH": str(emulation_path())}
    runs = {
        "cpu": subprocess.Popen([sys.executable, "train.py", "--steps", "2", "--seed", "3", "--device", "cpu"],
                                cwd=original, env=base, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        "npu": subprocess.Popen([sys.executable, "-c", probe + "; train.main(['--steps', '2', '--seed', '3'])"],
                                cwd=ported, env=emulated, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
    }
    out = {name: proc.communicate(timeout=300)[0] for name, proc in runs.items()}
    assert runs["npu"].returncode == 0, out["npu"][-3000:]
    assert runs["cpu"].returncode == 0, out["cpu"][-3000:]
    assert "DEVICE npu" in out["npu"].splitlines()
    assert [s for s, _ in _steps(out["npu"])] == ["0", "1"]
    # the emulated NPU is the CPU: the ported program computes exactly what the original computes there
    assert _steps(out["npu"]) == _steps(out["cpu"])
