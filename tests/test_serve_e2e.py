"""`genartifact serve` on loopback with the real engine: the official openai client and httpx, receipts that
verify and decode, admission errors before any engine work, streaming, load, metrics, graceful shutdown."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import httpx
import numpy as np
import psutil
import pytest
from genartifact import format as fmt
from genartifact.testing import free_port

pytestmark = [pytest.mark.engine]


@pytest.fixture(scope="module")
def server(qwen_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    cfg = root / "genartifact.toml"
    cfg.write_text(f"""
[plugins]
contents = ["moe_routes", "selected_logprobs", "top_logprobs", "moe_route_weights"]
targets = ["managed_fsspec"]
[targets.managed_fsspec.profiles.local]
url = "{root}/store"
allowed_prefixes = ["runs/"]
[targets.managed_fsspec.profiles.tiny]
url = "{root}/tiny"
allowed_prefixes = ["runs/"]
max_bytes = 3000
[journal]
path = "{root}/journal.jsonl"
""")
    port = free_port()
    env = {**os.environ, "GENARTIFACT_PIPELINE_CONCURRENCY": "2", "GENARTIFACT_PIPELINE_SMALL_CONCURRENCY": "2"}
    proc = subprocess.Popen([sys.executable, "-m", "genartifact.cli", "serve", "--model", str(qwen_model), "--config",
                             str(cfg), "--port", str(port), "--served-model-name", "tiny", "--drain-s", "10",
                             "--max_model_len", "2k", "--max-num-seqs", "8"],  # vLLM engine arguments, as vllm serve
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        proc.kill()
        raise RuntimeError(proc.stdout.read().decode()[-3000:])
    # /metrics: the frozen start-up heap, and the process's collections by generation (standard python_gc_* names)
    frozen = metrics({"base": base})["genartifact_gc_frozen_objects"]
    assert re.search(r'^python_gc_collections_total\{generation="2"\} ', httpx.get(f"{base}/metrics").text, re.M)
    yield {"base": base, "root": root, "proc": proc, "frozen": int(frozen)}
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def artifact(profile="local", contents=("moe_routes", "selected_logprobs")):
    return {"format": "generation_artifact_v1", "contents": list(contents),
            "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": profile,
                                                            "object_key": f"runs/{uuid.uuid4().hex}.gart"}}}


def read(server, receipt, tokens=None) -> fmt.Artifact:
    assert receipt["state"] == "ready", receipt
    data = (server["root"] / "store" / receipt["object_id"].split(":", 1)[1]).read_bytes()
    art = fmt.decode(data)
    assert art.sha256 == receipt["sha256"] and art.byte_count == receipt["byte_count"]
    if tokens is not None:
        assert art.completion_token_ids.tolist() == tokens
    if "moe_routes" in art.contents:
        start = art.manifest["sections"]["moe_routes"]["token_start"]
        assert art.routes().shape[0] == art.token_ids.size - 1 - start
    return art


def metrics(server) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{server['base']}/metrics").text.splitlines():
        if line.startswith("genartifact_") and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_openai_completions_and_chat(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server['base']}/v1", api_key="none")
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=8,
                                  extra_body={"generation_artifact": artifact()})
    receipt = r.model_extra["generation_artifact"]
    art = read(server, receipt)
    assert r.usage.completion_tokens == art.manifest["completion_token_count"] == 8
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=6, stream=True,
                                       extra_body={"generation_artifact": artifact()})
    chunks = list(stream)
    finals = [c.model_extra.get("generation_artifact") for c in chunks]
    assert all(f is None for f in finals[:-1]) and finals[-1] is not None  # receipt on the final chunk only
    read(server, finals[-1])
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                       extra_body={"generation_artifact": artifact()})
    assert c.choices[0].message.role == "assistant"
    read(server, c.model_extra["generation_artifact"])
    s = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                       stream=True, extra_body={"generation_artifact": artifact(contents=["moe_routes"])})
    chunks = list(s)
    assert chunks[-1].model_extra["generation_artifact"]["state"] == "ready"
    plain = client.completions.create(model="tiny", prompt="hello", max_tokens=3)
    assert "generation_artifact" not in (plain.model_extra or {})
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.list().data[0].model_extra["max_model_len"] == 2000  # "2k", parsed as vllm serve does


def test_openai_logprobs_fields_map_to_top_logprobs(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server['base']}/v1", api_key="none")
    want = ["selected_logprobs", "top_logprobs"]
    r = client.completions.create(model="tiny", prompt="The quick brown fox", max_tokens=6, logprobs=3,
                                  extra_body={"generation_artifact": artifact(contents=want)})
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"generation_artifact": artifact(contents=want)})
    for resp, k in ((r, 3), (c, 2)):
        art = read(server, resp.model_extra["generation_artifact"])
        ids, lps = art.content("top_logprobs")
        n = art.manifest["completion_token_count"]
        assert art.manifest["sections"]["top_logprobs"]["k"] == k and ids.shape == lps.shape == (n, k)
        sel, comp = art.selected_logprobs(), art.completion_token_ids
        for i in range(n):  # the sampled token is either one of the top k (same value) or below all of them
            row = ids[i].tolist()
            assert sel[i] == lps[i][row.index(comp[i])] if comp[i] in row else sel[i] <= lps[i][-1]
    # the response carries them too, in OpenAI's shapes (as vLLM), with or without a top_logprobs artifact
    assert len(r.choices[0].logprobs.top_logprobs) == 6 and len(c.choices[0].logprobs.content[0].top_logprobs) == 2
    plain = httpx.post(f"{server['base']}/v1/completions", json={"model": "tiny", "prompt": "x", "logprobs": 2,
                                                                "max_tokens": 3, "generation_artifact": artifact()},
                       timeout=60).json()
    assert len(plain["choices"][0]["logprobs"]["token_logprobs"]) == 3
    assert plain["generation_artifact"]["state"] == "ready"
    bad = httpx.post(f"{server['base']}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True,
        "generation_artifact": artifact(contents=want)}, timeout=30)
    assert bad.status_code == 400 and "for a top_logprobs artifact" in bad.text


def test_generate_token_ids_and_logprobs_align_with_artifact(server):
    r = httpx.post(f"{server['base']}/generate", json={"token_ids": [5, 6, 7, 8, 9], "sampling_params": {
        "max_tokens": 6, "temperature": 1.0, "routed_experts_prompt_start": 2}, "generation_artifact": artifact()},
        timeout=60).json()
    art = read(server, r["generation_artifact"], tokens=None)
    assert art.token_ids.tolist() == [5, 6, 7, 8, 9] + r["token_ids"]
    assert art.selected_logprobs().tolist() == pytest.approx(r["logprobs"], abs=0)
    assert art.manifest["sections"]["moe_routes"]["token_start"] == 2 and art.routes().shape[0] == 5 + 6 - 1 - 2


def test_route_weights_through_the_artifact_field(server):
    """moe_route_weights asked for in the request's artifact field (completions streamed, chat, /generate with
    routed_experts_prompt_start): weights aligned 1:1 with the routes and equal to HF's router (fp32, 1e-5 as
    in tests/test_route_weights_engine.py)."""
    from genartifact_route_capture import replay_check as rc

    from conftest import tiny_model

    want = ["moe_routes", "moe_route_weights"]
    base = server["base"]
    s = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": "The ocean is deep", "max_tokens": 7,
                                                  "stream": True, "generation_artifact": artifact(contents=want)},
                   timeout=60)
    finals = [json.loads(x[6:]) for x in s.text.splitlines() if x.startswith("data: {")]
    c = httpx.post(f"{base}/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 5,
        "generation_artifact": artifact(contents=want)}, timeout=60).json()
    g = httpx.post(f"{base}/generate", json={"token_ids": [5, 6, 7, 8, 9, 10], "sampling_params": {
        "max_tokens": 6, "temperature": 1.0, "routed_experts_prompt_start": 3},
        "generation_artifact": artifact(contents=want)}, timeout=60).json()
    oracle = rc.HFOracle(tiny_model("qwen3_moe"))
    for receipt in (finals[-1]["generation_artifact"], c["generation_artifact"], g["generation_artifact"]):
        art = read(server, receipt)
        assert art.contents == ["moe_route_weights", "moe_routes"]
        w = art.content("moe_route_weights")
        assert w.shape == art.routes().shape and np.abs(w.sum(-1) - 1).max() < 1e-5
        rep = rc.compare(art, oracle)
        assert not rc.verdict(rep, 0.99, 0.05, 1e-5), rep
    assert art.manifest["sections"]["moe_route_weights"]["token_start"] == 3 and w.shape[0] == 6 + 6 - 1 - 3


@pytest.mark.parametrize(
    "body, status, match",
    [
        ({"prompt": "x", "generation_artifact": "nope"}, 400, "generation_artifact must be a JSON object"),
        ({"prompt": "x", "generation_artifact": {**artifact(), "contents": ["moe_route"]}}, 400, "did you mean 'moe_routes'"),
        ({"prompt": "x", "max_tokens": 1500, "generation_artifact": artifact(profile="tiny")}, 400, "max_bytes is 3000"),
        ({"prompt": "x", "n": 2, "generation_artifact": artifact()}, 400, "needs one target per choice"),
        ({"prompt": "x", "generation_artifact": {**artifact(), "delivery": {"mode": "object_store", "target": {
            "kind": "managed_fsspec", "profile": "local", "object_key": "../escape"}}}}, 400, "normalized"),
        ({"prompt": "x", "max_tokens": "8"}, 400, "max_tokens"),
        ({"prompt": "x", "seed": 3}, 400, "per-request seeds"),
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": [5, 512]}, 400, "token id out of range"),
        ({"prompt": [5, 2**64]}, 400, "token id out of range"),
        ({"prompt": "x", "echo": True}, 400, "unsupported parameter(s) ['echo']"),
        ({"prompt": "x", "logprobs": 21}, 400, "logprobs=21 invalid"),
        ({"prompt": "x", "n": True}, 400, "n=True unsupported"),
        ({"prompt": "x" * 70_000}, 400, "cannot fit max_model_len"),
        ({"prompt": "x", "n": 17}, 400, "n=17 unsupported"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options can only be defined"),
        ({"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty=3 invalid"),
        ({"prompt": "x", "stop": [""]}, 400, "stop invalid"),
    ],
    ids=["malformed", "unknown-content", "over-budget", "n2", "bad-target", "max-tokens-type", "seed", "empty",
         "oov", "oov-huge", "echo", "logprobs", "n-bool", "long-text", "n17", "stream-options", "penalty",
         "empty-stop"],
)
@pytest.mark.fault("serve", "bad request bodies")
def test_bad_requests_are_4xx_without_engine_work(server, body, status, match):
    before = metrics(server)["genartifact_engine_requests_total"]
    r = httpx.post(f"{server['base']}/v1/completions", json=body, timeout=30)
    assert r.status_code == status and match in r.json()["error"]["message"], r.text
    assert metrics(server)["genartifact_engine_requests_total"] == before


@pytest.mark.fault("serve", "hostile request bodies")
def test_hostile_bodies_are_4xx_and_the_engine_survives(server):
    base = server["base"]
    before = metrics(server)["genartifact_engine_requests_total"]
    r = httpx.post(f"{base}/generate", json={"token_ids": [5, 512], "sampling_params": {"max_tokens": 2}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" or "token id" in r.text
    big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
    r = httpx.post(f"{base}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 413
    r = httpx.post(f"{base}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, timeout=30)
    assert r.status_code == 400 and "nested" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", content=b'{"prompt": "\\ud800abc"}', timeout=30)
    assert r.status_code == 400 and "surrogate" in r.json()["error"]["message"]
    assert metrics(server)["genartifact_engine_requests_total"] == before
    assert httpx.get(f"{base}/health").json() == {"status": "ok"}
    ok = httpx.post(f"{base}/v1/completions", json={"prompt": "still alive", "max_tokens": 2, "stream": None,
                                                    "generation_artifact": {**artifact(), "delivery": {
                                                        "mode": "object_store", "target": {
                                                            "kind": "managed-fsspec", "profile": "local",
                                                            "object_key": f"runs/{uuid.uuid4().hex}"}}}}, timeout=60)
    assert ok.status_code == 200 and ok.json()["generation_artifact"]["state"] == "ready"


def test_error_param_names_the_field(server):
    cases = [({"prompt": "x", "max_tokens": "8"}, "max_tokens"), ({"prompt": "x", "temperature": -1}, "temperature"),
             ({"prompt": "x", "stream": 3}, "stream"), ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
             ({"prompt": "x", "generation_artifact": {**artifact(), "contents": ["nope"]}}, "generation_artifact")]
    for body, param in cases:
        r = httpx.post(f"{server['base']}/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.json())


@pytest.mark.fault("serve", "delivery failure during a completion")
def test_delivery_failure_never_fails_the_completion(server):
    a = artifact()
    httpx.post(f"{server['base']}/v1/completions", json={"prompt": "x", "max_tokens": 2, "generation_artifact": a},
               timeout=30).raise_for_status()
    r = httpx.post(f"{server['base']}/v1/completions", json={"prompt": "x", "max_tokens": 2, "generation_artifact": a},
                   timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
    assert r.json()["generation_artifact"]["error_code"] == "object_exists"


@pytest.mark.fault("serve", "client disconnect mid-stream")
def test_client_disconnect_mid_stream_leaks_nothing(server):
    async def go():
        async with httpx.AsyncClient(base_url=server["base"], timeout=30) as c:
            async with c.stream("POST", "/v1/completions", json={"prompt": "x", "max_tokens": 500, "stream": True,
                                                                 "generation_artifact": artifact()}) as resp:
                async for _ in resp.aiter_lines():
                    break  # hang up after the first chunk
    asyncio.run(go())
    deadline = time.time() + 10
    while time.time() < deadline and metrics(server)["genartifact_inflight_requests"] > 0:
        time.sleep(0.2)
    m = metrics(server)
    assert m["genartifact_inflight_requests"] == 0 and m["genartifact_pipeline_slots_in_use"] == 0


@pytest.mark.fault("serve", "client disconnect, non-streaming")
def test_client_disconnect_non_streaming_aborts_and_stores_nothing(server):
    """Issue 10 case 4: a non-streaming client that hangs up mid-generation aborts its request (same rules as
    streaming): nothing is stored at its key, no slot or capture is held."""
    art = artifact()
    key = art["delivery"]["target"]["object_key"]
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server['base']}/v1/completions", json={"prompt": "x", "max_tokens": 1900, "ignore_eos": True,
                                                             "generation_artifact": art}, timeout=httpx.Timeout(5, read=0.5))
    deadline = time.time() + 20
    while time.time() < deadline and metrics(server)["genartifact_inflight_requests"] > 0:
        time.sleep(0.2)
    m = metrics(server)
    assert m["genartifact_inflight_requests"] == 0 and m["genartifact_pipeline_slots_in_use"] == 0
    time.sleep(1.0)
    assert not (server["root"] / "store" / key).exists()  # aborted before any upload
    assert m.get('genartifact_requests_total{outcome="client_disconnected",reason=""}', 0) > \
        before.get('genartifact_requests_total{outcome="client_disconnected",reason=""}', 0)


def test_32_concurrent_streaming_clients(server):
    proc = psutil.Process(server["proc"].pid)
    before = metrics(server)
    rss0 = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])

    async def one(c, i):
        receipt, n = None, 0
        async with c.stream("POST", "/v1/completions", json={"prompt": f"prompt number {i}", "max_tokens": 24,
                                                             "stream": True, "generation_artifact": artifact()}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
                    receipt = json.loads(line[6:]).get("generation_artifact") or receipt
        return receipt

    async def go():
        async with httpx.AsyncClient(base_url=server["base"], timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(32)))

    receipts = asyncio.run(go())
    rss1 = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)])
    for r in receipts:
        read(server, r)
    m = metrics(server)
    assert m["genartifact_pipeline_slots_in_use_peak"] <= 2  # these artifacts are small: the small lane's 2
    ready = 'genartifact_artifacts_total{error_code="",state="ready"}'
    assert m[ready] - before.get(ready, 0) == 32  # (a labelled series exists from its first count on)
    assert m["genartifact_engine_requests_total"] - before["genartifact_engine_requests_total"] == 32
    # each artifact's finalize (last token -> receipt) observed once, in seconds (bench_serve reads this histogram)
    fin = m["genartifact_finalize_seconds_count"] - before.get("genartifact_finalize_seconds_count", 0)
    assert fin == 32
    assert 0 < (m["genartifact_finalize_seconds_sum"] - before.get("genartifact_finalize_seconds_sum", 0)) / fin < 30
    assert m['genartifact_requests_total{outcome="admitted",reason=""}'] - \
        before.get('genartifact_requests_total{outcome="admitted",reason=""}', 0) == 32
    print(f"server RSS (all processes) before {rss0 / 1e6:.0f} MB, after 32 streams {rss1 / 1e6:.0f} MB")
    assert rss1 - rss0 < 300e6


@pytest.mark.fault("serve", "SIGTERM while serving")
def test_sigterm_drains_and_exits(server):
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    # uvicorn finishes its graceful shutdown, then re-raises the captured SIGTERM (exit status -15)
    assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
    out = proc.stdout.read().decode()
    assert "serve_shutdown" in out and "abandoned_deliveries=0" in out
    # the start-up heap was frozen once the engine started (no 0.3-0.6 s full-heap GC pauses while serving)
    frozen = re.search(r"serve_heap_frozen\s+objects=(\d+)", out)
    assert frozen and int(frozen.group(1)) == server["frozen"] > 100_000, out[-3000:]
