"""Request spec, admission, capture bounds, finalize, cancellation and the bounded pipeline (no engine)."""

from __future__ import annotations

import asyncio
import uuid

import fsspec
import numpy as np
import pytest
from genartifact import format as fmt
from genartifact.config import DEFAULT_TOML, parse
from genartifact.errors import AdmissionError, ConfigError, RequestSpecError, TargetError, UnknownPluginError
from genartifact.host import PluginHost
from genartifact.session import ERROR_MESSAGES, ArtifactSession
from genartifact.spec import parse_request
from genartifact.types import Delta, ModelInfo
from genartifact_logprobs.answer import worker_answer

QWEN = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
        "decoder_sparse_step": 1, "mlp_only_layers": []}
MODEL = ModelInfo("tiny", QWEN, "vllm", "0.32.0", {"worker_capture": True,
                                                   "worker_captures": ["moe_routes", "selected_logprobs"], "enable_prefix_caching": False,
                                                    "logprobs_mode": "raw_logprobs"})
SETTINGS = {"managed_fsspec": {"profiles": {"mem": {"url": "memory://ga-test", "allowed_prefixes": ["runs/"]},
                                            "tiny": {"url": "memory://ga-tiny", "allowed_prefixes": ["runs/"],
                                                     "max_bytes": 2000}}}}


@pytest.fixture(autouse=True)
def engine_reported_logprobs(monkeypatch):
    """These tests feed logprobs through deltas (the engine-reported source); the worker source is tested
    with a fake worker below and on the real engine in test_engine_e2e."""
    monkeypatch.setenv("GENARTIFACT_LOGPROBS_SOURCE", "engine")


@pytest.fixture(scope="module")
def host():
    return PluginHost({"contents": ["moe_routes", "selected_logprobs"], "targets": ["managed_fsspec"]})


def spec(contents=("selected_logprobs",), profile="mem", key=None, **target):
    t = {"kind": "managed_fsspec", "profile": profile, "object_key": key or f"runs/{uuid.uuid4().hex}.gart", **target}
    return {"format": "generation_artifact_v1", "contents": list(contents), "codec": "zstd",
            "delivery": {"mode": "object_store", "target": t}}


def session(host, s=None, model=MODEL, n=1):
    return ArtifactSession.for_request(host, parse_request(s or spec(), n=n), model, SETTINGS)


class FakeEngine:
    """Stands in for the worker RPC: serves rows for positions [start, end)."""

    def __init__(self, routes: np.ndarray | None, missing=None):
        self.routes, self.missing, self.calls = routes, missing, []

    async def worker_call(self, method, *args):
        self.calls.append((method, args))
        if self.routes is None:
            return [None, {"absent": "unknown", "dp_rank": 0, "tp_rank": 0}]
        _cid, start, end = args
        d = np.ascontiguousarray(self.routes[:, start:end])
        return [None, {"found": {"shape": list(d.shape), "dtype": d.dtype.str, "data": d.tobytes(),
                                 "missing": self.missing}, "dp_rank": 0, "tp_rank": 0}]


def lp(tokens, value=-0.5):
    return [{t: value, t + 1: -9.0} for t in tokens]


async def fails_storing_nothing(s, engine=None):
    """Fault tests: the request's receipt is failed/capture_invalid and nothing was stored at its key."""
    r = await s.finalize(engine)
    assert r["state"] == "failed" and r["error_code"] == "capture_invalid", r
    t = s.request.target
    assert not mem_exists(f"{t['profile']}:{t['object_key']}")
    return r


def mem_exists(object_id):
    profile, key = object_id.split(":", 1)
    root = SETTINGS["managed_fsspec"]["profiles"][profile]["url"]
    return fsspec.filesystem("memory").exists(f"{root.split('://')[1]}/{key}")


# ---------------------------------------------------------------------------------------- happy paths


async def test_logprobs_only_round_trip(host):
    s = session(host)
    s.admit(3, 4, sampling={"temperature": 1.0})
    params = s.sampling_overrides({})
    assert params["logprobs"] == 0
    s.record(Delta([1, 2, 3], [10, 11], lp([10, 11], -0.25)))
    s.record(Delta([1, 2, 3], [12], [{12: -np.inf}], finished=True))
    r = await s.finalize()
    assert r["state"] == "ready" and r["contents"] == ["selected_logprobs"]
    art = fmt.decode(fsspec.open(f"memory://ga-test/{r['object_id'].split(':', 1)[1]}", "rb").open().read())
    assert art.sha256 == r["sha256"] and art.byte_count == r["byte_count"]
    assert art.token_ids.tolist() == [1, 2, 3, 10, 11, 12]
    assert art.selected_logprobs().tolist() == [-0.25, -0.25, -np.inf]
    assert art.manifest["header"]["sampling"]["logprobs_mode"] == "raw_logprobs"
    s.release()


@pytest.mark.parametrize(("reason", "code"), [("abort", "generation_aborted"), ("error", "engine_failed")])
@pytest.mark.fault("engine", "generation cut short (vLLM finish_reason abort / error)")
async def test_a_generation_the_engine_cut_short_stores_nothing(host, reason, code):
    """vLLM ends a request with finish_reason 'abort' (aborted by the engine's owner, or the engine shutting down)
    or 'error': its completion is cut short, so an artifact of it would look like a whole generation. Nothing
    is stored and the receipt says why (found by issue 13's attacker: a shutdown mid-request gave a ready
    receipt for 256 of 1500 tokens)."""
    s = session(host)
    s.admit(3, 8, sampling={"temperature": 1.0})
    s.sampling_overrides({})
    s.record(Delta([1, 2, 3], [10, 11], lp([10, 11])))
    s.record(Delta([1, 2, 3], [12], lp([12]), finished=True, finish_reason=reason))
    r = await s.finalize()
    assert r["state"] == "failed" and r["error_code"] == code and f"'{reason}'" in r["error"], r
    t = s.request.target
    assert not mem_exists(f"{t['profile']}:{t['object_key']}")
    s.release()
    for normal in ("stop", "length", None):  # a whole generation is stored
        s = session(host)
        s.admit(3, 8, sampling={"temperature": 1.0})
        s.sampling_overrides({})
        s.record(Delta([1, 2, 3], [10], lp([10]), finished=True, finish_reason=normal))
        assert (await s.finalize())["state"] == "ready"
        s.release()


@pytest.mark.parametrize("bad", [False, True], ids=["in-range", "id-out-of-range"])
async def test_large_worker_rows_are_range_checked_off_the_event_loop(host, monkeypatch, bad):
    """Worker rows of RANGE_CHECK_THREAD_BYTES or more (a long request's) have their expert ids checked in a
    thread, not on the driver's event loop; an id out of range still fails the artifact (capture_invalid)."""
    import threading

    import genartifact_route_capture as rc

    where = []
    real = rc.MoeRoutes._check_range

    def spy(self, arr):
        where.append(threading.current_thread() is threading.main_thread())
        return real(self, arr)

    monkeypatch.setattr(rc.MoeRoutes, "_check_range", spy)
    monkeypatch.setattr(rc, "RANGE_CHECK_THREAD_BYTES", 32)  # these rows: 4 routers x 6 x 2 = 48 bytes
    s = session(host, spec(["moe_routes"]))
    s.admit(4, 3)
    s.sampling_overrides({})
    s.record(Delta([1, 2, 3, 4], [5, 6, 7], None, finished=True))
    full = (np.arange(4 * 6 * 2) % 8).astype(np.uint8).reshape(4, 6, 2)
    if bad:
        full[3, 5, 1] = 8
    r = await s.finalize(FakeEngine(full))
    assert where == [False]
    assert (r["state"], r.get("error_code")) == (("failed", "capture_invalid") if bad else ("ready", None)), r


async def test_routes_via_worker_path_with_start(host):
    s = session(host, spec(["moe_routes", "selected_logprobs"]))
    s.admit(4, 3, routes_start=2)
    params = s.sampling_overrides({"logprobs": 3})
    assert params["logprobs"] == 3 and "genartifact_capture_id" in params["extra_args"]
    s.record(Delta([1, 2, 3, 4], [5, 6, 7], lp([5, 6, 7]), finished=True))
    full = (np.arange(4 * 6 * 2) % 8).astype(np.uint8).reshape(4, 6, 2)  # positions 0..5 (P + C - 1 = 6)
    eng = FakeEngine(full)
    r = await s.finalize(eng)
    assert r["state"] == "ready", r
    assert eng.calls == [("moe_routes.fetch", (params["extra_args"]["genartifact_capture_id"], 2, 6))]
    art = fmt.decode(fsspec.open(f"memory://ga-test/{r['object_id'].split(':', 1)[1]}", "rb").open().read())
    assert art.routes().shape == (4, 4, 2)
    assert np.array_equal(art.routes(), full[:, 2:].transpose(1, 0, 2))
    assert art.manifest["sections"]["moe_routes"]["token_start"] == 2
    assert art.manifest["sections"]["moe_routes"]["requested_token_start"] == 2  # requested = effective


@pytest.mark.fault("reader", "requested_token_start below token_start or not an integer")
def test_routes_requested_start_is_optional_and_never_below_the_effective_one():
    """requested_token_start (v1 addition): absent in older objects (accepted), an integer >= token_start when
    present (a producer may only clamp down); anything else is an ArtifactFormatError naming the field."""
    from genartifact.errors import ArtifactFormatError
    from genartifact_route_capture import READER

    man = {"prompt_token_count": 4, "completion_token_count": 3}
    base = {"token_start": 2, "router_ids": [0, 1], "expert_counts": [8, 8], "top_k": 2, "layout": "router_major"}
    ids = {"moe_routes.expert_ids": np.zeros((2, 4, 2), np.uint8)}
    READER.validate(man, base, ids)  # an object written before the field existed
    for ok in (2, 3, 10**6):
        READER.validate(man, {**base, "requested_token_start": ok}, ids)
    for bad in (1, 0, -1, "2", 2.0, True, None):
        with pytest.raises(ArtifactFormatError, match="requested_token_start"):
            READER.validate(man, {**base, "requested_token_start": bad}, ids)
    assert READER.summary(man, {**base, "requested_token_start": 3}, ids)["requested_token_start"] == 3


async def test_native_routes_drop_dense_layers_and_narrow_dtype(host):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "first_k_dense_replace": 1}
    model = ModelInfo("ds", cfg, engine_options={"native_routed_experts": True})
    s = session(host, spec(["moe_routes"]), model=model)
    s.admit(3, 2)
    native = np.zeros((4, 3, 2), np.int64)
    native[:, 1:, :] = 7
    s.record(Delta([1, 2, 3], [4], None))
    s.record(Delta([1, 2, 3], [5], None, routed_experts=native, finished=True))
    assert s.retained_bytes() == 4 * 5 + 4 * 2 * 2  # tokens (uint32) + canonical uint8 routes
    r = await s.finalize()
    art = fmt.decode(fsspec.open(f"memory://ga-test/{r['object_id'].split(':', 1)[1]}", "rb").open().read())
    assert art.manifest["sections"]["moe_routes"]["router_ids"] == [1, 2]
    assert art.routes().dtype == np.uint8 and (art.routes() == 7).all()


# ---------------------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda s: s.update(format="generation_artifact_v2"), "format"),
        (lambda s: s.update(codec="gzip"), "codec"),
        (lambda s: s.update(contents=[]), "non-empty"),
        (lambda s: s.update(contents=["moe_routes", "moe_routes"]), "duplicates"),
        (lambda s: s.update(contents=[3]), "content names"),
        (lambda s: s.update(extra=1), "unknown key"),
        (lambda s: s["delivery"].update(mode="inline"), "delivery.mode"),
        (lambda s: s["delivery"].update(target="s3://x"), "target must be an object"),
        (lambda s: s.pop("delivery"), "missing"),
    ],
    ids=["format", "codec", "empty", "dup", "non-str", "extra", "mode", "target", "missing"],
)
@pytest.mark.fault("admission", "artifact spec violations")
def test_spec_rejects(mutate, match):
    s = spec()
    mutate(s)
    with pytest.raises(RequestSpecError, match=match):
        parse_request(s)


def test_n_must_be_one():
    with pytest.raises(RequestSpecError, match="n=1"):
        parse_request(spec(), n=2)


def test_unknown_content_fails_fast_with_suggestion(host):
    with pytest.raises(UnknownPluginError, match="unknown content 'moe_route'.*did you mean 'moe_routes'"):
        session(host, spec(["moe_route"]))


@pytest.mark.fault("admission", "unknown target kind")
def test_unknown_target_kind(host):
    s = spec()
    s["delivery"]["target"] = {"kind": "ftp_upload"}
    with pytest.raises(UnknownPluginError, match="unknown target 'ftp_upload'.*enabled: managed_fsspec"):
        session(host, s)
    s["delivery"]["target"] = {"kind": "presigned_http_put"}
    with pytest.raises(UnknownPluginError, match="installed .*but not enabled; add it to \\[plugins\\].targets"):
        session(host, s)


@pytest.mark.parametrize(
    "target, match",
    [
        ({"profile": "nope"}, "profile 'nope' unknown"),
        ({"key": "../etc/passwd"}, "normalized"),
        ({"key": "/abs/key"}, "relative"),
        ({"key": "runs\\x"}, "backslash"),
        ({"key": "other/x.gart"}, "outside the profile"),
        ({"key": "runs/a//b"}, "normalized"),
        ({"key": "runs/" + "a" * 1100}, "at most 1024"),
        ({"extra_field": 1}, "unknown key"),
    ],
    ids=["profile", "dotdot", "absolute", "backslash", "prefix", "empty-seg", "long", "extra"],
)
@pytest.mark.fault("admission", "invalid managed target")
def test_target_validation_is_specific_and_side_effect_free(host, target, match):
    s = spec(profile=target.pop("profile", "mem"), key=target.pop("key", None), **target)
    sess = session(host, s)
    before = sorted(fsspec.filesystem("memory").find("/"))
    with pytest.raises(TargetError, match=match):
        sess.admit(3, 4)
    assert sorted(fsspec.filesystem("memory").find("/")) == before


@pytest.mark.fault("admission", "worst case over the decoded limit")
def test_admission_rejects_over_decoded_limit(host, monkeypatch):
    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", "9000")
    with pytest.raises(AdmissionError, match="limit 9000 bytes"):
        session(host).admit(100, 200)


def test_decoded_limit_can_only_be_lowered(host, monkeypatch):
    from genartifact.errors import ConfigError as CE

    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", str(128 << 20))
    with pytest.raises(CE, match="GENARTIFACT_MAX_DECODED_BYTES"):
        session(host).admit(3, 4)


@pytest.mark.fault("admission", "worst case over the target's max_bytes")
def test_admission_rejects_over_target_max_bytes(host):
    with pytest.raises(AdmissionError, match="target max_bytes is 2000"):
        session(host, spec(profile="tiny")).admit(10, 10)


def test_admission_worst_case_routes_large_model(host):
    big = {"model_type": "qwen3_moe", "num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8}
    model = ModelInfo("big", big, engine_options={"worker_captures": ["moe_routes"]})
    s = session(host, spec(["moe_routes"]), model=model)
    with pytest.raises(AdmissionError, match="worst-case decoded"):
        s.admit(8192, 200_000)
    s.admit(8192, 32768)  # 48 x 8 x 40959 x 1 B ~ 15.7 MB fits 64 MiB
    assert 48 * 8 * 40959 < s.budget < 64 << 20


@pytest.mark.parametrize("start", [-1, True, 1.5, 4, 10**6, 2**63])
@pytest.mark.fault("admission", "routed_experts_prompt_start out of range")
def test_invalid_routes_start(host, start):
    with pytest.raises(AdmissionError, match="routed_experts_prompt_start"):
        session(host, spec(["moe_routes"])).admit(3, 4, routes_start=start)


@pytest.mark.fault("admission", "moe_routes without a route source")
def test_moe_routes_without_route_source_names_the_setting(host):
    model = ModelInfo("x", QWEN, engine_options={})
    with pytest.raises(AdmissionError, match="enable_return_routed_experts.*vllm.general_plugins"):
        session(host, spec(["moe_routes"]), model=model).admit(3, 4)


@pytest.mark.fault("admission", "prefix caching with worker route capture")
def test_moe_routes_refuses_prefix_caching_on_worker_path(host):
    model = ModelInfo("x", QWEN, engine_options={"worker_captures": ["moe_routes"], "enable_prefix_caching": True})
    with pytest.raises(AdmissionError, match="enable_prefix_caching=False"):
        session(host, spec(["moe_routes"]), model=model).admit(3, 4)


@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"model_type": "llama"}, "no known router layout"),
        ({"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts_per_tok": 2}, "no routed expert count"),
        ({"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 8, "num_experts": 4,
          "num_experts_per_tok": 2}, "conflicting"),
        ({"model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 2, "num_experts_per_tok": 4}, "exceeds"),
        ({"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 8, "num_experts_per_tok": 2,
          "mlp_only_layers": [0, 1]}, "no MoE layer"),
    ],
    ids=["family", "missing", "conflict", "topk", "no-moe"],
)
def test_router_layout_metadata_rejected(host, cfg, match):
    model = ModelInfo("x", cfg, engine_options={"worker_captures": ["moe_routes"]})
    with pytest.raises(AdmissionError, match=match):
        session(host, spec(["moe_routes"]), model=model).admit(3, 4)


@pytest.mark.fault("encoder", "prompt change / completion past max_tokens")
async def test_capture_rejects_prompt_change_and_overlong_completion(host):
    from genartifact.errors import CaptureError

    s = session(host)
    s.admit(3, 2)
    s.sampling_overrides({})
    with pytest.raises(CaptureError, match="admitted 3"):
        s.record(Delta([1, 2], [5], lp([5])))
    s.record(Delta([1, 2, 3], [5], lp([5])))
    with pytest.raises(CaptureError, match="prompt length changed"):
        s.record(Delta([1, 2, 3, 4], [6], lp([6])))
    with pytest.raises(CaptureError, match="admitted max_tokens 2"):
        s.record(Delta([1, 2, 3], [6, 7], lp([6, 7])))
    s.record_or_fail(Delta([1, 2, 3], [6, 7], lp([6, 7]), finished=True))
    await fails_storing_nothing(s)


@pytest.mark.fault("encoder", "sampled token missing from engine logprobs")
async def test_sampled_token_missing_from_engine_logprobs(host):
    from genartifact.errors import CaptureError

    s = session(host)
    s.admit(1, 3)
    s.record(Delta([1], [7], [{99: -0.1, 7: -2.0}]))
    with pytest.raises(CaptureError, match="sampled token 8 missing"):
        s.record(Delta([1], [8], [{99: -0.1, 7: -2.0}]))
    s.record_or_fail(Delta([1], [8], [{99: -0.1, 7: -2.0}], finished=True))
    await fails_storing_nothing(s)
    assert s._producers[0].retained_bytes() == 0  # captured values dropped at the failure


async def test_logprob_lookup_values(host):
    s = session(host)
    s.admit(1, 2)
    s.record(Delta([1], [7, 8], [{99: -0.1, 7: -2.0}, {8: -3.5, 99: -0.2}], finished=True))
    r = await s.finalize()
    art = fmt.decode(fsspec.open(f"memory://ga-test/{r['object_id'].split(':', 1)[1]}", "rb").open().read())
    assert art.selected_logprobs().tolist() == [-2.0, -3.5]


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.fault("encoder", "non-finite engine logprob")
async def test_non_finite_engine_logprob_rejected(host, value):
    from genartifact.errors import CaptureError

    s = session(host)
    s.admit(1, 2)
    with pytest.raises(CaptureError, match="allowed finite or -inf"):
        s.record(Delta([1], [7], [{7: value}]))
    s.record_or_fail(Delta([1], [7], [{7: value}], finished=True))
    await fails_storing_nothing(s)


@pytest.mark.fault("encoder", "worker route rows missing")
async def test_missing_worker_rows_fail_receipt_and_store_nothing(host):
    s = session(host, spec(["moe_routes"]))
    s.admit(4, 3)
    s.sampling_overrides({})
    s.record(Delta([1, 2, 3, 4], [5, 6], None, finished=True))
    full = np.zeros((4, 5, 2), np.uint8)
    r = await s.finalize(FakeEngine(full, missing=[0, 2]))
    assert r == {"format": "generation_artifact_v1", "contents": ["moe_routes"], "state": "failed",
                 "target": "managed_fsspec", "error_code": "capture_invalid", "error": ERROR_MESSAGES["capture_invalid"]}
    key = s.request.target["object_key"]
    assert not mem_exists(f"mem:{key}")


@pytest.mark.fault("encoder", "worker expert id out of range")
async def test_out_of_range_worker_expert_id_fails(host):
    s = session(host, spec(["moe_routes"]))
    s.admit(2, 1)
    s.sampling_overrides({})
    s.record(Delta([1, 2], [3], None, finished=True))
    await fails_storing_nothing(s, FakeEngine(np.full((4, 2, 2), 8, np.uint8)))


@pytest.mark.fault("managed", "second request to the same key")
async def test_second_write_to_same_key_fails_and_keeps_first(host):
    key = f"runs/{uuid.uuid4().hex}.gart"
    receipts = []
    for v in (-0.5, -0.75):
        s = session(host, spec(key=key))
        s.admit(1, 1)
        s.record(Delta([1], [2], [{2: v}], finished=True))
        receipts.append(await s.finalize())
    assert receipts[0]["state"] == "ready"
    assert receipts[1]["state"] == "failed" and receipts[1]["error_code"] == "object_exists"
    data = fsspec.open(f"memory://ga-test/{key}", "rb").open().read()
    assert fmt.decode(data).selected_logprobs().tolist() == [-0.5]


@pytest.mark.fault("generate", "resume meets existing objects (same/other/larger bytes)")
async def test_resume_recognises_an_existing_object_with_the_same_bytes(host, tmp_path):
    """generate --resume without a journal (recover_existing): an object_exists whose stored bytes are exactly
    this run's encoding is ready ("recovered": "rerun_match", journaled as ready); different or larger bytes stay
    object_exists and are never touched; outside a resume a duplicate always fails with object_exists."""
    from genartifact.journal import DeliveryJournal

    j = DeliveryJournal(tmp_path / "j.jsonl")
    key = f"runs/{uuid.uuid4().hex}.gart"
    opened = []

    async def run(recover, value=-0.5, max_tokens=3):
        s = ArtifactSession.for_request(host, parse_request(spec(key=key)), MODEL, SETTINGS, j)
        s.recover_existing = recover
        real_open = s._target.open

        async def spy(object_id, max_bytes):
            opened.append(max_bytes)
            return await real_open(object_id, max_bytes)

        s._target.open = spy
        s.admit(2, max_tokens)
        s.record(Delta([1, 2], [3, 4, 5][:max_tokens], lp([3, 4, 5][:max_tokens], value), finished=True))
        return await s.finalize()

    first = await run(False)
    assert first["state"] == "ready" and "recovered" not in first
    dup = await run(False)  # not a resume: a duplicate fails, the store is not even read
    assert dup["state"] == "failed" and dup["error_code"] == "object_exists" and opened == []
    same = await run(True)
    assert same["state"] == "ready" and same["recovered"] == "rerun_match"
    assert {k: same[k] for k in first} == first  # same object id, SHA-256 and byte count
    assert opened == [first["byte_count"]]  # read back bounded by this run's byte count
    other = await run(True, value=-0.25)  # same length, other bytes
    assert other["state"] == "failed" and other["error_code"] == "object_exists"
    shorter = await run(True, max_tokens=1)  # the stored object is larger than this run's: refused by size
    assert shorter["state"] == "failed" and shorter["error_code"] == "object_exists"
    assert opened[-1] < first["byte_count"]
    data = fsspec.open(f"memory://ga-test/{key}", "rb").open().read()
    import hashlib

    assert hashlib.sha256(data).hexdigest() == first["sha256"]  # the stored object was never replaced
    assert [(d["last_state"], d["last_code"]) for d in j.deliveries()] == [
        ("ready", None), ("failed", "object_exists"), ("ready", None), ("failed", "object_exists"),
        ("failed", "object_exists")]


@pytest.mark.fault("generate", "resume with a target that cannot read back")
async def test_resume_recovery_without_read_back_keeps_object_exists(host):
    """A target that cannot read back (no open(), as presigned grants) recovers nothing: object_exists."""
    key = f"runs/{uuid.uuid4().hex}.gart"
    for recover in (False, True):
        s = session(host, spec(key=key))
        s.recover_existing = recover
        if recover:
            async def no_read_back(object_id, max_bytes):
                raise TargetError("cannot read objects back")

            s._target.open = no_read_back
        s.admit(2, 1)
        s.record(Delta([1, 2], [3], lp([3]), finished=True))
        r = await s.finalize()
    assert r["state"] == "failed" and r["error_code"] == "object_exists"


def test_release_clears_everything(host):
    s = session(host)
    s.admit(2, 2)
    s.record(Delta([1, 2], [3], lp([3])))
    assert s.retained_bytes() > 0
    s.release()
    assert s.retained_bytes() == 0 and s.budget == 0 and s.prompt_token_count == 0
    from genartifact.errors import CaptureError

    with pytest.raises(CaptureError, match="not admitted"):
        s.record(Delta([1, 2], [3], lp([3])))


# ---------------------------------------------------------------------------------------- pipeline


class SlowTarget:
    kind = "managed_fsspec"

    def __init__(self, inner, delay=0.05):
        self.inner, self.delay, self.active, self.peak, self.done = inner, delay, 0, 0, 0

    def validate(self, spec):
        return self.inner.validate(spec)

    async def deliver(self, target, data, sha256):
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            return await self.inner.deliver(target, data, sha256)
        finally:
            self.active -= 1
            self.done += 1


def slow_session(host, slow):
    s = session(host)
    s._target = slow
    s.admit(1, 1)
    s.record(Delta([1], [2], [{2: -1.0}], finished=True))
    return s


@pytest.mark.parametrize("lane", ["large", "small"])
async def test_pipeline_concurrency_bounded_and_cancellation_semantics(host, monkeypatch, lane):
    """Each lane bounds its own operations: the main lane (artifacts whose admitted worst-case encoded size is
    above SMALL_ARTIFACT_BYTES, GENARTIFACT_PIPELINE_CONCURRENCY) and the small lane
    (GENARTIFACT_PIPELINE_SMALL_CONCURRENCY); here both are 2 and the other lane is unused."""
    import genartifact.session as session_mod

    monkeypatch.setenv("GENARTIFACT_PIPELINE_CONCURRENCY", "2" if lane == "large" else "1")
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", "2" if lane == "small" else "1")
    if lane == "large":  # these tiny artifacts count as large
        monkeypatch.setattr(session_mod, "SMALL_ARTIFACT_BYTES", 0)
    host._pipelines.clear()
    host._small_pipelines.clear()
    slow = SlowTarget(session(host)._target, delay=0.1)
    sessions = [slow_session(host, slow) for _ in range(6)]
    tasks = [asyncio.ensure_future(s.finalize()) for s in sessions]
    await asyncio.sleep(0.03)  # two have started (hold slots), four are queued
    for t in tasks:
        t.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    await asyncio.sleep(0.3)
    assert slow.peak == 2
    assert slow.done == 2  # started ones finished in the background, queued ones never started
    sem = host.pipeline(small=lane == "small")
    assert sem._value == 2  # no slot leaked
    assert host.pipeline(small=lane != "small")._value == 1  # the other lane was never taken
    stored = [s for s in sessions if mem_exists(f"mem:{s.request.target['object_key']}")]
    assert len(stored) == 2


def test_config_default_and_errors(tmp_path):
    cfg = parse(DEFAULT_TOML, source="default", base_dir=tmp_path)
    assert cfg.plugins["contents"] == ["moe_routes", "selected_logprobs"]
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['sinks'\] in \[plugins\]"):
        parse("[plugins]\nsinks=[]", source="x", base_dir=tmp_path)
    with pytest.raises(ConfigError, match="lists a name twice"):
        parse("[plugins]\ncontents=['a','a']", source="x", base_dir=tmp_path)
    with pytest.raises(ConfigError, match="invalid TOML"):
        parse("[plugins", source="x", base_dir=tmp_path)


class FakeLogprobWorker:
    def __init__(self, reply):
        self.reply, self.calls = reply, []

    async def worker_call(self, method, *args):
        self.calls.append(method)
        if self.reply is None:
            return [{"absent": "unknown", "dp_rank": 0, "tp_rank": 0}]
        return [{"found": self.reply, "dp_rank": 0, "tp_rank": 0}]


@pytest.mark.parametrize(
    "reply, state",
    [(worker_answer([2, 3], [7, 8], [-0.5, float("-inf")]), "ready"),
     (worker_answer([3, 4], [7, 8], [-0.5, -1.0]), "failed"),
     (worker_answer([2, 3], [7, 9], [-0.5, -1.0]), "failed"),
     (worker_answer([2, 3], [7, 8], [-0.5, float("nan")]), "failed"),
     (None, "failed")],
    ids=["aligned", "positions", "token-mismatch", "nan", "missing"],
)
@pytest.mark.fault("encoder", "worker logprob samples misaligned")
async def test_worker_logprob_source_aligns_by_position_and_token(host, monkeypatch, reply, state):
    monkeypatch.setenv("GENARTIFACT_LOGPROBS_SOURCE", "worker")
    s = session(host)
    s.admit(2, 2)
    params = s.sampling_overrides({})
    assert "genartifact_logprobs_id" in params["extra_args"] and "logprobs" not in params
    s.record(Delta([1, 2], [7, 8], None, finished=True))
    eng = FakeLogprobWorker(reply)
    r = await s.finalize(eng)
    assert r["state"] == state, r
    assert eng.calls == ["selected_logprobs.fetch"]
    if state == "ready":
        art = fmt.decode(fsspec.open(f"memory://ga-test/{r['object_id'].split(':', 1)[1]}", "rb").open().read())
        assert art.selected_logprobs().tolist() == [-0.5, float("-inf")]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.fault("admission", "non-finite sampling value")
def test_non_finite_sampling_values_are_refused_by_name(host, bad):
    with pytest.raises(AdmissionError, match="sampling temperature="):
        session(host, spec()).admit(3, 4, sampling={"temperature": bad})


@pytest.mark.fault("encoder", "non-JSON header values")
def test_encoder_raises_format_error_for_non_json_values():
    from genartifact import format as fmt
    from genartifact.errors import ArtifactFormatError

    for bad in ({"x": float("nan")}, {"x": object()}, {"x": float("inf")}):
        with pytest.raises(ArtifactFormatError, match="canonical JSON"):
            fmt.canonical_json(bad)


def test_admission_counts_token_bytes(host, monkeypatch):
    """A 3,000-token prompt needs 12 KB of uint32 token ids: under a 20,000-byte decoded limit it must be refused
    before inference, not fail after it."""
    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", "20000")
    s = session(host, spec(["selected_logprobs"]))
    with pytest.raises(AdmissionError, match="worst-case decoded"):
        s.admit(3000, 1)
    session(host, spec(["selected_logprobs"])).admit(500, 1)  # 2 KB of tokens fits


@pytest.mark.fault("encoder", "route row count mismatch")
async def test_route_row_count_mismatch_is_capture_invalid(host):
    """Native routes with one row fewer than prompt + completion - 1: the producer's row-count check refuses
    it (capture_invalid, nothing stored), not the encoder."""
    from genartifact.errors import CaptureError
    from genartifact.types import FinalContext

    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "first_k_dense_replace": 1}
    model = ModelInfo("ds", cfg, engine_options={"native_routed_experts": True})
    s = session(host, spec(["moe_routes"]), model=model)
    s.admit(3, 2)
    s.record(Delta([1, 2, 3], [4], None))
    s.record(Delta([1, 2, 3], [5], None, routed_experts=np.zeros((3, 3, 2), np.int64), finished=True))
    producer = s._producers[0]
    with pytest.raises(CaptureError, match="3 rows captured; expected prompt \\+ completion - 1 - start = 4"):
        producer.finalize(FinalContext(3, 2))
    await fails_storing_nothing(s)


def test_worst_case_formula_is_exact(host):
    """docs/receipts.md: 8192 + header JSON + 64 per tensor + 4·(P + max_tokens) + content worst cases."""
    from genartifact import format as fmt
    from genartifact.session import MANIFEST_BASE_BYTES

    s = session(host, spec(["selected_logprobs"]))
    s.admit(10, 7)
    header = len(fmt.canonical_json(s._header))
    tensors = 1 + 2 * 1  # token_ids + per content (tensor + alignment slack)
    assert s.budget == MANIFEST_BASE_BYTES + header + 64 * tensors + 4 * (10 + 7) + (4 * 7 + 128)


def test_worst_case_formula_stays_exact_when_headers_alike_but_not_equal_follow_each_other(host):
    """The header's JSON size is reused from the previous admission only for a header alike in every type:
    temperature 1, 1.0 and True (or 0.0 and -0.0) compare equal in Python but serialize as 1, 1.0 and true (0.0
    and -0.0); each request's budget still holds its own header's exact size."""
    from genartifact import format as fmt
    from genartifact.session import MANIFEST_BASE_BYTES

    for temp in (1, 1.0, True, 1, 0.5, 1.0, 0.0, -0.0, 0.0):  # -0.0 == 0.0, but JSON writes "-0.0"
        s = session(host, spec(["selected_logprobs"]))
        s.admit(10, 7, sampling={"temperature": temp})
        header = len(fmt.canonical_json(s._header))
        assert s.budget == MANIFEST_BASE_BYTES + header + 64 * 3 + 4 * (10 + 7) + (4 * 7 + 128), temp


@pytest.mark.parametrize("prompt, max_tokens, field", [(-1, 4, "prompt_token_count"), (3, 0, "max_tokens"),
                                                       (True, 4, "prompt_token_count"), (3, 2.0, "max_tokens")])
@pytest.mark.fault("admission", "bad token counts")
def test_admission_token_counts_are_checked_by_name(host, prompt, max_tokens, field):
    with pytest.raises(AdmissionError, match=field):
        session(host, spec()).admit(prompt, max_tokens)


async def test_every_delivery_journals_an_outcome(host, tmp_path):
    from genartifact.journal import DeliveryJournal

    j = DeliveryJournal(tmp_path / "j.jsonl")
    key = f"runs/{uuid.uuid4().hex}.gart"
    for _ in range(2):  # ready, then object_exists
        s = ArtifactSession.for_request(host, parse_request(spec(key=key)), MODEL, SETTINGS, j)
        s.admit(2, 1)
        s.record(Delta([1, 2], [3], lp([3]), finished=True))
        await s.finalize()
    assert [(d["last_state"], d["last_code"]) for d in j.deliveries()] == [("ready", None), ("failed", "object_exists")]


@pytest.mark.fault("journal", "an intent that cannot be written (ENOSPC)")
async def test_an_unwritable_intent_fails_delivery_and_stores_nothing(host, tmp_path, monkeypatch, caplog):
    """No durable intent, no upload: the receipt is delivery_failed (not internal_error, which says a plugin broke
    its contract), the object is not written, and the log names the journal."""
    from genartifact.journal import DeliveryJournal

    j = DeliveryJournal(tmp_path / "j.jsonl")

    def full(**_):
        raise OSError(28, "No space left on device")

    writable = j.intent
    monkeypatch.setattr(j, "intent", full)
    key = f"runs/{uuid.uuid4().hex}.gart"
    s = ArtifactSession.for_request(host, parse_request(spec(key=key)), MODEL, SETTINGS, j)
    s.admit(2, 1)
    s.record(Delta([1, 2], [3], lp([3]), finished=True))
    r = await s.finalize()
    assert (r["state"], r["error_code"]) == ("failed", "delivery_failed")
    assert not fsspec.filesystem("memory").exists(f"/ga-test/{key}")
    assert j.deliveries() == []
    monkeypatch.setattr(j, "intent", writable)  # the same request with a writable journal: stored where looked
    s = ArtifactSession.for_request(host, parse_request(spec(key=key)), MODEL, SETTINGS, j)
    s.admit(2, 1)
    s.record(Delta([1, 2], [3], lp([3]), finished=True))
    assert (await s.finalize())["state"] == "ready" and fsspec.filesystem("memory").exists(f"/ga-test/{key}")


@pytest.mark.fault("encoder", "producer retaining over its budget")
def test_retained_bytes_over_budget_fail_the_capture(host):
    """The budget backstop: retained bytes (token ids + every delta-fed producer's) above the session's budget fail
    the capture (capture_invalid) at the delta that crosses it; exactly at the budget is fine."""
    from genartifact.errors import CaptureError

    engine_lp = ModelInfo("tiny", QWEN, "vllm", "0.32.0", {**MODEL.engine_options, "worker_captures": ["moe_routes"]})
    s = session(host, spec(), model=engine_lp)  # engine-sourced logprobs: a producer fed by every delta
    s.admit(2, 3)
    assert s._producers[0].consumes_deltas
    s.budget = 4 * 3 + 4  # after the first delta: tokens 3 x 4 B + one float32 logprob, exactly at the budget
    s.record(Delta([1, 2], [3], lp([3])))
    with pytest.raises(CaptureError, match="exceed the admitted budget"):
        s.record(Delta([1, 2], [4], lp([4])))  # 4 tokens + 2 logprobs: 8 bytes over


def test_documented_manifest_base_and_zero_prompt(host):
    """docs/receipts.md's constants, not the module's: 8192 bytes of manifest base; a prompt of 0 tokens and
    max_tokens 1 are the smallest admissible request."""
    from genartifact import format as fmt

    s = session(host, spec(["selected_logprobs"]))
    s.admit(0, 1)
    assert s.budget == 8192 + len(fmt.canonical_json(s._header)) + 64 * 3 + 4 * 1 + (4 * 1 + 128)


async def test_aclose_discards_unfetched_worker_rows_and_exposes_completion(host):
    s = session(host, spec(["moe_routes"]))
    s.admit(3, 2)
    s.sampling_overrides({})  # the worker path tags the request with its capture id here
    s.record(Delta([1, 2, 3], [4, 5], None))
    assert s.completion_token_ids == [4, 5]
    eng = FakeEngine(None)
    await s.aclose(eng)  # the request ended without finalize (cancelled): its worker rows must be dropped
    assert [m for m, _ in eng.calls] == ["moe_routes.discard"]


# ---------------------------------------------------------------- route and logprob finalize (mutation survivors)


def test_route_admission_bytes_are_exact_with_a_start(host):
    """moe_routes worst case: rows (P + max_tokens - 1 - start) x routers x top_k x itemsize + 32 per router +
    256 (QWEN: 4 routers, top-2, u8)."""
    from genartifact.types import AdmissionContext
    from genartifact_route_capture import MoeRoutes

    p = MoeRoutes(MODEL)
    assert p.admit(AdmissionContext(10, 5, 3, MODEL, {})) == (10 + 5 - 1 - 3) * 4 * 2 * 1 + 32 * 4 + 256
    assert p._max_rows == 11
    assert MoeRoutes(MODEL).admit(AdmissionContext(4, 1, 4, MODEL, {})) == 0 + 32 * 4 + 256  # no rows at all
    # 16 rows x 8 B = 128 shares its bit with 32 x 4 routers, and their sum 256 with the constant
    assert MoeRoutes(MODEL).admit(AdmissionContext(10, 7, 0, MODEL, {})) == 16 * 8 + 32 * 4 + 256 == 512


@pytest.mark.fault("encoder", "native routes: ids far out of range, bad layer axis")
async def test_native_routes_refuse_ids_far_out_of_range_and_bad_layer_axis(host):
    from genartifact.errors import CaptureError

    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 3, "n_routed_experts": 8, "num_experts_per_tok": 2,
           "first_k_dense_replace": 1}
    model = ModelInfo("ds", cfg, engine_options={"native_routed_experts": True})
    for bad, match in ((np.full((4, 3, 2), 200, np.int64), "expert id out of range 0..7"),
                       (np.zeros((4, 3, 3), np.int64), r"expected \[rows, layers, 2\]"),  # top-3 for a top-2 model
                       (np.zeros((4, 3), np.int64), r"expected \[rows, layers, 2\]"),
                       (np.zeros((4, 3, 2, 1), np.int64), r"expected \[rows, layers, 2\]"),
                       (np.full((4, 3, 2), -1, np.int64), "expert id out of range 0..7"),
                       (np.zeros((4, 5, 2), np.int64), "engine layer axis 5 matches neither num_hidden_layers 3")):
        s = session(host, spec(["moe_routes"]), model=model)
        s.admit(3, 2)
        s.record(Delta([1, 2, 3], [4], None))
        with pytest.raises(CaptureError, match=match):
            s._producers[0].on_delta(Delta([1, 2, 3], [5], None, routed_experts=bad, finished=True))
        s.record_or_fail(Delta([1, 2, 3], [5], None, routed_experts=bad, finished=True))
        r = await s.finalize()
        assert r["state"] == "failed" and r["error_code"] == "capture_invalid"


def _routes_section(**kw):
    return {"token_start": 0, "router_ids": [0, 1], "expert_counts": [8, 8], "top_k": 2, "layout": "router_major",
            **kw}


@pytest.mark.parametrize("section, ids, match", [
    (_routes_section(router_ids=(0, 1)), None, "router_ids/expert_counts must list 2 routers"),
    (_routes_section(expert_counts=(8, 8)), None, "router_ids/expert_counts must list 2 routers"),
    (_routes_section(router_ids=[1, 0]), None, "unique, ascending"),
    (_routes_section(router_ids=[0, 0]), None, "unique, ascending"),
    (_routes_section(router_ids=[-1, 0]), None, "unique, ascending"),
    (_routes_section(), np.zeros((2, 3, 2), np.uint16), "dtype must be u8"),
    (_routes_section(expert_counts=[8, 300]), np.zeros((2, 3, 2), np.uint8), "dtype must be u16"),
    (_routes_section(token_start=5), np.zeros((2, 0, 2), np.uint8), "token_start 5 out of range 0..4"),
    (_routes_section(router_ids=[], expert_counts=[]), np.zeros((0, 3, 2), np.uint8), "must list 0 routers"),
    (_routes_section(top_k=2.0), None, "top_k 2.0 != tensor top_k 2"),
    (_routes_section(expert_counts=[8, 70000]), np.zeros((2, 3, 2), np.uint16), "expert_counts must be in 1..65536"),
    (_routes_section(expert_counts=[0, 8]), None, "expert_counts must be in 1..65536"),
    (_routes_section(), np.full((2, 3, 2), 9, np.uint8), "expert id 9 out of range for router 0 with 8 experts"),
    (_routes_section(), np.full((2, 3, 2), 8, np.uint8), "expert id 8 out of range for router 0 with 8 experts"),
    (_routes_section(top_k=3), None, "top_k 3 != tensor top_k 2"),
    (_routes_section(top_k=True), np.zeros((2, 3, 1), np.uint8), "top_k True != tensor top_k 1"),
])
@pytest.mark.fault("reader", "moe_routes section/tensor violations")
def test_routes_reader_refuses(section, ids, match):
    from genartifact.errors import ArtifactFormatError
    from genartifact_route_capture import READER

    man = {"prompt_token_count": 4, "completion_token_count": 0}
    ids = np.zeros((2, 3, 2), np.uint8) if ids is None else ids
    with pytest.raises(ArtifactFormatError, match=match):
        READER.validate(man, section, {"moe_routes.expert_ids": ids})


def test_routes_reader_accepts_the_edges():
    """token_start == P (no prompt rows; with C = 1 no rows at all), one router, ids up to count - 1."""
    from genartifact_route_capture import READER

    READER.validate({"prompt_token_count": 4, "completion_token_count": 1}, _routes_section(token_start=4),
                    {"moe_routes.expert_ids": np.zeros((2, 0, 2), np.uint8)})
    READER.validate({"prompt_token_count": 4, "completion_token_count": 2}, _routes_section(
        router_ids=[3], expert_counts=[8], token_start=4), {"moe_routes.expert_ids": np.full((1, 1, 2), 7, np.uint8)})
    READER.validate({"prompt_token_count": 4, "completion_token_count": 0}, _routes_section(  # the u16 maximum
        router_ids=[0], expert_counts=[65536]), {"moe_routes.expert_ids": np.full((1, 3, 2), 65535, np.uint16)})


def test_prefix_caching_turned_off_with_a_warning_when_on_or_left_to_default():
    import genartifact_route_capture as rc
    from structlog.testing import capture_logs

    for given in (True, None):
        opts = {} if given is None else {"enable_prefix_caching": given}
        with capture_logs() as logs:
            rc.genartifact_engine_options(opts, worker_capture=True)
        assert opts["enable_prefix_caching"] is False
        assert [e["event"] for e in logs] == ["prefix_caching_disabled"] and logs[0]["option"] == "enable_prefix_caching"
    opts = {"enable_prefix_caching": False}
    with capture_logs() as logs:
        rc.genartifact_engine_options(opts, worker_capture=True)
    assert logs == [] and opts == {"enable_prefix_caching": False}
    for opts, wc in (({"enable_prefix_caching": True, "enable_return_routed_experts": True}, True),
                     ({"enable_prefix_caching": True}, False)):  # native routes, or no worker capture: untouched
        rc.genartifact_engine_options(opts, worker_capture=wc)
        assert opts["enable_prefix_caching"] is True


def test_logprob_admission_bytes_are_exact():
    from genartifact.types import AdmissionContext
    from genartifact_logprobs import SelectedLogprobs

    for m in (1, 32, 100):  # 32: 4 * 32 = 128 shares bit 7 with the constant
        assert SelectedLogprobs().admit(AdmissionContext(3, m, 0, MODEL, {})) == 4 * m + 128


async def test_worker_logprobs_fetched_once_discard_after_fetch_is_a_no_op(host, monkeypatch):
    """collect pops the worker's samples: a later discard sends nothing; a request that never reached collect
    discards exactly once; an engine-source producer never calls the worker."""
    from genartifact.errors import CaptureError
    from genartifact.types import FinalContext

    monkeypatch.setenv("GENARTIFACT_LOGPROBS_SOURCE", "worker")
    s = session(host)
    s.admit(2, 2)
    s.sampling_overrides({})
    s.record(Delta([1, 2], [7, 8], None, finished=True))
    eng = FakeLogprobWorker(worker_answer([2, 3], [7, 8], [-0.5, -1.0]))
    assert (await s.finalize(eng))["state"] == "ready"
    await s.aclose(eng)
    assert eng.calls == ["selected_logprobs.fetch"]
    s = session(host)  # cancelled before collect: one discard, idempotent
    s.admit(2, 2)
    s.sampling_overrides({})
    eng = FakeLogprobWorker(None)
    p = s._producers[0]
    await p.discard(eng)
    await p.discard(eng)
    assert eng.calls == ["selected_logprobs.discard"]
    await p.discard(None)  # no engine: nothing to call
    monkeypatch.setenv("GENARTIFACT_LOGPROBS_SOURCE", "engine")
    s = session(host)
    s.admit(2, 2)
    s.sampling_overrides({})
    eng = FakeLogprobWorker(None)
    await s._producers[0].discard(eng)
    assert eng.calls == []
    # the misaligned-positions message names the expected range P..P+C-1
    monkeypatch.setenv("GENARTIFACT_LOGPROBS_SOURCE", "worker")
    s = session(host)
    s.admit(2, 3)
    s.sampling_overrides({})
    p = s._producers[0]
    with pytest.raises(CaptureError, match=r"expected 3 at 2\.\.4$"):
        await p.collect(FinalContext(2, 3, FakeLogprobWorker(
            worker_answer([3, 4, 5], [7, 8, 9], [-0.5, -1.0, -2.0])), [7, 8, 9]))


@pytest.mark.parametrize("values, section, match", [
    ([float("nan"), float("inf")], {"token_start": 300}, r"selected_logprobs\[0\] is nan"),  # the first one named
    (np.asarray([-0.5, -0.25], np.float64), {"token_start": 300}, r"f32 \[2\]"),
    ([-0.5, float("inf")], {"token_start": 300}, r"selected_logprobs\[1\] is inf"),
    ([float("inf"), -0.5], {"token_start": 300}, r"selected_logprobs\[0\] is inf"),
    ([-0.5, -0.25, float("nan")], {"token_start": 300}, r"selected_logprobs\[2\] is nan"),
    ([-0.5, -0.25], {"token_start": 299}, "token_start"),
    ([-0.5, -0.25], {"token_start": 300, "k": 1}, "token_start"),
    ([-0.5, -0.25, -1.0], {"token_start": 300}, r"f32 \[2\]"),
    ([-0.5], {"token_start": 300}, r"f32 \[2\]"),
])
@pytest.mark.fault("reader", "selected_logprobs section/tensor violations")
def test_logprobs_reader_refuses(values, section, match):
    from genartifact.errors import ArtifactFormatError
    from genartifact_logprobs import READER

    man = {"prompt_token_count": 300, "completion_token_count": 2 if len(values) != 3 or "nan" not in match else 3}
    with pytest.raises(ArtifactFormatError, match=match):
        arr = values if isinstance(values, np.ndarray) else np.asarray(values, np.float32)
        READER.validate(man, section, {"selected_logprobs.logprobs": arr})


def test_logprobs_reader_accepts_minus_inf_positive_finite_and_large_prompts():
    from genartifact_logprobs import READER

    p = int("1" + "000")  # a prompt length that is not a cached small int (identity is not equality)
    READER.validate({"prompt_token_count": p, "completion_token_count": 3}, {"token_start": int(str(p))},
                    {"selected_logprobs.logprobs": np.asarray([-np.inf, 0.0, 1e-7], np.float32)})


def test_logprobs_worker_capture_only_for_raw_logprobs(monkeypatch):
    import types

    import genartifact_logprobs as gl
    import genartifact_logprobs.worker as glw

    monkeypatch.setattr(glw, "LogprobCapture", lambda worker: ("capture", worker))
    for mode, served in (("".join(["raw_", "logprobs"]), True), ("processed_logprobs", False), ("raw_logits", False)):
        worker = types.SimpleNamespace(vllm_config=types.SimpleNamespace(
            model_config=types.SimpleNamespace(logprobs_mode=mode)))
        got = gl.genartifact_worker_capture(worker=worker, settings={})
        assert (got == ("capture", worker)) is served, mode


def test_logprobs_finalize_with_no_completion_tokens_is_an_empty_tensor():
    from genartifact.types import AdmissionContext, FinalContext
    from genartifact_logprobs import SelectedLogprobs

    p = SelectedLogprobs()
    p.admit(AdmissionContext(3, 2, 0, MODEL, {}))
    section, parts = p.finalize(FinalContext(3, 0))
    assert section == {"token_start": 3}
    assert [(t.name, t.array.dtype, t.array.shape) for t in parts] == [("selected_logprobs.logprobs", np.float32, (0,))]
