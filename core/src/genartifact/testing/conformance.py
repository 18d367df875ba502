"""Conformance suites that a plugin's own tests subclass: the same bar the in-repo plugins are held to.

Targets (:class:`TargetConformance`): create-only, all-or-nothing, ``too_large`` before writing, ``validate``
free of side effects, receipt id = validated id, stable error codes, no secrets in repr/errors/logs, read-back
(``open`` bounded by ``max_bytes``, ``exists``) and conditional delete.

Contents (:class:`ContentConformance`): strict decode round trip through the plugin's reader, release idempotent,
retained <= admitted at every delta, alignment with the token counts (a token more or fewer is rejected by the
reader), no sampling change unless declared, the reader rejects missing tensors, the summary is JSON.

Each suite is a plain class whose ``test_*`` methods pytest collects in a subclass named ``Test*``; async work
runs in ``asyncio.run`` so no pytest-asyncio mode is required. Example::

    from genartifact.testing.conformance import TargetConformance

    class TestMyTarget(TargetConformance):
        def make_target(self):
            return MyTarget(...)

        def target_spec(self, key):
            return {"kind": "my_kind", "bucket_key": key}
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest
import structlog

from genartifact.errors import ArtifactFormatError, DeliveryError, TargetError
from genartifact.host import GuardedTarget, PluginInfo
from genartifact.session import ERROR_MESSAGES


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


class TargetConformance:
    """Subclass with a ``Test`` name and implement :meth:`make_target` and :meth:`target_spec`.

    Optional overrides: :meth:`small_target_spec` (a spec whose ``max_bytes`` is at most 4096, for the
    ``too_large`` check; default: skip), :meth:`bad_specs` (``(spec, text the TargetError must contain)``),
    :attr:`secrets` (strings that must never appear in repr, errors or logs), :attr:`read_back` (False for
    write-only targets such as presigned grants: the read-back tests then check that ``open`` refuses with a
    ``TargetError``), :meth:`cleanup`."""

    #: strings (credentials, signatures, URLs' queries) that must never surface
    secrets: Sequence[str] = ()
    #: whether the target implements ``open``/``exists``/``delete``
    read_back: bool = True
    #: the payload stored by the tests (bytes)
    payload: bytes = b"GENART\x00\x01" + bytes(range(256)) * 4

    def make_target(self) -> Any:
        """The target object under test (what ``genartifact_storage_target`` returns)."""
        raise NotImplementedError

    def target_spec(self, key: str) -> dict[str, Any]:
        """A valid ``delivery.target`` for a fresh object named after ``key`` (unique per call)."""
        raise NotImplementedError

    def small_target_spec(self, key: str) -> dict[str, Any] | None:
        """A valid spec whose validated ``max_bytes`` is at most 4096 bytes, or None to skip ``too_large``."""
        return None

    def bad_specs(self) -> Sequence[tuple[dict[str, Any], str]]:
        """Invalid specs and a text their ``TargetError`` must contain (e.g. the field name)."""
        return ()

    # helpers ------------------------------------------------------------------------------------------
    def guarded(self) -> GuardedTarget:
        t = self.make_target()
        kind = getattr(t, "kind", "target_under_test")
        return GuardedTarget(t, PluginInfo("targets", kind, "under-test", "0", "test"), kind)

    def fresh_key(self) -> str:
        return f"conformance/{uuid.uuid4().hex}.gart"

    def _no_secret(self, text: str) -> None:
        for s in self.secrets:
            assert s not in text, f"secret {s[:4]}... leaked"

    # tests --------------------------------------------------------------------------------------------
    def test_validate_is_side_effect_free_and_id_is_stable(self) -> None:
        t = self.guarded()
        spec = self.target_spec(self.fresh_key())
        a, b = t.validate(spec), t.validate(copy.deepcopy(spec))
        assert a.object_id == b.object_id and a.max_bytes == b.max_bytes >= 1
        if self.read_back:
            assert _run(t.exists(a.object_id)) is False, "validate() must not create the object"

    def test_bad_specs_raise_target_error_naming_the_field(self) -> None:
        t = self.guarded()
        for spec, text in self.bad_specs():
            with pytest.raises(TargetError) as e:
                t.validate(spec)
            assert text in str(e.value), f"{e.value!s} does not name {text!r}"
            self._no_secret(str(e.value))

    def test_deliver_returns_the_validated_id_and_reads_back(self) -> None:
        t = self.guarded()
        vt = t.validate(self.target_spec(self.fresh_key()))
        sha = hashlib.sha256(self.payload).hexdigest()
        assert _run(t.deliver(vt, self.payload, sha)) == vt.object_id
        if not self.read_back:
            return
        assert _run(t.exists(vt.object_id)) is True
        assert _run(t.open(vt.object_id, len(self.payload))) == self.payload
        with pytest.raises(TargetError):  # bounded read: never more than max_bytes
            _run(t.open(vt.object_id, len(self.payload) - 1))

    def test_create_only_second_write_fails_and_keeps_the_first(self) -> None:
        t = self.guarded()
        spec = self.target_spec(self.fresh_key())
        vt = t.validate(spec)
        _run(t.deliver(vt, self.payload, hashlib.sha256(self.payload).hexdigest()))
        other = b"other bytes"
        with pytest.raises(DeliveryError) as e:
            _run(t.deliver(t.validate(spec), other, hashlib.sha256(other).hexdigest()))
        assert e.value.code == "object_exists"
        if self.read_back:
            assert _run(t.open(vt.object_id, len(self.payload))) == self.payload

    def test_too_large_refused_before_writing(self) -> None:
        key = self.fresh_key()
        spec = self.small_target_spec(key)
        if spec is None:
            pytest.skip("no small_target_spec: too_large not exercised")
        t = self.guarded()
        vt = t.validate(spec)
        assert vt.max_bytes <= 4096
        data = b"x" * (vt.max_bytes + 1)
        with pytest.raises(DeliveryError) as e:
            _run(t.deliver(vt, data, hashlib.sha256(data).hexdigest()))
        assert e.value.code == "too_large"
        if self.read_back:
            assert _run(t.exists(vt.object_id)) is False, "all-or-nothing: nothing may stay behind"

    def test_open_missing_is_a_target_error(self) -> None:
        t = self.guarded()
        vt = t.validate(self.target_spec(self.fresh_key()))
        with pytest.raises(TargetError):
            _run(t.open(vt.object_id, 1 << 20))

    def test_conditional_delete(self) -> None:
        if not self.read_back:
            pytest.skip("write-only target")
        t = self.guarded()
        vt = t.validate(self.target_spec(self.fresh_key()))
        sha = hashlib.sha256(self.payload).hexdigest()
        _run(t.deliver(vt, self.payload, sha))
        assert _run(t.delete(vt.object_id, "0" * 64)) is False  # someone else's bytes: kept
        assert _run(t.exists(vt.object_id)) is True
        assert _run(t.delete(vt.object_id, sha)) is True
        assert _run(t.exists(vt.object_id)) is False
        assert _run(t.delete(vt.object_id, sha)) is False

    def test_error_codes_are_stable_and_secrets_never_surface(self) -> None:
        t = self.guarded()
        self._no_secret(repr(t.inner))
        spec = self.target_spec(self.fresh_key())
        self._no_secret(repr(t.validate(spec)))
        with structlog.testing.capture_logs() as logs:
            vt = t.validate(spec)
            _run(t.deliver(vt, self.payload, hashlib.sha256(self.payload).hexdigest()))
            other = self.payload[::-1]  # different bytes (a same-bytes retry may legitimately succeed)
            with pytest.raises(DeliveryError) as e:
                _run(t.deliver(vt, other, hashlib.sha256(other).hexdigest()))
        assert e.value.code in ERROR_MESSAGES, f"code {e.value.code!r} is not a documented receipt code"
        self._no_secret(str(e.value))
        self._no_secret(json.dumps(logs, default=str))


class ContentConformance:
    """Subclass with a ``Test`` name; set :attr:`content` and implement :meth:`make_host` if the plugin is not
    installed (default: the installed plugin of that name plus the kit's memory target).

    Optional overrides: :meth:`engine` (a :class:`~genartifact.testing.FakeEngine` answering the content's
    worker calls for ``prompt``/``completion``), :meth:`model`, :attr:`logprobs` (per completion token the
    sampled token's logprob, fed through deltas), :attr:`changes_sampling` (True if the content must change the
    engine's sampling parameters beyond ``extra_args``), :attr:`aligned_to_tokens` (False if its tensors do not
    depend on the token counts)."""

    content: str = ""
    #: the request's sampling parameters (e.g. ``{"temperature": 1.0, "logprobs": 5}`` for a top-k content)
    sampling: Mapping[str, Any] = {"temperature": 1.0}
    prompt: Sequence[int] = (3, 1, 4, 1, 5)
    completion: Sequence[int] = (9, 2, 6)
    #: per completion token the sampled token's logprob, or ``(position, token) -> {token_id: logprob}``
    logprobs: Sequence[float] | Callable[[int, int], Mapping[int, float]] | None = None
    changes_sampling: bool = False
    aligned_to_tokens: bool = True
    per_step: bool = True

    def make_host(self) -> Any:
        from genartifact.testing import make_host

        return make_host(contents=[self.content])

    def engine(self, prompt: Sequence[int], completion: Sequence[int]) -> Any:
        return None

    def model(self) -> Any:
        from genartifact.testing import model_info

        return model_info()

    def session(self, prompt: Sequence[int] | None = None, completion: Sequence[int] | None = None) -> Any:
        from genartifact.testing import run_session

        p, c = list(prompt or self.prompt), list(completion or self.completion)
        return run_session(self.make_host(), [self.content], p, c, model=self.model(), engine=self.engine(p, c),
                           logprobs=self._logprobs(len(c)), per_step=self.per_step, sampling=dict(self.sampling))

    def _logprobs(self, n: int) -> Any:
        if self.logprobs is None or callable(self.logprobs):
            return self.logprobs
        return list(self.logprobs)[:n]

    # tests --------------------------------------------------------------------------------------------
    def test_strict_decode_round_trip(self) -> None:
        res = self.session()
        assert res.receipt["state"] == "ready", res.receipt
        art = res.artifact
        assert art.token_ids.tolist() == [*self.prompt, *self.completion]
        assert self.content in art.manifest["sections"]
        summary = art.summary()[self.content]
        json.dumps(summary)  # JSON-compatible
        art.content(self.content)  # the typed view (or tensors) is reachable

    def test_release_is_idempotent_and_clears_retained_bytes(self) -> None:
        res = self.session()
        for p in res.session._producers:
            p.release()
            p.release()
            assert p.retained_bytes() == 0

    def test_retained_never_exceeds_admitted(self) -> None:
        from genartifact.session import ArtifactSession
        from genartifact.spec import parse_request
        from genartifact.testing import deltas

        host = self.make_host()
        spec = {"format": "generation_artifact_v1", "contents": [self.content], "codec": "zstd",
                "delivery": {"mode": "object_store", "target": {"kind": "memory", "object_key": "k"}}}
        s = ArtifactSession.for_request(host, parse_request(spec), self.model(), {"memory": {}})
        s.admit(len(self.prompt), len(self.completion), sampling=dict(self.sampling))
        s.sampling_overrides(dict(self.sampling))
        for d in deltas(self.prompt, self.completion, per_step=True, logprobs=self._logprobs(len(self.completion))):
            s.record(d)
            for p in s._producers:
                assert p.retained_bytes() <= p.admitted
        s.release()

    def test_token_alignment_is_enforced_by_the_reader(self) -> None:
        if not self.aligned_to_tokens:
            pytest.skip("content not aligned to tokens")
        from genartifact import format as fmt

        res = self.session()
        art = res.artifact
        readers = res.session.host.content_readers()
        names = [n for n in art.tensors if n != "token_ids"]
        for extra in (1, -1):
            c = art.manifest["completion_token_count"] + extra
            if c < 0:
                continue
            ids = np.arange(art.manifest["prompt_token_count"] + c, dtype=np.uint32) % 7
            inp = fmt.ArtifactInput(ids, art.manifest["prompt_token_count"], [self.content],
                                    {self.content: art.manifest["sections"][self.content]},
                                    [fmt.TensorPart(n, np.array(art.tensors[n])) for n in names])
            with pytest.raises(ArtifactFormatError):
                fmt.encode(inp, readers=readers)

    def test_reader_rejects_missing_tensors(self) -> None:
        res = self.session()
        art = res.artifact
        reader = res.session.host.content_readers()[self.content]
        own = {k: v for k, v in art.tensors.items() if k.startswith(self.content + ".")}
        if not own:
            pytest.skip("content has no tensors")
        with pytest.raises(ArtifactFormatError):
            reader.validate(art.manifest, art.manifest["sections"][self.content], {})

    def test_no_sampling_change_unless_declared(self) -> None:
        if self.changes_sampling:
            pytest.skip("content declares that it changes sampling")
        res = self.session()
        after = {k: v for k, v in res.sampling.items() if k != "extra_args"}
        assert after == dict(self.sampling), f"sampling changed: {dict(self.sampling)} -> {after}"


__all__ = ["ContentConformance", "TargetConformance"]
