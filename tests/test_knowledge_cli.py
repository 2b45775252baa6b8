"""The knowledge base from outside: the `trainbridge kb` CLI, and a real `chroma run` server on a
loopback port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request

import pytest
import yaml

from trainbridge.agents.retrieval.rank import rank_recipes
from trainbridge.knowledge.schema import Recipe
from trainbridge.knowledge.store import SEED_DIR, KnowledgeBase, KnowledgeBaseError
from trainbridge.tests.knowledge_support import (  # noqa: F401 (fixtures)
    CHROMA,
    OWN_SEEDS,
    RMSNORM_EVIDENCE,
    free_port,
    intent,
    invoke,
    outcome,
    seed_recipe,
    seeds,
)


# --------------------------------------------------------------------------------------------
# CLI


def test_cli_commands(tmp_path):
    kbdir = str(tmp_path / "kb")
    listed = invoke("list", "--kb-dir", kbdir, "--target", "npu")
    assert listed.exit_code == 0, listed.output
    assert "rmsnorm-npu-rms-norm" in listed.output and "rmsnorm-f-rms-norm" not in listed.output

    shown = invoke("show", "rmsnorm-npu-rms-norm", "--kb-dir", kbdir)
    assert shown.exit_code == 0 and "npu_rms_norm" in shown.output and "pitfall: Returns (y, rstd)" in shown.output
    as_json = invoke("show", "gelu-tanh-functional", "--json", "-", "--kb-dir", kbdir)
    assert Recipe.model_validate_json(as_json.output).id == "gelu-tanh-functional"
    missing = invoke("show", "nope", "--kb-dir", kbdir)
    assert missing.exit_code == 1 and "no recipe 'nope'" in missing.output

    found = invoke("search", "cpp_fused_add_mul_pow_tanh_0", "-n", "3", "--kb-dir", kbdir)
    assert found.exit_code == 0 and "gelu-tanh-functional" in found.output

    data = seed_recipe("gelu-tanh-functional")
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump({**data, "id": "gelu-mine", "provenance": {"kind": "learned"}}))
    added = invoke("add", str(tmp_path / "mine.yaml"), "--kb-dir", kbdir)
    assert added.exit_code == 0 and "added gelu-mine" in added.output
    assert "updated gelu-mine" in invoke("add", str(tmp_path / "mine.yaml"), "--kb-dir", kbdir).output
    data["numerics"]["rtol"] = "loose"
    (tmp_path / "rmsnorm.yaml").write_text(yaml.safe_dump(data))
    rejected = invoke("add", str(tmp_path / "rmsnorm.yaml"), "--kb-dir", kbdir)
    assert rejected.exit_code == 2 and "rmsnorm.yaml: numerics.rtol: Input should be a valid number" in rejected.output

    exported = invoke("export", str(tmp_path / "kb.jsonl"), "--kb-dir", kbdir)
    n_seeds = len(list(SEED_DIR.glob("*.yaml")))
    assert exported.exit_code == 0 and f"exported {n_seeds + 1} recipe(s)" in exported.output
    imported = invoke("import", str(tmp_path / "kb.jsonl"), "--kb-dir", str(tmp_path / "other"))
    assert imported.exit_code == 0 and "imported 1 recipe(s) and 0 outcome(s)" in imported.output

    stats = invoke("stats", "--json", "-", "--kb-dir", str(tmp_path / "other"))
    assert json.loads(stats.output)["recipes"] == n_seeds + 1
    table = invoke("stats", "--kb-dir", kbdir)
    assert table.exit_code == 0 and "category rmsnorm" in table.output

    both = invoke("list", "--kb-dir", kbdir, "--kb-url", "http://127.0.0.1:1")
    assert both.exit_code == 2 and "not both" in both.output
    bad_target = invoke("list", "--kb-dir", kbdir, "--target", "tpu")
    assert bad_target.exit_code == 2
    helped = invoke("--help")
    assert helped.exit_code == 0 and all(c in helped.output for c in ("list", "show", "search", "add", "import", "export", "stats"))


def test_cli_bad_import_file_and_url_from_environment(tmp_path, monkeypatch):
    kbdir = str(tmp_path / "kb")
    (tmp_path / "bad.jsonl").write_text("not json\n")
    bad = invoke("import", str(tmp_path / "bad.jsonl"), "--kb-dir", kbdir)
    assert bad.exit_code == 2 and "bad.jsonl:1: not JSON" in bad.output
    dead = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("TRAINBRIDGE_KB_URL", dead)
    assert invoke("stats", "--kb-dir", kbdir).exit_code == 0  # an explicit --kb-dir wins
    from_env = invoke("stats")
    assert from_env.exit_code == 1 and f"cannot reach the Chroma server at {dead}" in from_env.output


def test_a_damaged_knowledge_base_is_named_with_what_to_do(tmp_path):
    """Issue 27: a corrupt knowledge-base folder gave a 130-line traceback."""
    kbdir = tmp_path / "kb"
    kbdir.mkdir()
    (kbdir / "chroma.sqlite3").write_text("not a database\n")
    damaged = invoke("list", "--kb-dir", str(kbdir))
    assert damaged.exit_code == 1 and "Traceback" not in damaged.output
    assert f"the knowledge base at {kbdir} cannot be opened" in damaged.output and "Move the folder aside" in damaged.output


# --------------------------------------------------------------------------------------------
# a real Chroma server


@pytest.fixture
def chroma_server(tmp_path):
    port = free_port()
    log = (tmp_path / "chroma.log").open("wb")
    proc = subprocess.Popen(
        [str(CHROMA), "run", "--path", str(tmp_path / "server"), "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/v2/heartbeat", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"chroma server did not start: {(tmp_path / 'chroma.log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_knowledge_base_on_a_real_chroma_server(chroma_server, tmp_path, seeds):
    with KnowledgeBase.connect(chroma_server, seed_dir=seeds) as kb:
        assert kb.location == chroma_server
        assert len(kb.list_recipes()) == len(OWN_SEEDS)
        kb.record_outcome(outcome("rmsnorm-npu-rms-norm", "accepted", ratio=0.75))
        assert rank_recipes(kb, intent("rmsnorm", RMSNORM_EVIDENCE), "npu")[0].recipe.id == "rmsnorm-npu-rms-norm"
        kb.export_jsonl(tmp_path / "server.jsonl")
    with KnowledgeBase.connect(chroma_server) as again:  # a second client sees the same data
        assert again.get_recipe("rmsnorm-npu-rms-norm").stats.best_ratio == 0.75
        assert again.import_jsonl(tmp_path / "server.jsonl").outcomes_added == 0
    listed = invoke("list", "--kb-url", chroma_server, "--category", "rmsnorm")
    assert listed.exit_code == 0 and "1/1/0" in listed.output


def test_connect_to_a_dead_server_says_what_to_do():
    with pytest.raises(KnowledgeBaseError, match=r"cannot reach the Chroma server at .*chroma run --path DIR"):
        KnowledgeBase.connect(f"http://127.0.0.1:{free_port()}")
    with pytest.raises(KnowledgeBaseError, match="must look like http://host:port"):
        KnowledgeBase.connect("ftp://host:1")
    failed = invoke("stats", "--kb-url", f"http://127.0.0.1:{free_port()}")
    assert failed.exit_code == 1 and "cannot reach the Chroma server" in failed.output
