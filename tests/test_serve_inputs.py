"""`genartifact serve` input checks that need no engine start (a stand-in engine whose admission is the real
`VllmEngine.prepare`): `routed_experts_prompt_start` is checked with or without an artifact, two choices may not
name one object, and a client that hangs up mid-body gets no ASGI traceback."""

from __future__ import annotations

import asyncio
import hashlib
import json

import pytest
from genartifact import config as config_mod
from genartifact.engine.server import create_app
from genartifact.engine.vllm_adapter import VllmEngine
from genartifact.types import ModelInfo
from starlette.testclient import TestClient

QWEN = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 512}


class AdmitOnly(VllmEngine):
    """A never-started engine with the real admission (``prepare``); any request that gets past it fails at once."""

    def __init__(self, host):
        super().__init__(host, "/nonexistent")
        self.model_info = ModelInfo(
            name="tiny", hf_config=QWEN, engine_name="vllm", engine_version="0.32.0",
            engine_options={"enable_prefix_caching": False, "worker_capture": True, "worker_rpc": True,
                            "worker_captures": ["moe_routes", "selected_logprobs"], "max_model_len": 256,
                            "logprobs_mode": "raw_logprobs", "device": "cpu"},
            config_sha256=hashlib.sha256(json.dumps(QWEN).encode()).hexdigest())
        self.llm = type("L", (), {"errored": False})()
        self.tokenizer = lambda text: {"input_ids": [1, 2, 3]}
        self.executed = 0

    async def execute(self, prep, stream=True, request_id=None):
        self.executed += 1
        if prep.session is not None:
            prep.session.release()
        raise RuntimeError("stand-in engine: no generation")
        yield

    def shutdown(self):
        pass


@pytest.fixture
def served(tmp_path):
    cfg = config_mod.parse(config_mod.DEFAULT_TOML, source="d", base_dir=tmp_path)
    engine = AdmitOnly(cfg.host())

    async def factory():
        return engine

    app = create_app(factory, cfg, "m", drain_s=1)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield app, client, engine


def artifact(target):
    return {"format": "generation_artifact_v1", "contents": ["selected_logprobs"],
            "delivery": {"mode": "object_store", "target": target}}


@pytest.mark.parametrize("bad", ["abc", -5, 1.5, True, [1], 4])
@pytest.mark.fault("serve", "routed_experts_prompt_start without an artifact")
def test_routes_start_is_checked_without_an_artifact(served, bad):
    _, client, engine = served
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2,
                                             "routed_experts_prompt_start": bad})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "routed_experts_prompt_start" in msg and "allowed: an integer 0..3" in msg
    assert engine.executed == 0


def test_a_valid_routes_start_without_an_artifact_reaches_the_engine(served):
    _, client, engine = served
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2,
                                             "routed_experts_prompt_start": 3})
    assert r.status_code != 400 and engine.executed == 1


@pytest.mark.fault("serve", "two choices naming one object")
def test_two_choices_may_not_name_one_object(served):
    _, client, engine = served
    t = {"kind": "managed_fsspec", "profile": "local", "object_key": "runs/same.gart"}
    r = client.post("/v1/completions", json={"model": "m", "prompt": [1, 2, 3], "max_tokens": 2, "n": 2,
                                             "generation_artifact": artifact([t, dict(t)])})
    assert r.status_code == 400 and "choices 0 and 1 name the same object" in r.json()["error"]["message"], r.text
    assert engine.executed == 0


@pytest.mark.fault("serve", "client hangs up mid-body")
def test_a_client_gone_mid_body_is_answered_quietly(served, caplog):
    app, client, engine = served  # the lifespan is up (TestClient's context); the request goes to the app directly
    sent: list[dict] = []
    msgs = iter([{"type": "http.request", "body": b'{"model": "m", "pro', "more_body": True},
                 {"type": "http.disconnect"}])

    async def receive():
        return next(msgs)

    async def send(m):
        sent.append(m)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 2), "app": app}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
    assert engine.executed == 0
    metrics = client.get("/metrics").text
    assert 'genartifact_requests_total{outcome="rejected",reason="client_disconnected"} 1.0' in metrics
