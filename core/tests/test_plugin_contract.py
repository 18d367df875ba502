"""The host's contract with plugins: config order is run order for every hook, load-time checks, and fault
isolation (a plugin's exception or bad return value is that request's ``internal_error``, named in the log)."""

from __future__ import annotations

import asyncio
import textwrap
import threading
import types

import numpy as np
import pytest
import structlog
from genartifact import format as fmt
from genartifact import session as session_mod
from genartifact.errors import PluginFault, PluginLoadError
from genartifact.format import TensorPart
from genartifact.host import PluginHost, redact
from genartifact.journal import DeliveryJournal
from genartifact.testing import MemoryTarget, hookimpl, make_host, run_session


class Echo:
    """A minimal well-behaved content: one u32 per completion token (the token id itself)."""

    def __init__(self, name="echo", fail=None, bad=None):
        self.name, self.fail, self.bad = name, fail, bad
        self.vals: list[int] = []
        self.max = 0

    def _maybe(self, method):
        if self.fail == method:
            raise RuntimeError(f"{method} exploded; token=abc123 url=https://h.example/x?X-Amz-Signature=deadbeef")

    def admit(self, ctx):
        self._maybe("admit")
        self.max = ctx.max_tokens
        return "lots" if self.bad == "admit" else 4 * ctx.max_tokens + 2  # u32 [C] + its section "{}"

    def sampling_overrides(self, params):
        self._maybe("sampling_overrides")

    def on_delta(self, delta):
        self._maybe("on_delta")
        self.vals.extend(delta.new_token_ids)

    async def collect(self, final):
        self._maybe("collect")

    def finalize(self, final):
        self._maybe("finalize")
        if self.bad == "finalize_type":
            return {"n": 1}
        if self.bad == "finalize_name":
            return {}, [TensorPart("other.values", np.zeros(1, "<u4"))]
        if self.bad == "finalize_big":
            return {}, [TensorPart(f"{self.name}.values", np.zeros(10_000, "<u4"))]
        return {}, [TensorPart(f"{self.name}.values", np.asarray(self.vals, "<u4"))]

    def retained_bytes(self):
        self._maybe("retained_bytes")
        return -1 if self.bad == "retained" else 4 * len(self.vals)

    def release(self):
        self._maybe("release")
        self.vals = []


class EchoReader:
    def validate(self, manifest, section, tensors):
        from genartifact.errors import ArtifactFormatError

        v = tensors.get("echo.values")
        if v is None or v.shape != (manifest["completion_token_count"],):
            raise ArtifactFormatError("echo.values must be u32 [C]")

    def summary(self, manifest, section, tensors):
        return {"n": int(tensors["echo.values"].size)}


def _plugin(make, reader=EchoReader):
    """A content plugin serving ``echo``: the producer ``make(name)`` and a ``reader()`` (an :class:`EchoReader`)."""
    class Plugin:
        @hookimpl
        def genartifact_content_producer(self, name, model):
            return make(name) if name == "echo" else None

        @hookimpl
        def genartifact_content_reader(self, name):
            return reader() if name == "echo" else None

    return Plugin()


def echo_plugin(**kw):
    return _plugin(lambda name: Echo(name, **kw))


# ------------------------------------------------------------------------------------------ run order
def order_plugin(tag, calls):
    class P:
        @hookimpl
        def genartifact_engine_options(self, options):
            calls.append(("engine_options", tag))

        @hookimpl
        def genartifact_content_producer(self, name, model):
            calls.append(("content_producer", tag))
            return Echo(name) if name == "echo" and tag != "first" else None

        @hookimpl
        def genartifact_worker_call(self, worker, method, args):
            calls.append(("worker_call", tag))
            return tag if tag != "first" else None

        @hookimpl
        def genartifact_worker_capture(self, worker, settings):
            calls.append(("worker_capture", tag))

    return P()


def test_config_order_is_run_order_for_every_hook_with_three_plugins():
    calls: list = []
    objs = {t: order_plugin(t, calls) for t in ("first", "second", "third")}
    host = make_host(contents=objs)
    host.hooks.engine_options(options={})
    assert host.hooks.worker_captures(worker=None, settings={}) == []
    assert host.hooks.worker_call(worker=None, method="m", args=[]) == "second"  # firstresult: config order
    p = host.hooks.content_producer(name="echo", model=None)
    assert p.info.name == "second"
    by_hook = {}
    for hook, tag in calls:
        by_hook.setdefault(hook, []).append(tag)
    assert by_hook == {"engine_options": ["first", "second", "third"], "worker_capture": ["first", "second", "third"],
                       "worker_call": ["first", "second"], "content_producer": ["first", "second"]}
    calls.clear()
    host._pm.hook.genartifact_engine_options(options={}, worker_capture=False)  # pluggy's own call path agrees (fixed at registration)
    assert [t for _, t in calls] == ["first", "second", "third"]
    calls.clear()
    reversed_host = make_host(contents={t: objs[t] for t in ("third", "second", "first")})
    reversed_host.hooks.engine_options(options={})
    assert [t for _, t in calls] == ["third", "second", "first"]


# ------------------------------------------------------------------------------------------ load-time checks
def test_function_without_hookimpl_is_a_load_error_naming_the_fix():
    mod = types.ModuleType("nohook")

    def genartifact_content_producer(name, model):
        return None

    mod.genartifact_content_producer = genartifact_content_producer
    with pytest.raises(PluginLoadError, match=r"content 'nohook'.*genartifact_content_producer is not decorated "
                                              r"with @hookimpl"):
        PluginHost({"contents": ["nohook"]}, objects={"contents": {"nohook": mod}})


def test_plugin_without_any_hook_is_a_load_error():
    with pytest.raises(PluginLoadError, match="has no @hookimpl functions"):
        PluginHost({"contents": ["empty"]}, objects={"contents": {"empty": types.ModuleType("empty")}})


def test_hook_name_typo_suggests_the_hook():
    mod = types.ModuleType("typo")

    @hookimpl
    def genartifact_content_prodcer(name, model):
        return None

    mod.genartifact_content_prodcer = genartifact_content_prodcer
    with pytest.raises(PluginLoadError, match="did you mean genartifact_content_producer"):
        PluginHost({"contents": ["typo"]}, objects={"contents": {"typo": mod}})


def test_two_entry_points_resolving_to_one_object():
    obj = echo_plugin()
    with pytest.raises(PluginLoadError, match=r"resolve to the same object; give each entry point its own"):
        PluginHost({"contents": ["a", "b"]}, objects={"contents": {"a": obj, "b": obj}})


def test_hook_wrappers_refused():
    class W:
        @hookimpl(wrapper=True)
        def genartifact_engine_options(self, options):
            return (yield)

    with pytest.raises(PluginLoadError, match="hook wrapper"):
        PluginHost({"contents": ["w"]}, objects={"contents": {"w": W()}})


# ------------------------------------------------------------------------------------------ fault isolation
@pytest.mark.parametrize("method", ["on_delta", "collect", "finalize", "retained_bytes"])
def test_content_raising_after_admission_fails_only_that_request(method):
    host = make_host(contents={"echo": echo_plugin(fail=method)})
    with structlog.testing.capture_logs() as logs:
        res = run_session(host, ["echo"], [1, 2, 3], [4, 5])
    assert res.receipt["state"] == "failed" and res.receipt["error_code"] == "internal_error"
    fault = next(e for e in logs if e["event"] == "plugin_fault")
    assert fault["plugin"] == "echo" and fault["dist"] == "<in-process>" and fault["method"] == method
    assert fault["error_type"] == "RuntimeError" and f"{method} exploded" in fault["error"]
    assert "deadbeef" not in fault["error"] and "abc123" not in fault["error"]
    assert host.memory_store == {}  # nothing stored
    ok = run_session(make_host(contents={"echo": echo_plugin()}), ["echo"], [1, 2, 3], [4, 5])
    assert ok.receipt["state"] == "ready" and ok.artifact.tensors["echo.values"].tolist() == [4, 5]


@pytest.mark.parametrize("method", ["admit", "sampling_overrides"])
def test_content_raising_at_admission_is_a_plugin_fault(method):
    host = make_host(contents={"echo": echo_plugin(fail=method)})
    with pytest.raises(PluginFault, match=rf"content plugin echo \(<in-process> 0\) raised RuntimeError in {method}"):
        run_session(host, ["echo"], [1, 2, 3], [4, 5])


def test_release_fault_is_logged_and_does_not_change_the_receipt():
    host = make_host(contents={"echo": echo_plugin(fail="release")})
    with structlog.testing.capture_logs() as logs:
        res = run_session(host, ["echo"], [1, 2], [3])
    assert res.receipt["state"] == "ready"
    assert any(e["event"] == "plugin_fault" and e["method"] == "release" for e in logs)


@pytest.mark.parametrize("bad,where", [("admit", "admit"), ("finalize_type", "finalize"),
                                       ("finalize_name", "finalize"), ("finalize_big", "finalize"),
                                       ("retained", "retained_bytes")])
def test_bad_producer_return_values(bad, where):
    host = make_host(contents={"echo": echo_plugin(bad=bad)})
    with structlog.testing.capture_logs() as logs:
        try:
            res = run_session(host, ["echo"], [1, 2], [3, 4])
            assert res.receipt["error_code"] == "internal_error"
        except PluginFault as e:
            assert where == "admit" and e.error_type == "bad_return"
    assert any(e["event"] == "plugin_fault" and e["method"] == where for e in logs)
    assert host.memory_store == {}


class BadTarget(MemoryTarget):
    kind = "bad"

    def __init__(self, mode):
        super().__init__()
        self.mode = mode

    def validate(self, spec):
        if self.mode == "validate":
            raise KeyError("object_key")
        vt = super().validate({k: v for k, v in spec.items() if k != "kind"})
        from genartifact.types import ValidatedTarget

        return ValidatedTarget("bad", vt.max_bytes, vt.object_id)

    async def deliver(self, target, data, sha256):
        await super().deliver(target, data, sha256)
        if self.mode == "raise":
            raise RuntimeError("connection reset: https://u:p@store.example/k?sig=1")
        return {"none": None, "int": 123, "other": "other-id", "bytes": data}.get(self.mode, target.object_id)


def bad_target_host(mode):
    class P:
        @hookimpl
        def genartifact_storage_target(self, kind, settings):
            return BadTarget(mode) if kind == "bad" else None

    return make_host(contents={"echo": echo_plugin()}, targets={"bad": P()}, memory_target=False)


@pytest.mark.parametrize("mode", ["none", "int", "other", "bytes", "raise"])
def test_target_deliver_bad_return_or_raise_is_internal_error_and_journaled(mode, tmp_path):
    host = bad_target_host(mode)
    journal = DeliveryJournal(tmp_path / "j.jsonl")
    with structlog.testing.capture_logs() as logs:
        res = run_session(host, ["echo"], [1], [2], target={"kind": "bad", "object_key": "k"}, journal=journal)
    assert res.receipt["state"] == "failed" and res.receipt["error_code"] == "internal_error"
    assert "object_id" not in res.receipt
    fault = next(e for e in logs if e["event"] == "plugin_fault")
    assert fault["method"] == "deliver" and "u:p@" not in fault["error"] and "sig=1" not in fault["error"]
    assert [r["last_state"] for r in journal.unresolved()] == ["failed"]  # an outcome, never an eternal intent


def test_target_validate_unexpected_exception_is_a_fault():
    host = bad_target_host("validate")
    with pytest.raises(PluginFault, match=r"target plugin bad .* raised KeyError in validate"):
        run_session(host, ["echo"], [1], [2], target={"kind": "bad", "object_key": "k"})


def test_receipt_object_id_is_the_validated_id():
    res = run_session(bad_target_host("ok"), ["echo"], [1], [2], target={"kind": "bad", "object_key": "k1"})
    assert res.receipt["state"] == "ready" and res.receipt["object_id"] == "k1" and res.receipt["target"] == "bad"


def test_factory_returning_wrong_object_is_a_fault():
    class P:
        @hookimpl
        def genartifact_content_producer(self, name, model):
            return object()

    host = make_host(contents={"echo": P()})
    with pytest.raises(PluginFault, match=r"without method\(s\)"):
        run_session(host, ["echo"], [1], [2])


def test_redact_removes_url_secrets_and_credentials():
    text = ("PUT https://user:pw@bucket.s3.example.com/k.gart?X-Amz-Signature=abc&X-Amz-Credential=AK "
            "failed; Authorization: Bearer-xyz token=t0k secret_key='s3cr3t'")
    out = redact(text)
    for secret in ("pw", "abc", "AK", "Bearer-xyz", "t0k", "s3cr3t"):
        assert secret not in out.replace("<redacted>", "")
    assert "bucket.s3.example.com/k.gart" in out



@pytest.mark.parametrize("text", ["Authorization: Bearer SECRETTOKEN", "headers {'Authorization': 'Bearer SECRETTOKEN'}",
                                  '{"X-Amz-Signature": "SECRETTOKEN"}', "sv=2020-08-04&sig=SECRETTOKEN&se=2026",
                                  "X-Amz-Signature%3DSECRETTOKEN", "Authorization=Basic SECRETTOKEN"])
def test_redact_removes_auth_schemes_quoted_keys_and_encoded_pairs(text):
    """Forms a plugin's exception text shows secrets in (found by the attack review of worker faults): an auth
    scheme before the token, a key quoted as a printed dict or JSON shows it, Azure SAS's ``sig``, ``%3D``;
    ordinary text about tokens stays readable."""
    assert "SECRETTOKEN" not in redact(text)
    assert redact("logprob 5.0 for token 8; signal=5") == "logprob 5.0 for token 8; signal=5"


def test_other_requests_run_on_after_a_fault_in_one():
    faulty = {"n": 0}

    class Flaky(Echo):
        def on_delta(self, delta):
            faulty["n"] += 1
            if faulty["n"] == 1:
                raise ValueError("first request only")
            super().on_delta(delta)

    host = make_host(contents={"echo": _plugin(Flaky)})

    async def both():
        from genartifact.testing import arun_session

        return await asyncio.gather(arun_session(host, ["echo"], [1], [2], per_step=False),
                                    arun_session(host, ["echo"], [1], [3], per_step=False))

    a, b = asyncio.run(both())
    assert sorted([a.receipt["state"], b.receipt["state"]]) == ["failed", "ready"]


# ------------------------------------------------------------------------------------------ settings, templating
def test_content_settings_and_base_dir_reach_every_plugin(tmp_path):
    from genartifact.config import parse

    seen = {}

    class P:
        @hookimpl
        def genartifact_content_producer(self, name, model, settings):
            seen["content"] = dict(settings)
            return Echo(name) if name == "echo" else None

    cfg = parse('[plugins]\ncontents = ["echo"]\n[contents.echo]\nwindow = 4\n[targets.sqlite]\npath = "o.db"\n',
                source="t", base_dir=tmp_path)
    host = cfg.host(objects={"contents": {"echo": P()}}, source=lambda group: [])
    host.hooks.content_producer(name="echo", model=None, settings=host.content_settings["echo"])
    assert seen["content"] == {"window": 4, "base_dir": str(tmp_path)}
    assert cfg.target_settings()["sqlite"] == {"path": "o.db", "base_dir": str(tmp_path)}  # every target gets it
    from genartifact.errors import ConfigError

    with pytest.raises(ConfigError, match=r"\[contents.echo\].base_dir is reserved"):
        parse('[contents.echo]\nbase_dir = "x"\n', source="t", base_dir=tmp_path)


def test_templating_applies_to_every_string_field_of_any_target_kind():
    from genartifact.engine.job import target_for
    from genartifact.errors import RequestSpecError

    t = target_for('{"kind": "sqlite", "name": "runs/{run_id}/{index}", "note": "{{literal}}"}', "r7", 12)
    assert t == {"kind": "sqlite", "name": "runs/r7/00012", "note": "{literal}"}
    with pytest.raises(RequestSpecError, match="name: only the placeholders"):
        target_for('{"kind": "sqlite", "name": "{nope}"}', "r", 0)
    host = make_host()
    assert target_for("memory:runs", "r1", 3, host) == {"kind": "memory", "object_key": "runs/r1/00003.gart"}
    with pytest.raises(RequestSpecError, match="has no KIND:VALUE shorthand"):
        target_for("memory:x", "r", 0, None)


def test_decode_of_builtin_contents_needs_neither_vllm_nor_torch(tmp_path):
    import subprocess
    import sys

    code = textwrap.dedent("""
        import sys
        import numpy as np
        from genartifact import format as fmt
        inp = fmt.ArtifactInput(np.arange(6, dtype=np.uint32), 4, ["selected_logprobs", "moe_routes"],
            {"selected_logprobs": {"token_start": 4},
             "moe_routes": {"token_start": 0, "router_ids": [0], "expert_counts": [8], "top_k": 1,
                            "layout": "router_major"}},
            [fmt.TensorPart("selected_logprobs.logprobs", np.array([-1.0, -2.0], np.float32)),
             fmt.TensorPart("moe_routes.expert_ids", np.zeros((1, 5, 1), np.uint8))])
        art = fmt.decode(fmt.encode(inp).data)
        assert art.summary()["selected_logprobs"]["count"] == 2 and art.content("moe_routes").shape == (5, 1, 1)
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "torch")))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------ consumes_deltas
class CollectOnly(Echo):
    """A content whose data arrives in ``collect`` (like a worker-side capture): it declares
    ``consumes_deltas = False`` and fails loudly if the host still feeds it deltas or polls it per delta."""

    consumes_deltas = False

    def __init__(self, name="echo", big=False):
        super().__init__(name)
        self.big, self.polled = big, 0

    def on_delta(self, delta):
        raise AssertionError("on_delta called on a content that consumes no deltas")

    async def collect(self, final):
        self.vals = list(final.completion_token_ids) * (1000 if self.big else 1)

    def retained_bytes(self):
        self.polled += 1
        return 4 * len(self.vals)


def _collect_only_plugin(**kw):
    made = []

    def make(name):
        made.append(CollectOnly(name, **kw))
        return made[-1]

    return _plugin(make), made


def test_content_that_consumes_no_deltas_gets_none_and_is_still_bounded_at_finalize():
    plugin, made = _collect_only_plugin()
    res = run_session(make_host(contents={"echo": plugin}), ["echo"], [1, 2, 3], [4, 5, 6, 7])  # per-step deltas
    assert res.receipt["state"] == "ready" and res.artifact.tensors["echo.values"].tolist() == [4, 5, 6, 7]
    assert made[0].polled <= 1  # never polled per delta (at most once for the final retained figure)
    plugin, made = _collect_only_plugin(big=True)
    host = make_host(contents={"echo": plugin})
    with structlog.testing.capture_logs() as logs:
        res = run_session(host, ["echo"], [1, 2, 3], [4, 5])
    assert res.receipt["error_code"] == "internal_error"  # over its admitted bytes: the bound holds after collect
    assert any(e["event"] == "plugin_fault" and e["method"] == "retained_bytes" for e in logs)
    assert host.memory_store == {}


def test_session_still_checks_max_tokens_without_delta_fed_contents():
    plugin, _ = _collect_only_plugin()
    res = run_session(make_host(contents={"echo": plugin}), ["echo"], [1, 2], [3, 4, 5], max_tokens=2)
    assert res.receipt["state"] == "failed" and res.receipt["error_code"] == "capture_invalid"


def test_consumes_deltas_attribute_raising_is_a_plugin_fault_at_admission():
    class Broken(Echo):
        @property
        def consumes_deltas(self):
            raise RuntimeError("no idea")

    with pytest.raises(PluginFault, match="consumes_deltas"):
        run_session(make_host(contents={"echo": _plugin(Broken)}), ["echo"], [1, 2], [3])


# ------------------------------------------------------------------------------------------ hot-path faults
def _with(**attrs):
    return _plugin(lambda name: type("Flagged", (Echo,), attrs)(name))


# ------------------------------------------------------------------------------------------ optional flags
@pytest.mark.fault("plugin", "optional flag of a non-bool value")
@pytest.mark.parametrize("flag", ["consumes_deltas", "per_step_deltas"])
@pytest.mark.parametrize("value", ["False", 0, None, [], 1.0], ids=["str", "zero", "none", "list", "float"])
def test_a_flag_that_is_not_a_bool_is_a_plugin_fault_at_admission(flag, value):
    """``consumes_deltas = None`` (an unset optional) or ``"False"`` must not be guessed at: a wrong guess silently
    starves the content of its deltas (data missing from the artifact) or feeds one that declared it takes none."""
    with pytest.raises(PluginFault, match=f"{flag}.*allowed: True or False"):
        run_session(make_host(contents={"echo": _with(**{flag: value})}), ["echo"], [1, 2], [3, 4])


def test_numpy_bools_are_bools():
    class CollectOnly(Echo):
        consumes_deltas = np.False_

        def on_delta(self, delta):
            raise AssertionError("fed a delta")

        async def collect(self, final):
            self.vals = list(final.completion_token_ids)

    res = run_session(make_host(contents={"echo": _plugin(CollectOnly)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "ready" and res.artifact.tensors["echo.values"].tolist() == [3, 4]
    res = run_session(make_host(contents={"echo": _with(per_step_deltas=np.True_)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "ready" and res.session.per_step_deltas is True


@pytest.mark.fault("plugin", "per_step_deltas attribute raising")
def test_per_step_deltas_is_read_once_at_admission_as_a_guarded_plugin_call():
    """The engine reads ``session.per_step_deltas`` when it starts the request; a producer's property raising
    there escaped unguarded (a bare RuntimeError, outside the block that releases the session). It is now read
    at admission, as a plugin fault, and never again."""

    class Raises(Echo):
        @property
        def per_step_deltas(self):
            raise RuntimeError("no idea")

    with pytest.raises(PluginFault, match="per_step_deltas"):
        run_session(make_host(contents={"echo": _plugin(Raises)}), ["echo"], [1, 2], [3])

    reads = []

    class Counted(Echo):
        @property
        def per_step_deltas(self):
            reads.append(1)
            return len(reads) == 1  # True when admitted, False if asked again

    res = run_session(make_host(contents={"echo": _plugin(Counted)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "ready" and res.session.per_step_deltas is True and len(reads) == 1


def test_consumes_deltas_set_in_admit_is_honoured():
    """The flag is read after every ``admit`` returned (docs/plugins.md: set it in ``__init__`` or in ``admit``)."""

    class LateFlag(Echo):
        def admit(self, ctx):
            self.consumes_deltas = False
            return super().admit(ctx)

        def on_delta(self, delta):
            raise AssertionError("fed a delta")

        async def collect(self, final):
            self.vals = list(final.completion_token_ids)

    res = run_session(make_host(contents={"echo": _plugin(LateFlag)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "ready"


# ------------------------------------------------------------------------------------------ inline encode
def _encode_threads(monkeypatch):
    """Patch the encoder to record, per call, whether it ran on the event loop's thread (the main thread here)."""
    ran, real = [], fmt.encode

    def encode(*a, **kw):
        ran.append("loop" if threading.current_thread() is threading.main_thread() else "thread")
        return real(*a, **kw)

    monkeypatch.setattr(fmt, "encode", encode)
    return ran


def test_small_artifacts_are_still_encoded_on_the_loop(monkeypatch):
    ran = _encode_threads(monkeypatch)
    res = run_session(make_host(contents={"echo": _with()}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "ready" and ran == ["loop"]


@pytest.mark.fault("session", "inline encode: tiny tensors, large manifest section")
def test_a_large_section_with_tiny_tensors_is_encoded_off_the_loop(monkeypatch):
    """The inline decision counted token ids and tensors only: a content's manifest section (JSON, up to its
    admitted bytes) was serialized on the event loop — about 10 ms for a 1 MiB manifest, over 100 ms for a
    30 MB section refused only after serializing it — blocking every other request's streaming meanwhile."""

    class BigSection(Echo):
        def admit(self, ctx):
            return 4_000_000

        def finalize(self, final):
            return {"blob": ["x" * 100] * 3000}, [TensorPart(f"{self.name}.values", np.asarray(self.vals, "<u4"))]

    ran = _encode_threads(monkeypatch)
    res = run_session(make_host(contents={"echo": _plugin(BigSection)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "ready" and ran == ["thread"]


@pytest.mark.fault("session", "inline encode: tensor of an ndarray subclass reporting a small nbytes")
def test_an_array_subclass_is_never_sized_by_its_own_nbytes(monkeypatch):
    class Liar(np.ndarray):
        @property
        def nbytes(self):
            return 0

    class Lying(Echo):
        def finalize(self, final):
            return {}, [TensorPart(f"{self.name}.values", np.asarray(self.vals, "<u4").view(Liar))]

    ran = _encode_threads(monkeypatch)
    run_session(make_host(contents={"echo": _plugin(Lying)}), ["echo"], [1, 2], [3, 4])
    assert ran == ["thread"]


@pytest.mark.fault("session", "tensor whose nbytes lies about its data, small and large bodies")
@pytest.mark.parametrize("elements", [10, 100_000])  # below and above format.ONE_SHOT_BELOW_BYTES
def test_a_tensor_whose_nbytes_lies_fails_as_encode_failed_at_any_size(elements):
    """The manifest lays a tensor out by its ``nbytes``; an array that reports more than it holds must fail its
    artifact as ``encode_failed`` whatever the body's size (the streamed path once raised a zstd error for it:
    ``internal_error``), and never be stored with a layout its bytes do not fill."""

    class Liar(np.ndarray):
        @property
        def nbytes(self):
            return np.ndarray.nbytes.__get__(self) + 64

    class P(Echo):
        def admit(self, ctx):
            super().admit(ctx)
            return 10 << 20

        def finalize(self, final):
            liar = np.zeros(elements, "<u4").view(Liar)
            return {}, [TensorPart(f"{self.name}.values", np.asarray(self.vals, "<u4")),
                        TensorPart(f"{self.name}.x", liar)]

    res = run_session(make_host(contents={"echo": _plugin(P)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "failed" and res.receipt["error_code"] == "encode_failed"


@pytest.mark.fault("session", "inline-encode sizing of huge, deep or self-referencing sections")
def test_inline_sizing_is_bounded_whatever_the_section():
    limit = session_mod.INLINE_ENCODE_BYTES

    def inp(section):
        return fmt.ArtifactInput(np.zeros(3, "<u4"), 1, ["c"], {"c": section}, [])

    deep: list = []
    cur = deep
    for _ in range(100_000):  # deeper than the recursion limit
        cur.append([])
        cur = cur[0]
    loop: list = [1]
    loop.append(loop)
    many = list(range(10_000_000))
    for section in ({"a": many}, {"a": deep}, {"a": loop}, {"k" * (limit + 1): 1}, {"a": {i: i for i in range(10**6)}}):
        assert session_mod._input_nbytes(inp(section)) > limit
    assert session_mod._input_nbytes(inp({"a": list(range(100))})) <= limit
    assert session_mod._input_nbytes(fmt.ArtifactInput([1, 2, 3], 1, ["c"], {"c": {}}, [])) <= limit  # a list


def test_inline_sizing_counts_subclasses_and_plain_types_alike():
    """The exact-type fast paths of the sizing walk give what the general (ABC) path gives."""
    import collections

    class S(str):
        pass

    class L(list):
        pass

    plain = {"a": [1, 2.5, True, None, "xyz"], "b": {"c": (1, 2)}}
    odd = collections.OrderedDict(a=L([1, 2.5, True, None, S("xyz")]), b=collections.UserDict(c=(1, 2)))
    limit = 10**6
    assert session_mod._json_size_upto(plain, 0, limit) == session_mod._json_size_upto(odd, 0, limit) > 0
    assert session_mod._json_size_upto({S("k"): 1}, 0, limit) == session_mod._json_size_upto({"k": 1}, 0, limit)


@pytest.mark.fault("plugin", "CaptureError message carrying a presigned URL")
@pytest.mark.parametrize("where", ["on_delta", "collect", "finalize"])
def test_capture_error_messages_are_redacted_in_the_log(where):
    """A plugin's ``CaptureError`` message is logged (``artifact_capture_invalid``); a signed URL or a token in it
    must not reach the log (house rule: secrets never reach logs), as for plugin faults."""
    from genartifact.errors import CaptureError

    secret = "https://h.example/x?X-Amz-Signature=deadbeef token=abc123"

    class Leaky(Echo):
        def on_delta(self, delta):
            if where == "on_delta":
                raise CaptureError(f"bad row from {secret}")
            super().on_delta(delta)

        async def collect(self, final):
            if where == "collect":
                raise CaptureError(f"bad row from {secret}")

        def finalize(self, final):
            if where == "finalize":
                raise CaptureError(f"bad row from {secret}")
            return super().finalize(final)

    with structlog.testing.capture_logs() as logs:
        res = run_session(make_host(contents={"echo": _plugin(Leaky)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["error_code"] == "capture_invalid"
    text = repr(logs)
    assert "artifact_capture_invalid" in text and "h.example/x" in text
    assert "deadbeef" not in text and "abc123" not in text


@pytest.mark.fault("plugin", "collect writing into the completion token ids it is given")
def test_collect_cannot_rewrite_the_stored_token_ids():
    class Rewriter(Echo):
        async def collect(self, final):
            assert isinstance(final.completion_token_ids, tuple)  # the host's copy, read-only
            try:
                final.completion_token_ids[0] = 4242
            except TypeError:
                pass

    res = run_session(make_host(contents={"echo": _plugin(Rewriter)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "ready"
    assert res.artifact.completion_token_ids.tolist() == [3, 4]


def _adapter_run(host, contents, prompt, steps, max_tokens):
    """``VllmEngine.execute`` (the engine adapter's per-request loop) over a stand-in stream yielding ``steps``
    (lists of new token ids, one delta each; the last one finished): returns (receipt, record calls)."""
    import uuid

    from genartifact.engine.vllm_adapter import Prepared, RequestResult, VllmEngine
    from genartifact.session import ArtifactSession
    from genartifact.spec import parse_request
    from genartifact.testing import model_info
    from genartifact.types import Delta

    spec = {"format": "generation_artifact_v1", "contents": list(contents), "codec": "zstd",
            "delivery": {"mode": "object_store", "target": {"kind": "memory", "object_key": f"runs/{uuid.uuid4().hex}"}}}
    s = ArtifactSession.for_request(host, parse_request(spec), model_info(), {"memory": {}})
    s.admit(len(prompt), max_tokens, sampling={"temperature": 1.0})
    calls = []
    real = s.record_or_fail
    s.record_or_fail = lambda d: (calls.append(list(d.new_token_ids)), real(d))[1]
    eng = object.__new__(VllmEngine)

    async def stream(ids, sampling, request_id=None, final_only=False):
        for i, new in enumerate(steps):
            done = i == len(steps) - 1
            yield (Delta(prompt, new, finished=done, finish_reason="length" if done else None),
                   types.SimpleNamespace(finish_reason="length" if done else None, stop_reason=None))

    eng.stream = stream

    async def main():
        out = None
        async for ev in eng.execute(Prepared(list(prompt), {}, s)):
            if isinstance(ev, RequestResult):
                out = ev
        return out.receipt

    return asyncio.run(main()), calls


def test_engine_adapter_records_the_completion_once_when_no_content_consumes_deltas():
    """No requested content consumes deltas: the adapter hands the session the whole completion once, when the
    stream ends (not a call per engine step), and the same checks hold there — max_tokens exceeded is
    capture_invalid; a content that consumes deltas still gets one call per delta."""
    plugin, made = _collect_only_plugin()
    host = make_host(contents={"echo": plugin})
    receipt, calls = _adapter_run(host, ["echo"], [1, 2, 3], [[4], [5], [6, 7]], max_tokens=4)
    assert receipt["state"] == "ready" and calls == [[4, 5, 6, 7]]
    receipt, calls = _adapter_run(host, ["echo"], [1, 2, 3], [[4], [5], [6, 7]], max_tokens=3)
    assert receipt["error_code"] == "capture_invalid" and calls == [[4, 5, 6, 7]]
    fed = make_host(contents={"echo": _plugin(lambda name: Echo(name))})
    receipt, calls = _adapter_run(fed, ["echo"], [1, 2, 3], [[4], [5], [6, 7]], max_tokens=4)
    assert receipt["state"] == "ready" and calls == [[4], [5], [6, 7]]


@pytest.mark.fault("plugin", "a content reader's validate raises something other than ArtifactFormatError")
def test_a_reader_that_crashes_is_a_plugin_fault_at_encode_and_a_named_format_error_at_decode():
    """A reader whose ``validate`` raises (a bug, not a rejection): encode fails the request as ``internal_error``
    (a plugin fault, logged as ``plugin_fault`` with plugin and distribution), not ``encode_failed``; decode of a
    good object through that reader raises ``ArtifactFormatError`` naming the content, the plugin and the redacted
    error, chained to the plugin's exception (so ``--traceback`` shows where it raised)."""
    from genartifact.errors import ArtifactFormatError

    class Crashing(EchoReader):
        def validate(self, manifest, section, tensors):
            raise KeyError("exploded token=abc123")

    with structlog.testing.capture_logs() as logs:
        res = run_session(make_host(contents={"echo": _plugin(Echo, Crashing)}), ["echo"], [1, 2], [3, 4])
    assert res.receipt["state"] == "failed" and res.receipt["error_code"] == "internal_error"
    faults = [e for e in logs if e["event"] == "plugin_fault"]
    assert faults and faults[0]["method"] == "validate" and faults[0]["error_type"] == "KeyError"
    good = run_session(make_host(contents={"echo": echo_plugin()}), ["echo"], [1, 2], [3, 4])
    assert good.receipt["state"] == "ready"
    broken = make_host(contents={"echo": _plugin(Echo, Crashing)}).reader("echo")
    with pytest.raises(ArtifactFormatError, match=r"content 'echo' reader failed: .*echo.*KeyError.*exploded") as ei:
        fmt.decode(good.data, readers={"echo": broken})
    assert "abc123" not in str(ei.value)
    assert isinstance(ei.value.__cause__, PluginFault) and isinstance(ei.value.__cause__.__cause__, KeyError)
