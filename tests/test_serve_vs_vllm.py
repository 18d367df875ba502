"""`genartifact serve` answers like `vllm serve`: both run on the same tiny model with the same engine
arguments, the same requests go to both at temperature 0, and the responses are compared field by field
(every field genartifact returns in a choice, and usage). Parameters covered: stop (strings and token ids),
include_stop_str_in_output, min_tokens, repetition/presence/frequency penalties, skip_special_tokens,
logprobs (completions) and logprobs/top_logprobs (chat), n > 1 (each choice its own artifact and receipt),
stream_options.include_usage, and stream_options without stream (400 from both)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from genartifact import format as fmt
from genartifact.testing import free_port

pytestmark = [pytest.mark.engine]

ENGINE = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--no-enable-prefix-caching",
          "--served-model-name", "tiny", "--max-num-seqs", "8"]


def wait_healthy(proc: subprocess.Popen, base: str, deadline: float, log) -> None:
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(log.read_text()[-3000:])
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"{base} not healthy in time: " + log.read_text()[-3000:])


def stop(proc: subprocess.Popen) -> None:
    """End a server and every process it started (its own session: API server, engine core, workers)."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
        if sig == signal.SIGTERM:  # the leader is gone; make sure no engine process outlives it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return


@pytest.fixture(scope="module")
def servers(qwen_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("vs")
    cfg = root / "g.toml"
    cfg.write_text(f'[plugins]\ncontents = ["moe_routes", "selected_logprobs"]\ntargets = ["managed_fsspec"]\n'
                   f'[targets.managed_fsspec.profiles.local]\nurl = "{root}/store"\nallowed_prefixes = ["runs/"]\n')
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1"}
    ports = free_port(), free_port()
    cmds = [
        # vLLM's OpenAI server, the one `vllm serve` runs (the `vllm` console script itself fails on vllm-cpu:
        # it looks up the version of a distribution named "vllm", which vllm-cpu is not)
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(qwen_model), "--port",
         str(ports[0]), "--host", "127.0.0.1", *ENGINE],
        [sys.executable, "-m", "genartifact.cli", "serve", "--model", str(qwen_model), "--config", str(cfg), "--port",
         str(ports[1]), *ENGINE],
    ]
    logs = [root / "vllm.log", root / "genartifact.log"]
    procs = [subprocess.Popen(c, stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for c, log in zip(cmds, logs, strict=True)]
    bases = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        deadline = time.time() + 900  # two engines starting at once on a small shared machine
        for proc, base, log in zip(procs, bases, logs, strict=True):
            wait_healthy(proc, base, deadline, log)
        yield {"vllm": bases[0], "ga": bases[1], "root": root}
    finally:
        for proc in procs:
            stop(proc)


def same(ours, theirs, path="") -> None:
    """Every field of ``ours`` equals ``theirs`` (floats to 1e-4: two engine processes)."""
    if isinstance(ours, dict):
        assert isinstance(theirs, dict), path
        for k, v in ours.items():
            assert k in theirs, f"{path}.{k} missing from vllm serve's response"
            same(v, theirs[k], f"{path}.{k}")
    elif isinstance(ours, list):
        assert isinstance(theirs, list) and len(ours) == len(theirs), (path, ours, theirs)
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            same(a, b, f"{path}[{i}]")
    elif isinstance(ours, float) and not isinstance(theirs, bool):
        assert isinstance(theirs, int | float) and math.isclose(ours, theirs, rel_tol=1e-4, abs_tol=1e-4), \
            (path, ours, theirs)
    else:
        assert ours == theirs, (path, ours, theirs)


def both(servers, endpoint: str, body: dict, artifact: dict | None = None) -> tuple[dict, dict]:
    theirs = httpx.post(f"{servers['vllm']}{endpoint}", json=body, timeout=120)
    ours = httpx.post(f"{servers['ga']}{endpoint}", json={**body, **({"generation_artifact": artifact}
                                                                      if artifact else {})}, timeout=120)
    assert theirs.status_code == ours.status_code == 200, (theirs.text, ours.text)
    return ours.json(), theirs.json()


def compare(ours: dict, theirs: dict) -> None:
    assert len(ours["choices"]) == len(theirs["choices"])
    for a, b in zip(ours["choices"], theirs["choices"], strict=True):
        same({k: v for k, v in a.items() if k != "generation_artifact"}, b, "choice")
    same(ours["usage"], theirs["usage"], "usage")
    assert ours["object"] == theirs["object"] and ours["model"] == theirs["model"] == "tiny"


PROMPT = "The quick brown fox jumps over"


def test_completions_parameters_match_vllm_serve(servers):
    base = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    plain, plain_v = both(servers, "/v1/completions", base)
    compare(plain, plain_v)
    text = plain_v["choices"][0]["text"]
    assert len(text) > 6, text
    prompt_ids = httpx.post(f"{servers['vllm']}/tokenize", json={"model": "tiny", "prompt": PROMPT},
                            timeout=120).json()["tokens"]
    ids = httpx.post(f"{servers['ga']}/generate", json={"token_ids": prompt_ids, "sampling_params": {
        "max_tokens": 12, "temperature": 0}}, timeout=120).json()["token_ids"]
    stop_str = text[3:6]
    cases = [
        {"logprobs": 3},
        {"logprobs": 0, "max_tokens": 5},
        {"stop": [stop_str]},
        {"stop": stop_str, "include_stop_str_in_output": True},
        {"stop_token_ids": [ids[4]]},
        {"stop_token_ids": [ids[1]], "min_tokens": 6},
        {"repetition_penalty": 1.5},
        {"presence_penalty": 1.5, "frequency_penalty": 1.0},
        {"skip_special_tokens": False, "logprobs": 1},
        {"n": 2, "logprobs": 2, "temperature": 1.0, "top_k": 1},  # n > 1 is refused for greedy, as in vLLM
    ]
    finishes = []
    for extra in cases:
        ours, theirs = both(servers, "/v1/completions", {**base, **extra})
        compare(ours, theirs)
        finishes.append((ours["choices"][0]["finish_reason"], ours["choices"][0]["stop_reason"]))
    assert finishes[2] == ("stop", stop_str) and finishes[4] == ("stop", ids[4])  # the stops did stop
    assert finishes[5][0] == "length" or finishes[5][1] == ids[1]


def test_n_choices_each_get_their_own_artifact(servers):
    key = f"runs/{uuid.uuid4().hex}-{{choice}}.gart"
    art = {"format": "generation_artifact_v1", "contents": ["moe_routes", "selected_logprobs"],
           "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "local",
                                                           "object_key": key}}}
    ours, theirs = both(servers, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 7,
                                                     "temperature": 1.0, "top_k": 1, "n": 3, "logprobs": 0},
                         artifact=art)
    compare(ours, theirs)
    receipts = [c["generation_artifact"] for c in ours["choices"]]
    assert [r["state"] for r in receipts] == ["ready"] * 3
    assert len({r["object_id"] for r in receipts}) == 3 and "generation_artifact" not in ours
    for c, r in zip(ours["choices"], receipts, strict=True):
        a = fmt.decode((servers["root"] / "store" / r["object_id"].split(":", 1)[1]).read_bytes())
        assert a.manifest["completion_token_count"] == 7
        assert a.selected_logprobs().tolist() == pytest.approx(c["logprobs"]["token_logprobs"], abs=1e-5)
    bad = httpx.post(f"{servers['ga']}/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 3, "n": 2, "generation_artifact": {
            **art, "delivery": {"mode": "object_store", "target": {**art["delivery"]["target"],
                                                                   "object_key": "runs/one.gart"}}}}, timeout=120)
    assert bad.status_code == 400 and "{choice}" in bad.json()["error"]["message"]


def test_chat_logprobs_match_vllm_serve(servers):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8,
            "temperature": 0}
    for extra in ({}, {"logprobs": True, "top_logprobs": 2}, {"logprobs": True},
                  {"n": 2, "stop": ["e"], "temperature": 1.0, "top_k": 1}):
        ours, theirs = both(servers, "/v1/chat/completions", {**body, **extra})
        compare(ours, theirs)


def sse(base: str, endpoint: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{base}{endpoint}", json=body, timeout=120) as r:
        assert r.status_code == 200
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


@pytest.mark.parametrize("endpoint,body", [
    ("/v1/completions", {"prompt": PROMPT, "logprobs": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 2, "temperature": 1.0,
                              "top_k": 1}),
])
def test_streaming_with_include_usage_matches_vllm_serve(servers, endpoint, body):
    body = {"model": "tiny", "max_tokens": 9, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}, **body}
    got = {k: sse(servers[k], endpoint, body) for k in ("ga", "vllm")}
    for k, chunks in got.items():
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9 * body.get("n", 1), k
        assert all(not c.get("usage") for c in chunks[:-1]), k
    same(got["ga"][-1]["usage"], got["vllm"][-1]["usage"])

    def joined(chunks: list[dict]) -> dict:
        out: dict[int, dict] = {}
        for c in chunks[:-1]:
            for ch in c["choices"]:
                o = out.setdefault(ch["index"], {"text": "", "finish": [], "tokens": [], "lps": []})
                o["text"] += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                if ch.get("finish_reason"):
                    o["finish"].append(ch["finish_reason"])
                if ch.get("logprobs") and "tokens" in ch["logprobs"]:
                    o["tokens"] += ch["logprobs"]["tokens"]
                    o["lps"] += ch["logprobs"]["token_logprobs"]
        return out

    same(joined(got["ga"]), joined(got["vllm"]))


def test_stream_options_without_stream_is_400_like_vllm(servers):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream_options": {"include_usage": True}}
    codes = [httpx.post(f"{servers[k]}/v1/completions", json=body, timeout=120).status_code for k in ("ga", "vllm")]
    assert codes == [400, 400]
    bad = httpx.post(f"{servers['ga']}/v1/completions", json={**body, "stream": True, "min_tokens": 9}, timeout=120)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"
    greedy = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "n": 2}
    codes = [httpx.post(f"{servers[k]}/v1/completions", json=greedy, timeout=120).status_code for k in ("ga", "vllm")]
    assert codes == [400, 400]  # vLLM: "n must be 1 when using greedy sampling"
