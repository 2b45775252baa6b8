"""Inductor evidence: capture, parser and packs, on real (captured) and constructed fixtures."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from trainbridge.records import KernelKind, Phase
from trainbridge.tools.evidence_pack import EvidencePackError, read_pack, write_pack
from trainbridge.tools.inductor.format import EvidenceFormatError
from trainbridge.tools.inductor.fx import parse_post_fusion
from trainbridge.tools.inductor.groups import kernel_name_ops
from trainbridge.tools.inductor.output_code import parse_output_code
from trainbridge.tools.inductor.parser import parse_evidence_dir
from trainbridge.tools.inductor.trace import parse_chrome_trace
from trainbridge.tools.repo_paths import RepoPathMapper

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "inductor"
MODELS = FIXTURES / "models"
LLAMA_FILE = "tests/fixtures/inductor/models/tiny_llama.py"
TRITON = FIXTURES / "triton_sample"


def line_of(path: Path, snippet: str) -> int:
    """1-based line of the only line of `path` containing `snippet`."""
    hits = [i for i, text in enumerate(path.read_text().splitlines(), 1) if snippet in text]
    assert len(hits) == 1, f"{snippet!r} found {len(hits)} times in {path}"
    return hits[0]


def lines(group) -> set[int]:
    return {s.line_start for s in group.spans}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> Path:
    return read_pack(FIXTURES / "cpu_llama" / "evidence.tar.gz", tmp_path_factory.mktemp("llama")).evidence_dir


@pytest.fixture(scope="module")
def llama(llama_dir):
    return parse_evidence_dir(llama_dir, REPO)


@pytest.fixture(scope="module")
def graph_break(tmp_path_factory):
    unpacked = read_pack(FIXTURES / "graph_break" / "evidence.tar.gz", tmp_path_factory.mktemp("gb"))
    return parse_evidence_dir(unpacked.evidence_dir, REPO)


@pytest.fixture(scope="module")
def triton():
    return parse_evidence_dir(TRITON / "evidence", TRITON / "repo")


# ---------------------------------------------------------------- real CPU capture (cpu_llama)


def test_rmsnorm_kernel_covers_its_ops_and_maps_to_the_norm_lines(llama):
    model = MODELS / "tiny_llama.py"
    norm_lines = {line_of(model, "variance = x.pow(2).mean(-1, keepdim=True)"),
                  line_of(model, "x = x * torch.rsqrt(variance + self.eps)"),
                  line_of(model, "return self.weight * x")}
    norms = [g for g in llama.groups if g.phase == Phase.forward
             and {"aten.pow", "aten.mean", "aten.add", "aten.rsqrt", "aten.mul"} <= set(g.aten_ops)]
    # 2 layers x 2 norms + the final norm, each one fused kernel (with the residual add / embedding)
    assert len(norms) == 5
    for g in norms:
        assert g.kind == KernelKind.fused
        assert g.kernel.startswith("cpp_fused_") and "rsqrt" in g.kernel
        assert norm_lines <= lines(g)
        assert {s.file for s in g.spans} == {LLAMA_FILE}
    first = norms[0]
    assert "aten.embedding" in first.aten_ops  # the embedding lookup fused into the first norm
    assert line_of(model, "x = self.embed(tokens)") in lines(first)


def test_rotary_and_softmax_are_fused_with_their_source(llama):
    model = MODELS / "tiny_llama.py"
    rotary = [g for g in llama.groups if g.phase == Phase.forward and "aten.neg" in g.aten_ops and "aten.cat" in g.aten_ops]
    assert len(rotary) == 2 and all(g.kind == KernelKind.fused for g in rotary)
    assert {line_of(model, "q_out = q * cos + rotate_half(q) * sin"),
            line_of(model, "return torch.cat((-x2, x1), dim=-1)")} <= lines(rotary[0])
    softmax = [g for g in llama.groups if g.phase == Phase.forward and "aten._softmax" in g.aten_ops]
    assert len(softmax) == 2
    assert line_of(model, "probs = torch.softmax(scores, dim=-1)") in lines(softmax[0])


def test_extern_matmuls_map_to_their_projection_lines(llama):
    model = MODELS / "tiny_llama.py"
    fwd = [g for g in llama.groups if g.graph == "forward_0"]
    mms = [g for g in fwd if g.kernel == "extern_kernels.mm"]
    assert all(g.kind == KernelKind.extern and g.aten_ops == ["aten.mm"] for g in mms)
    # the first three library calls are the q, k, v projections, in this order
    assert [lines(g) for g in mms[:3]] == [{line_of(model, f"{n} = self.w{n}(x).view")} for n in "qkv"]
    bmms = [g for g in fwd if g.kernel == "extern_kernels.bmm"]
    assert len(bmms) == 4 and all(g.aten_ops == ["aten.bmm"] for g in bmms)


def test_backward_graph_is_parsed_with_fused_norm_backward(llama):
    model = MODELS / "tiny_llama.py"
    bwd = [g for g in llama.groups if g.phase == Phase.backward]
    assert bwd and {g.graph for g in bwd} == {"backward_0"}
    assert sum(g.kind == KernelKind.extern for g in bwd) > len(bwd) / 2  # grads are mostly matmuls
    norm_bwd = [g for g in bwd if g.kind == KernelKind.fused and "aten.pow" in g.aten_ops and "aten.sum" in g.aten_ops]
    assert norm_bwd
    assert line_of(model, "variance = x.pow(2).mean(-1, keepdim=True)") in lines(norm_bwd[0])
    silu_bwd = [g for g in bwd if "aten.silu_backward" in g.aten_ops]
    assert len(silu_bwd) == 2 and all(lines(g) == {line_of(model, "return self.w2(F.silu")} for g in silu_bwd)


def test_summary_counts_agree_with_the_ir_and_the_eager_step(llama):
    s = llama.summary
    assert s.torch_version.startswith("2.13")
    by_graph = {g.graph: g for g in s.graphs}
    assert set(by_graph) == {"forward_0", "backward_0"}
    for name, g in by_graph.items():
        groups = [x for x in llama.groups if x.graph == name]
        assert g.kernel_calls == len(groups)
        assert g.span_source == "kernel_stack_traces"
        # one ExternKernelSchedulerNode in ir_post_fusion.txt per library call in output_code.py
        assert g.post_fusion_nodes["ExternKernelSchedulerNode"] == g.calls_by_kind["extern"]
    assert s.kernels_per_step == {"forward": by_graph["forward_0"].kernel_calls,
                                  "backward": by_graph["backward_0"].kernel_calls}
    eager = s.eager_ops_per_step
    assert eager["forward_model"] > s.kernels_per_step["forward"]  # fusion removed launches
    assert eager["backward_model"] > s.kernels_per_step["backward"]
    assert eager["optimizer"] > 0
    assert s.graph_breaks == [] and s.recompiles == []


def test_cpu_trace_times_every_kernel_of_both_graphs(llama):
    assert llama.summary.timed_groups == len(llama.groups)
    assert all(g.time_us is not None and g.time_us > 0 for g in llama.groups)


def test_evidence_from_another_root_maps_by_path_suffix(llama_dir, tmp_path):
    repo = tmp_path / "elsewhere"
    repo.mkdir()
    shutil.copy(MODELS / "tiny_llama.py", repo / "tiny_llama.py")
    parsed = parse_evidence_dir(llama_dir, repo)
    files = {s.file for g in parsed.groups for s in g.spans}
    assert files == {"tiny_llama.py"}
    assert all(g.spans for g in parsed.groups)


def test_source_outside_the_repo_is_dropped(llama_dir, tmp_path):
    parsed = parse_evidence_dir(llama_dir, tmp_path)  # an empty repo: nothing maps
    assert parsed.groups and all(g.spans == [] for g in parsed.groups)
    assert all(g.span_source == "none" for g in parsed.summary.graphs)


# ---------------------------------------------------------------- graph breaks and recompiles


def test_graph_break_is_located_and_both_sides_are_compiled(graph_break):
    model = MODELS / "graph_break_mlp.py"
    s = graph_break.summary
    assert len(s.graph_breaks) == 1
    gb = s.graph_breaks[0]
    assert "Tensor.item()" in gb.reason
    assert gb.span is not None and gb.span.file == "tests/fixtures/inductor/models/graph_break_mlp.py"
    assert gb.span.line_start == line_of(model, "self.last_act_norm = h.norm().item()")
    assert gb.count >= 2  # hit again by the recompilation
    # the graph before the break holds the norm, the one after the residual add
    before = [g for g in graph_break.groups if g.graph == "forward_0"]
    after = [g for g in graph_break.groups if g.graph == "forward_1"]
    assert any("aten.rsqrt" in g.aten_ops for g in before)
    assert any(lines(g) == {line_of(model, "return x + self.down(h)")} and g.kernel.startswith("cpp_fused_add")
               for g in after)


def test_recompilations_are_reported_with_reasons(graph_break):
    s = graph_break.summary
    assert any("size mismatch" in r for r in s.recompiles)
    assert len({g.graph for g in s.graphs if g.phase == Phase.forward}) >= 3
    assert any("recompilations" in n for n in s.notes)
    assert any("identical graphs" in n for n in s.notes)  # recompiled variants share kernels


# ---------------------------------------------------------------- constructed Triton evidence


def test_triton_kernel_names_and_comments_parse(triton):
    fwd = [g for g in triton.groups if g.graph == "forward_0"]
    assert [g.kernel for g in fwd] == ["triton_per_fused_add_mean_mul_pow_rsqrt_0", "extern_kernels.mm",
                                       "extern_kernels.mm", "triton_poi_fused_mul_silu_1", "extern_kernels.mm",
                                       "triton_poi_fused_add_2"]
    assert [g.kind for g in fwd] == [KernelKind.fused, KernelKind.extern, KernelKind.extern, KernelKind.fused,
                                     KernelKind.extern, KernelKind.single]
    assert fwd[0].aten_ops == ["aten.pow", "aten.mean", "aten.add", "aten.rsqrt", "aten.mul"]
    assert fwd[3].aten_ops == ["aten.silu", "aten.mul"]
    assert fwd[4].aten_ops == ["aten.mm"]  # noisy call-site list reduced to the library op
    bwd = [g for g in triton.groups if g.phase == Phase.backward]
    assert {g.kernel for g in bwd if g.kind == KernelKind.fused} == {
        "triton_poi_fused_mul_silu_silu_backward_view_0", "triton_per_fused_add_div_expand_mul_pow_sum_view_1",
        "triton_red_fused_mul_sum_2"}


def test_triton_spans_are_remapped_from_the_gpu_machine(triton):
    model = TRITON / "repo" / "llama" / "model.py"
    fwd = [g for g in triton.groups if g.graph == "forward_0"]
    assert {s.file for g in triton.groups for s in g.spans} == {"llama/model.py"}
    assert lines(fwd[0]) == {line_of(model, "variance = x.pow"), line_of(model, "x = x * torch.rsqrt"),
                             line_of(model, "return self.weight * x")}
    swiglu = line_of(model, "return self.w2(F.silu")
    assert all(lines(g) == {swiglu} for g in fwd[1:5])  # mm, mm, silu*mul, mm
    assert lines(fwd[5]) == {line_of(model, "return x + self.mlp")}
    rms_bwd = next(g for g in triton.groups if g.kernel == "triton_per_fused_add_div_expand_mul_pow_sum_view_1")
    assert fwd[0].spans[0].function == "forward"
    assert {line_of(model, "variance = x.pow"), line_of(model, "return x + self.mlp")} <= lines(rms_bwd)


def test_cuda_trace_times_device_kernels_and_ignores_eager_ops(triton):
    by_kernel = [(g.kernel, g.time_us) for g in triton.groups if g.graph == "forward_0"]
    # Triton kernels: device duration; library mm: the GEMM it launched on the device (not the
    # host op); the eager mm outside the compiled region is not counted anywhere
    assert by_kernel == [("triton_per_fused_add_mean_mul_pow_rsqrt_0", 6.2), ("extern_kernels.mm", 21.5),
                         ("extern_kernels.mm", 20.9), ("triton_poi_fused_mul_silu_1", 9.8),
                         ("extern_kernels.mm", 19.7), ("triton_poi_fused_add_2", 3.1)]
    red = next(g for g in triton.groups if g.kernel == "triton_red_fused_mul_sum_2")
    assert red.time_us == 8.4
    assert triton.summary.timed_groups == len(triton.groups)


def test_triton_post_fusion_node_kinds(triton):
    fwd = next(g for g in triton.summary.graphs if g.graph == "forward_0")
    assert fwd.post_fusion_nodes == {"FusedSchedulerNode": 1, "ExternKernelSchedulerNode": 3, "SchedulerNode": 2}
    assert fwd.span_source == "fx_graph"


# ---------------------------------------------------------------- parser units


def test_older_source_nodes_comment_and_fallback_calls_parse():
    code = parse_output_code(
        "# kernel path: /tmp/x.py\n"
        "# Source Nodes: [relu], Original ATen: [aten.relu, aten.threshold_backward]\n"
        "triton_poi_fused_relu_threshold_backward_0 = async_compile.triton('triton_', '''\n''')\n"
        "def call(args):\n"
        "    with torch.cuda._DeviceGuard(0):\n"
        "        triton_poi_fused_relu_threshold_backward_0.run(buf0, 1024, grid=grid(1024), stream=stream0)\n"
        "        # Topologically Sorted Source Nodes: [conv], Original ATen: [aten.convolution]\n"
        "        buf1 = extern_kernels.convolution(buf0, w, stride=(1, 1))\n"
        "        buf2 = torch.ops.aten.set_.source_Tensor(primals_2, buf1)\n"
        "    return (buf2, )\n")
    assert [(c.name, c.extern) for c in code.calls] == [
        ("triton_poi_fused_relu_threshold_backward_0", False), ("extern_kernels.convolution", True),
        ("aten.set_", True)]
    assert code.calls[0].original_aten == ["aten.relu", "aten.threshold_backward"]
    assert code.calls[1].source_nodes == ["conv"]


def test_post_fusion_skips_nested_nodes():
    text = ("op0_op1: FusedSchedulerNode(SchedulerNode,SchedulerNode)\nop0_op1.snodes[0] =\n"
            "op0: SchedulerNode(ComputedBuffer)\nop0_op1.snodes[1] =\nop1: SchedulerNode(ComputedBuffer)\n"
            "op2: ExternKernelSchedulerNode(ExternKernelOut)\nop3: SchedulerNode(ComputedBuffer)\n")
    assert parse_post_fusion(text) == [("op0_op1", "FusedSchedulerNode"), ("op2", "ExternKernelSchedulerNode"),
                                       ("op3", "SchedulerNode")]


def test_kernel_name_split_uses_the_graph_vocabulary():
    vocab = {"_unsafe_view", "add", "mean", "mul", "pow", "rsqrt", "view"}
    assert kernel_name_ops("cpp_fused__unsafe_view_add_mean_mul_pow_rsqrt_4", vocab) == [
        "aten._unsafe_view", "aten.add", "aten.mean", "aten.mul", "aten.pow", "aten.rsqrt"]
    assert kernel_name_ops("triton_poi_fused_add_gelu_3", vocab) == []  # gelu unknown: no guess


def test_path_mapper_prefers_longest_suffix_and_drops_library_paths(tmp_path):
    (tmp_path / "pkg").mkdir()
    for rel in ("model.py", "pkg/model.py", "functional.py"):
        (tmp_path / rel).write_text("x = 1\n")
    m = RepoPathMapper(tmp_path)
    assert m.map("/home/u/proj/model.py") == "model.py"
    assert m.map("/home/u/proj/pkg/model.py") == "pkg/model.py"
    assert m.map("C:\\Users\\u\\proj\\pkg\\model.py") == "pkg/model.py"
    assert m.map(str(tmp_path / "pkg" / "model.py")) == "pkg/model.py"
    assert m.map("/usr/lib/python3.11/site-packages/torch/nn/functional.py") is None
    assert m.map("/home/u/proj/other.py") is None
    assert m.map("/home/u/../../etc/model.py") == "model.py"


# ---------------------------------------------------------------- packs


def test_pack_round_trip_keeps_files_and_parses_the_same(tmp_path, triton):
    pack = write_pack(TRITON / "evidence", tmp_path / "p" / "triton.tar.gz", repo_root="/home/alice/proj")
    unpacked = read_pack(pack, tmp_path / "out")
    assert unpacked.manifest.repo_root == "/home/alice/proj" and unpacked.manifest.has_trace
    originals = {p.relative_to(TRITON / "evidence").as_posix(): p.read_bytes()
                 for p in (TRITON / "evidence").rglob("*") if p.is_file()}
    copies = {p.relative_to(unpacked.evidence_dir).as_posix(): p.read_bytes()
              for p in unpacked.evidence_dir.rglob("*") if p.is_file()}
    assert copies == originals
    again = parse_evidence_dir(unpacked.evidence_dir, TRITON / "repo")
    assert again.groups == triton.groups


def test_trimmed_pack_leaves_out_what_the_parser_never_reads(tmp_path, llama_dir):
    copy = tmp_path / "ev"
    shutil.copytree(llama_dir, copy)
    extra = next(copy.rglob("output_code.py")).with_name("ir_pre_fusion.txt")
    extra.write_text("not needed\n")
    unpacked = read_pack(write_pack(copy, tmp_path / "t.tar.gz", trim=True), tmp_path / "out")
    assert unpacked.manifest.trimmed
    assert not list(unpacked.evidence_dir.rglob("ir_pre_fusion.txt"))
    assert list(unpacked.evidence_dir.rglob("output_code.py"))


def _tar_with(path: Path, members: list[tarfile.TarInfo], data: bytes = b"x") -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for m in members:
            tar.addfile(m, io.BytesIO(data) if m.isfile() else None)
    return path


@pytest.mark.parametrize("make", [
    lambda: tarfile.TarInfo("../evil.txt"),
    lambda: tarfile.TarInfo("/tmp/evil.txt"),
    lambda: tarfile.TarInfo("evidence/../../evil.txt"),
], ids=["dotdot", "absolute", "nested-dotdot"])
def test_unsafe_member_paths_are_rejected(tmp_path, make):
    info = make()
    info.size = 1
    pack = _tar_with(tmp_path / "bad.tar.gz", [info])
    with pytest.raises(EvidencePackError, match="unsafe member path"):
        read_pack(pack, tmp_path / "out")
    assert not (tmp_path / "evil.txt").exists() and not (tmp_path / "out").exists()


def test_links_are_rejected(tmp_path):
    link = tarfile.TarInfo("evidence/link")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    with pytest.raises(EvidencePackError, match="link or special file"):
        read_pack(_tar_with(tmp_path / "l.tar.gz", [link]), tmp_path / "out")


def test_garbage_and_foreign_archives_give_clear_errors(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_text("this is not an archive")
    with pytest.raises(EvidencePackError, match="not an evidence pack"):
        read_pack(junk, tmp_path / "o1")
    info = tarfile.TarInfo("evidence/a.txt")
    info.size = 1
    with pytest.raises(EvidencePackError, match="no pack.json"):
        read_pack(_tar_with(tmp_path / "nomanifest.tar.gz", [info]), tmp_path / "o2")
    with pytest.raises(EvidencePackError, match="does not exist"):
        read_pack(tmp_path / "missing.tar.gz", tmp_path / "o3")
    with pytest.raises(EvidencePackError, match="holds no output_code.py"):
        write_pack(tmp_path, tmp_path / "x.tar.gz")


def test_damaged_pack_is_detected(tmp_path):
    pack = write_pack(TRITON / "evidence", tmp_path / "ok.tar.gz")
    with tarfile.open(pack) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]
    damaged = tmp_path / "damaged.tar.gz"
    with tarfile.open(damaged, "w:gz") as tar:
        for m, data in members:
            if m.name.endswith("trace.json"):
                data = data.replace(b"6.2", b"9.9")
            tar.addfile(m, io.BytesIO(data))
    with pytest.raises(EvidencePackError, match="damaged"):
        read_pack(damaged, tmp_path / "out")


def test_parser_rejects_folders_and_traces_that_are_not_evidence(tmp_path):
    with pytest.raises(EvidenceFormatError, match="no output_code.py"):
        parse_evidence_dir(tmp_path, REPO)
    with pytest.raises(EvidenceFormatError, match="not a folder"):
        parse_evidence_dir(tmp_path / "nope", REPO)
    bad = tmp_path / "trace.json"
    bad.write_text("{not json")
    with pytest.raises(EvidenceFormatError, match="not a Chrome trace"):
        parse_chrome_trace(bad)
    with pytest.raises(EvidenceFormatError, match="expected a list of events"):
        parse_chrome_trace({"events": []})


# ---------------------------------------------------------------- capture (eager parts, errors)


def test_capture_refuses_bad_parts_and_used_folders(tmp_path):
    from trainbridge.tools.inductor.capture import CaptureError, capture_inductor_evidence

    with pytest.raises(CaptureError, match="missing"):
        capture_inductor_evidence({"model": None}, tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "old.txt").write_text("stale")
    sys.path.insert(0, str(MODELS))
    try:
        import tiny_llama
    finally:
        sys.path.remove(str(MODELS))
    with pytest.raises(CaptureError, match="not empty"):
        capture_inductor_evidence(tiny_llama.make_parts(), tmp_path / "b")


def test_eager_op_count_splits_a_real_step_by_phase():
    from trainbridge.tools.inductor.capture import count_eager_step_ops

    sys.path.insert(0, str(MODELS))
    try:
        import tiny_llama
    finally:
        sys.path.remove(str(MODELS))
    counts = count_eager_step_ops(tiny_llama.make_parts(), step=0)
    per = counts["ops_per_phase"]
    assert per["forward_model"] > 50 and per["backward_model"] > 50 and per["optimizer"] > 0
    assert counts["ops"]["forward_model"]["aten.rsqrt"] == 5  # 5 RMSNorms
    assert "aten.rsqrt" not in counts["ops"]["forward_other"]  # the loss is outside the model
    assert counts["ops"]["forward_other"].get("aten._log_softmax", 0) == 1
    assert counts["view_ops"] > 0


# ---------------------------------------------------------------- end to end (slow)


@pytest.mark.slow
def test_real_capture_end_to_end_in_a_subprocess(tmp_path):
    out = tmp_path / "evidence"
    code = (
        "import sys; from pathlib import Path\n"
        f"sys.path.insert(0, {str(MODELS)!r})\n"
        "import tiny_llama\n"
        "from trainbridge.tools.inductor.capture import capture_inductor_evidence\n"
        f"capture_inductor_evidence(tiny_llama.make_parts(), Path({str(out)!r}), steps=2, repo_root=Path({str(REPO)!r}), "
        "timed_steps=3)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=900, cwd=tmp_path,
                   capture_output=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["graphs"] == ["0_forward", "0_backward"]
    assert manifest["cold_compile_step_s"] > 0 and len(manifest["losses"]) == 2
    # the reference's own speed: three more compiled steps, far quicker than the compiling one
    timed = manifest["compiled_step_wall_s"]
    assert len(timed) == 3 and manifest["compiled_step_s"] == sorted(timed)[1]
    assert 0 < manifest["compiled_step_s"] < manifest["cold_compile_step_s"] / 5
    assert all(f in manifest["files"] for f in ("kernel_stack_traces.json", "dynamo.json", "trace.json"))
    parsed = parse_evidence_dir(out, REPO)
    model = MODELS / "tiny_llama.py"
    norm = next(g for g in parsed.groups if "aten.rsqrt" in g.aten_ops and g.phase == Phase.forward)
    assert line_of(model, "variance = x.pow(2).mean(-1, keepdim=True)") in lines(norm)
    assert {g.phase for g in parsed.groups} == {Phase.forward, Phase.backward}
    assert parsed.summary.timed_groups == len(parsed.groups)
    print(f"cold compile step: {manifest['cold_compile_step_s']} s")
