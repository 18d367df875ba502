"""The plugin-author kit holds its own reference target to the conformance bar, and the suites catch broken
plugins (a suite that cannot fail proves nothing)."""

from __future__ import annotations

import numpy as np
import pytest
from genartifact.errors import DeliveryError, PluginFault
from genartifact.testing import MemoryTarget, deltas, make_host, run_session
from genartifact.testing.conformance import ContentConformance, TargetConformance


class TestMemoryTargetConformance(TargetConformance):
    def make_target(self):
        return MemoryTarget(max_bytes=4096)

    def target_spec(self, key):
        return {"kind": "memory", "object_key": key}

    def small_target_spec(self, key):
        return self.target_spec(key)

    def bad_specs(self):
        return [({"kind": "memory"}, "object_key"), ({"kind": "memory", "object_key": "k", "x": 1}, "unknown key")]


class Overwriting(MemoryTarget):
    async def deliver(self, target, data, sha256):
        self.objects[target.object_id] = bytes(data)  # not create-only
        return target.object_id


class NoLimit(MemoryTarget):
    async def deliver(self, target, data, sha256):
        self.objects[target.object_id] = bytes(data)  # writes, then complains: not all-or-nothing
        if len(data) > self.max_bytes:
            raise DeliveryError("too big", "too_large")
        return target.object_id


@pytest.mark.parametrize("cls, test", [(Overwriting, "test_create_only_second_write_fails_and_keeps_the_first"),
                                       (NoLimit, "test_too_large_refused_before_writing")])
def test_target_suite_catches_broken_targets(cls, test):
    class Suite(TestMemoryTargetConformance):
        def make_target(self):
            return cls(max_bytes=4096)

    with pytest.raises((AssertionError, pytest.fail.Exception)):
        getattr(Suite(), test)()


class Echo:
    """Stores each completion token id once more (u32 [C])."""

    def __init__(self, name):
        self.name, self.vals, self.max_tokens = name, [], 0

    def admit(self, ctx):
        self.max_tokens = ctx.max_tokens
        return 4 * ctx.max_tokens + 64  # u32 per token + the manifest section

    def sampling_overrides(self, params):
        pass

    def on_delta(self, delta):
        from genartifact.errors import CaptureError

        if len(self.vals) + len(delta.new_token_ids) > self.max_tokens:  # its own bound, not only the session's
            raise CaptureError(f"echo: more than the admitted {self.max_tokens} tokens")
        self.vals.extend(delta.new_token_ids)

    async def collect(self, final):
        pass

    def finalize(self, final):
        from genartifact.format import TensorPart

        return {}, [TensorPart(f"{self.name}.values", np.asarray(self.vals, "<u4"))]

    def retained_bytes(self):
        return 4 * len(self.vals)

    def release(self):
        self.vals = []


class StrictReader:
    def validate(self, manifest, section, tensors):
        from genartifact.errors import ArtifactFormatError

        v = tensors.get("echo.values")
        if v is None or v.shape != (manifest["completion_token_count"],):
            raise ArtifactFormatError("echo.values must be u32 [C]")

    def summary(self, manifest, section, tensors):
        return {"n": int(tensors["echo.values"].size)}


class LooseReader(StrictReader):
    def validate(self, manifest, section, tensors):
        pass  # accepts anything: not aligned to the tokens


class UnboundedEcho(Echo):
    def on_delta(self, delta):
        self.vals.extend(delta.new_token_ids)  # relies on the session's max_tokens check alone


class OnePerDeltaEcho(Echo):
    def on_delta(self, delta):
        if delta.new_token_ids:
            self.vals.append(delta.new_token_ids[0])  # assumes one token per delta: drops the rest of a merged one


def echo_plugin(reader, producer=Echo):
    from genartifact.testing import hookimpl

    class Plugin:
        @hookimpl
        def genartifact_content_producer(self, name, model):
            return producer(name) if name == "echo" else None

        @hookimpl
        def genartifact_content_reader(self, name):
            return reader if name == "echo" else None

    return Plugin()


class TestEchoConformance(ContentConformance):
    content = "echo"

    def make_host(self):
        return make_host(contents={"echo": echo_plugin(StrictReader())})


def test_content_suite_catches_a_content_ignoring_alignment():
    class Suite(ContentConformance):
        content = "echo"

        def make_host(self):
            return make_host(contents={"echo": echo_plugin(LooseReader())})

    Suite().test_strict_decode_round_trip()  # a loose reader still round-trips...
    with pytest.raises(pytest.fail.Exception):  # ...but the alignment check catches it
        Suite().test_token_alignment_is_enforced_by_the_reader()


def test_content_suite_catches_a_content_without_its_own_token_bound():
    """A producer that keeps a few bytes per token and relies on the session's ``max_tokens`` check alone passed the
    bound check while it was fed only four times the completion (its section's slack absorbed the excess); fed past
    its admitted bytes it is caught."""

    class Suite(ContentConformance):
        content = "echo"

        def make_host(self):
            return make_host(contents={"echo": echo_plugin(StrictReader(), UnboundedEcho)})

    with pytest.raises((AssertionError, PluginFault)):
        Suite().test_recording_past_max_tokens_is_bounded()
    TestEchoConformance().test_recording_past_max_tokens_is_bounded()  # the bounded one passes


def test_content_suite_catches_a_content_assuming_one_token_per_delta():
    """vLLM's DELTA output merges the tokens of several steps when the driver's loop falls behind: a producer that
    keeps one value per delta passes with one-token deltas and is caught by the several-tokens case."""

    class Suite(ContentConformance):
        content = "echo"

        def make_host(self):
            return make_host(contents={"echo": echo_plugin(StrictReader(), OnePerDeltaEcho)})

    Suite().test_strict_decode_round_trip()  # one token per delta: looks fine
    with pytest.raises(pytest.fail.Exception, match="deltas of \\[1, 2, 3, 3\\] tokens"):
        Suite().test_deltas_of_several_tokens_round_trip()
    TestEchoConformance().test_deltas_of_several_tokens_round_trip()  # a content counting tokens passes


def test_deltas_builder_shapes():
    ds = deltas([1, 2], [3, 4, 5], logprobs=[-1.0, -2.0, -3.0], start_ns=100, step_ns=10)
    assert [d.new_token_ids for d in ds] == [[3], [4], [5]]
    assert [d.arrival_ns for d in ds] == [100, 110, 120] and [d.finished for d in ds] == [False, False, True]
    assert ds[-1].finish_reason == "length" and ds[0].finish_reason is None
    assert ds[1].new_logprobs == [{4: -2.0}]
    final = deltas([1], [2, 3], per_step=False)
    assert len(final) == 1 and final[0].new_token_ids == [2, 3] and final[0].finished
    merged = deltas([1], [2, 3, 4, 5], logprobs=[-1.0, -2.0, -3.0, -4.0], sizes=[1, 3])
    assert [d.new_token_ids for d in merged] == [[2], [3, 4, 5]] and [d.finished for d in merged] == [False, True]
    assert merged[1].new_logprobs == [{3: -2.0}, {4: -3.0}, {5: -4.0}]
    for bad in ([1, 2], [0, 4], [4, 0], [True, 3], [2.0, 2]):
        with pytest.raises(ValueError, match="sizes"):
            deltas([1], [2, 3, 4, 5], sizes=bad)


def test_run_session_reads_back_through_the_target():
    res = run_session(make_host(contents={"echo": echo_plugin(StrictReader())}), ["echo"], [1, 2], [7, 8, 9])
    assert res.receipt["state"] == "ready" and res.data is not None
    assert np.array_equal(res.artifact.tensors["echo.values"], [7, 8, 9])
    assert res.artifact.summary() == {"echo": {"n": 3}}


@pytest.mark.fault("kit", "test ports taken from the ephemeral range (released, then taken by an outbound connection)")
def test_free_port_is_outside_the_ephemeral_range_and_free(monkeypatch, tmp_path):
    """``free_port`` picks listener ports outside the host's ephemeral range (an ephemeral port released before its
    listener binds it can go to any outbound connection: the intermittent 'Address already in use' of concurrent
    engine runs), ``count`` consecutive and ``span`` apart, each free when returned."""
    import socket

    import genartifact.testing as kit

    lo, hi = kit._ephemeral_range()
    for _ in range(50):
        p = kit.free_port(count=2, span=100)
        for q in (p, p + 1, p + 100, p + 101):
            assert not lo <= q <= hi and 10000 <= q <= 65535
            with socket.socket() as s:
                s.bind(("127.0.0.1", q))  # free now
    monkeypatch.setattr(kit, "_ephemeral_range", lambda: (10050, 65000))
    picks = [kit.free_port() for _ in range(40)]
    assert all(10000 <= q < 10050 or q > 65000 for q in picks), picks
    monkeypatch.setattr(kit, "_ephemeral_range", lambda: (10000, 65535))
    with pytest.raises(RuntimeError, match="no room outside the ephemeral range"):
        kit.free_port()
    with pytest.raises(ValueError, match="count must be >= 1"):
        kit.free_port(count=0)


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path):
    import genartifact.testing as kit

    f = tmp_path / "r"
    f.write_text("40000\t50000\n")
    assert kit._ephemeral_range(str(f)) == (40000, 50000)
    assert kit._ephemeral_range(str(tmp_path / "absent")) == kit._EPHEMERAL_DEFAULT
