"""The two pipeline lanes (PluginHost.pipeline(small=...)) under hostile paths: cancellation with the session
released, target faults of every kind, the size boundary, bad environment values, and the server's slot
accounting and drain over both lanes."""

from __future__ import annotations

import asyncio
import types
import uuid

import genartifact.session as session_mod
import pytest
from genartifact.engine.server import Metrics, Server
from genartifact.errors import ConfigError, DeliveryError, PluginFault
from genartifact.host import PluginHost
from genartifact.limits import SMALL_ARTIFACT_BYTES, pipeline_concurrency, small_pipeline_concurrency
from genartifact.session import ArtifactSession
from genartifact.spec import parse_request
from genartifact.types import Delta, ModelInfo

MODEL = ModelInfo("tiny", {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8,
                           "num_experts_per_tok": 2, "decoder_sparse_step": 1, "mlp_only_layers": []},
                  "vllm", "0.32.0", {"worker_capture": True, "worker_captures": ["moe_routes", "selected_logprobs"],
                                     "enable_prefix_caching": False, "logprobs_mode": "raw_logprobs"})
ROOT = f"ga-lanes-{uuid.uuid4().hex}"
SETTINGS = {"managed_fsspec": {"profiles": {"mem": {"url": f"memory://{ROOT}", "allowed_prefixes": ["runs/"]}}}}


@pytest.fixture(autouse=True)
def engine_reported_logprobs(monkeypatch):
    monkeypatch.setenv("GENARTIFACT_LOGPROBS_SOURCE", "engine")


@pytest.fixture
def host(monkeypatch):
    monkeypatch.setenv("GENARTIFACT_PIPELINE_CONCURRENCY", "2")
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", "3")
    return PluginHost({"contents": ["selected_logprobs"], "targets": ["managed_fsspec"]})


def new_session(host, target=None):
    spec = {"format": "generation_artifact_v1", "contents": ["selected_logprobs"], "codec": "zstd",
            "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "mem",
                                                            "object_key": f"runs/{uuid.uuid4().hex}.gart"}}}
    s = ArtifactSession.for_request(host, parse_request(spec), MODEL, SETTINGS)
    if target is not None:
        s._target = target
    s.admit(1, 1)
    s.record(Delta([1], [2], [{2: -1.0}], finished=True))
    return s


def stored(s):
    import fsspec

    return fsspec.filesystem("memory").exists(f"/{ROOT}/{s.request.target['object_key']}")


def free(host):
    return host.pipeline()._value, host.pipeline(small=True)._value


class Abort(BaseException):
    """A BaseException that is not KeyboardInterrupt/SystemExit (those stop the event loop itself)."""


class Wrapping:
    """A target that wraps the session's own and can delay or fail its deliveries."""

    kind = "managed_fsspec"

    def __init__(self, inner, delay=0.0, fail=None):
        self.inner, self.delay, self.fail = inner, delay, fail

    def validate(self, spec):
        return self.inner.validate(spec)

    async def deliver(self, target, data, sha256):
        await asyncio.sleep(self.delay)
        if self.fail is not None:
            raise self.fail
        return await self.inner.deliver(target, data, sha256)


@pytest.mark.parametrize("lane", ["small", "large"])
@pytest.mark.fault("pipeline", "finalize cancelled and session released while its operation encodes in a thread")
async def test_cancelled_finalize_of_a_started_operation_still_stores_after_release(host, monkeypatch, lane):
    """The caller of finalize is cancelled once the operation started (its encode is in a thread) and releases the
    session, as ``aclose`` does: the operation keeps running in the background against its admitted budget and
    stores the object (it must not read the released session's budget of 0 and fail as over budget), and its
    slot comes back."""
    monkeypatch.setattr(session_mod, "INLINE_ENCODE_BYTES", 0)  # every encode goes to a thread
    if lane == "large":
        monkeypatch.setattr(session_mod, "SMALL_ARTIFACT_BYTES", 0)
    s = new_session(host)
    task = asyncio.ensure_future(s.finalize())
    for _ in range(3):
        await asyncio.sleep(0)
    assert free(host) == ((1, 3) if lane == "large" else (2, 2))  # started: the slot is held
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    s.release()
    for _ in range(100):
        if free(host) == (2, 3):
            break
        await asyncio.sleep(0.01)
    assert free(host) == (2, 3)
    assert stored(s)


@pytest.mark.fault("pipeline", "session released while its finalize waits for a pipeline slot")
async def test_session_released_while_waiting_for_a_slot_leaks_no_slot(host):
    """Every small slot is taken; a finalize waits for one and its session is released meanwhile (a concurrent
    teardown). When it gets the slot its operation fails (internal_error) instead of raising before its
    ``finally``, and the slot comes back."""
    slow = Wrapping(new_session(host)._target, delay=0.05)
    holders = [new_session(host, slow) for _ in range(3)]
    waiting = new_session(host)
    running = [asyncio.ensure_future(h.finalize()) for h in holders]
    await asyncio.sleep(0.01)
    assert free(host) == (2, 0)
    task = asyncio.ensure_future(waiting.finalize())
    await asyncio.sleep(0.01)
    waiting.release()
    assert [r["state"] for r in await asyncio.gather(*running)] == ["ready"] * 3
    r = await asyncio.wait_for(task, 2)
    assert r["state"] == "failed" and r["error_code"] == "internal_error"
    await asyncio.sleep(0.01)
    assert free(host) == (2, 3)


@pytest.mark.parametrize("lane", ["small", "large"])
@pytest.mark.parametrize("fail", [DeliveryError("x", "delivery_failed"), RuntimeError("bug"),
                                  PluginFault("target bug"), asyncio.CancelledError(), Abort()],
                         ids=["delivery_error", "runtime_error", "plugin_fault", "cancelled", "base_exception"])
@pytest.mark.fault("pipeline", "target raising inside a pipeline lane")
async def test_target_failures_of_every_kind_return_the_lanes_slot(host, monkeypatch, lane, fail):
    """A target that raises anything (a DeliveryError, a bug, a PluginFault, CancelledError, even a
    BaseException) during delivery: the lane's slot is released, the other lane is untouched."""
    if lane == "large":
        monkeypatch.setattr(session_mod, "SMALL_ARTIFACT_BYTES", 0)
    s = new_session(host)
    s._target = Wrapping(s._target, fail=fail)
    try:
        await s.finalize()
    except BaseException:  # noqa: BLE001, S110 - what reaches the caller is not under test; the slots are
        pass
    await asyncio.sleep(0)
    assert free(host) == (2, 3)


@pytest.mark.parametrize("delta, small", [(0, True), (-1, False)])
async def test_lane_boundary_is_inclusive(host, monkeypatch, delta, small):
    """An artifact whose admitted worst-case encoded size is exactly SMALL_ARTIFACT_BYTES takes the small lane;
    one byte over, the main lane."""
    s = new_session(host, Wrapping(new_session(host)._target, delay=0.05))
    monkeypatch.setattr(session_mod, "SMALL_ARTIFACT_BYTES", s.encoded_bound + delta)
    task = asyncio.ensure_future(s.finalize())
    await asyncio.sleep(0.01)
    assert free(host) == ((2, 2) if small else (1, 3))
    assert (await task)["state"] == "ready"
    assert free(host) == (2, 3)
    assert SMALL_ARTIFACT_BYTES == 1 << 20


async def test_both_lanes_stay_bounded_under_a_wave(host):
    """A wave of 20 small and 20 large finalizes: never more than each lane's bound run at once."""
    active, peak = {"small": 0, "large": 0}, {"small": 0, "large": 0}

    class Counting(Wrapping):
        async def deliver(self, target, data, sha256):
            lane = "small" if self.small else "large"
            active[lane] += 1
            peak[lane] = max(peak[lane], active[lane])
            try:
                await asyncio.sleep(0.005)
                return await self.inner.deliver(target, data, sha256)
            finally:
                active[lane] -= 1

    sessions = []
    for i in range(40):
        t = Counting(new_session(host)._target)
        t.small = i % 2 == 0
        s = new_session(host, t)
        if not t.small:
            s.encoded_bound = SMALL_ARTIFACT_BYTES + 1  # counts as large
        sessions.append(s)
    out = await asyncio.gather(*(s.finalize() for s in sessions))
    assert all(r["state"] == "ready" for r in out)
    assert peak == {"small": 3, "large": 2}
    assert free(host) == (2, 3)


@pytest.mark.parametrize("raw, match", [("0", "out of range; allowed: 1..1024"), ("1025", "out of range"),
                                        ("-3", "out of range"), ("abc", "is not an integer; allowed: 1..1024"),
                                        ("2.5", "is not an integer"), ("1e3", "is not an integer")])
@pytest.mark.fault("pipeline", "bad GENARTIFACT_PIPELINE_SMALL_CONCURRENCY")
def test_small_lane_env_values_are_validated_by_name(monkeypatch, raw, match):
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", raw)
    with pytest.raises(ConfigError, match=match) as e:
        small_pipeline_concurrency()
    assert "GENARTIFACT_PIPELINE_SMALL_CONCURRENCY" in str(e.value)
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", " ")
    assert small_pipeline_concurrency() == 32
    monkeypatch.delenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY")
    assert small_pipeline_concurrency() == 32 and pipeline_concurrency() == 2


@pytest.mark.fault("pipeline", "bad small-lane concurrency at the first small artifact")
async def test_bad_small_lane_env_at_first_use_is_a_config_error_not_a_slot(monkeypatch):
    """Without the CLI's upfront check, a bad small-lane value surfaces as the ConfigError naming the variable
    when the lane is first made (no half-made lane is cached: fixing the value lets the next one through)."""
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", "zero")
    host = PluginHost({"contents": ["selected_logprobs"], "targets": ["managed_fsspec"]})
    with pytest.raises(ConfigError, match="GENARTIFACT_PIPELINE_SMALL_CONCURRENCY"):
        host.pipeline(small=True)
    monkeypatch.setenv("GENARTIFACT_PIPELINE_SMALL_CONCURRENCY", "4")
    assert host.pipeline(small=True)._value == 4


def fake_server(host, drain_s=0.2):
    srv = Server.__new__(Server)
    srv.engine = types.SimpleNamespace(host=host)
    srv.metrics = Metrics()
    srv.drain_s = drain_s
    srv.capacity = pipeline_concurrency() + small_pipeline_concurrency()
    return srv


async def test_server_slots_and_drain_count_both_lanes(host):
    """The server's capacity is both lanes together; used slots and drain see a delivery in either lane, and
    drain returns 0 once both lanes are free."""
    srv = fake_server(host)
    assert srv.capacity == 5 and srv._free_slots() == 5
    slow = Wrapping(new_session(host)._target, delay=0.1)
    small = new_session(host, slow)
    large = new_session(host, slow)
    large.encoded_bound = SMALL_ARTIFACT_BYTES + 1
    tasks = [asyncio.ensure_future(small.finalize()), asyncio.ensure_future(large.finalize())]
    await asyncio.sleep(0.01)
    srv._sample_slots()
    assert srv.metrics.slots._value.get() == 2
    assert await srv.drain() == 0  # both finish within drain_s
    assert [r["state"] for r in await asyncio.gather(*tasks)] == ["ready", "ready"]
    srv.drain_s = 0.05
    stuck = new_session(host, Wrapping(slow.inner, delay=0.2))
    t = asyncio.ensure_future(stuck.finalize())
    await asyncio.sleep(0.01)
    assert await srv.drain() == 1  # abandoned: a small-lane delivery still running
    assert (await t)["state"] == "ready" and srv._free_slots() == 5
