"""Conformance suites that a plugin's own tests subclass: the same bar the in-repo plugins are held to.

Targets (:class:`TargetConformance`): create-only, all-or-nothing, ``too_large`` before writing, ``validate``
free of side effects (no object; nothing created under the optional :meth:`TargetConformance.target_root`),
a delivery failing mid-write (opt-in fault injection :meth:`TargetConformance.fail_during_write`) or cancelled
mid-flight leaves nothing partial, receipt id = validated id, stable error codes, no secrets in repr, errors
(read-back's included) or logs (structlog events and stdlib ``logging`` records at DEBUG), read-back (``open``
bounded by ``max_bytes``, ``exists``) and conditional delete.

Contents (:class:`ContentConformance`): strict decode round trip through the plugin's reader (failures show
the receipt's ``error_code`` and ``error``), release idempotent, retained <= admitted at every delta, more
tokens than admitted refused or bounded, alignment with the token counts (a token more or fewer is rejected by
the reader), no sampling change unless declared, the reader rejects missing tensors, ``summary`` is a JSON
object and ``summary_text`` one line of text (isolated exactly as ``genartifact inspect`` isolates them).

Secrets are checked without ever placing them in an asserted expression: a leak fails with the secret's
index and length only.

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
import logging
import os
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


def _snapshot(root: Any, *, files_only: bool = False) -> set[str]:
    """Every path under ``root`` (relative; directories too unless ``files_only``); empty when ``root`` is None
    or absent."""
    if root is None or not os.path.isdir(root):
        return set()
    out = set()
    for d, dirs, files in os.walk(root):
        for n in files if files_only else [*dirs, *files]:
            out.add(os.path.relpath(os.path.join(d, n), root))
    return out


def _receipt_problem(receipt: Mapping[str, Any]) -> str:
    """The receipt's state, error_code and error (never truncated away), for assertion messages."""
    return (f"receipt state {receipt.get('state')!r}, error_code {receipt.get('error_code')!r}: "
            f"{receipt.get('error')!r} (the plugin_fault / artifact_* log lines above name the cause)")


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

    def _no_secret(self, text: str, where: str = "output") -> None:
        """Fail (never showing the secret) when any of :attr:`secrets` occurs in ``text``. The check is a
        boolean computed before the assertion, so pytest's assertion rewriting has no secret to print."""
        for i, secret in enumerate(self.secrets):
            leaked = bool(secret) and secret in text
            if leaked:
                pytest.fail(f"secrets[{i}] ({len(secret)} characters) leaked into the {where}", pytrace=False)

    def target_root(self) -> Any:
        """Optional: the local directory the target writes under (a :class:`pathlib.Path`), snapshotted around
        ``validate`` to prove it creates nothing. Default None: only ``exists`` (read-back) is checked."""
        return None

    def fail_during_write(self, target: Any, monkeypatch: Any) -> type[BaseException] | None:
        """Optional fault injection: patch ``target``'s write primitive with ``monkeypatch`` so that the next
        delivery fails after writing part of the bytes (e.g. make the file object's ``write`` raise after the
        first chunk, or the upload's second part fail), and return the exception type that will surface (a
        :class:`~genartifact.errors.DeliveryError` for a target that maps I/O errors). Default None: the
        all-or-nothing-under-failure test is skipped. The suite then requires that nothing is left at the key
        (``exists`` False; and no new file under :meth:`target_root`) and that a later delivery still works."""
        return None

    # tests --------------------------------------------------------------------------------------------
    def test_validate_is_side_effect_free_and_id_is_stable(self) -> None:
        t = self.guarded()
        spec = self.target_spec(self.fresh_key())
        root = self.target_root()
        before = _snapshot(root)
        a, b = t.validate(spec), t.validate(copy.deepcopy(spec))
        assert a.object_id == b.object_id and a.max_bytes == b.max_bytes >= 1
        created = sorted(_snapshot(root) - before)
        assert not created, f"validate() must be side-effect free; it created {created[:5]} under {root}"
        if self.read_back:
            assert _run(t.exists(a.object_id)) is False, "validate() must not create the object"

    def test_failure_mid_write_leaves_nothing(self, monkeypatch: Any) -> None:
        t = self.guarded()
        vt = t.validate(self.target_spec(self.fresh_key()))
        root = self.target_root()
        before = _snapshot(root, files_only=True)  # parent directories a delivery creates may stay
        with monkeypatch.context() as m:
            expected = self.fail_during_write(t.inner, m)
            if expected is None:
                pytest.skip("no fail_during_write(): all-or-nothing under a failing write not exercised")
            with pytest.raises(expected):
                _run(t.deliver(vt, self.payload, hashlib.sha256(self.payload).hexdigest()))
        left = sorted(_snapshot(root, files_only=True) - before)
        assert not left, f"a delivery that failed mid-write left {left[:5]} under {root}"
        if self.read_back:
            assert _run(t.exists(vt.object_id)) is False, "a delivery that failed mid-write left the object"
        sha = hashlib.sha256(self.payload).hexdigest()
        assert _run(t.deliver(vt, self.payload, sha)) == vt.object_id, "the key must stay writable after a failure"

    def test_cancelled_delivery_leaves_nothing_or_everything(self) -> None:
        t = self.guarded()
        vt = t.validate(self.target_spec(self.fresh_key()))
        sha = hashlib.sha256(self.payload).hexdigest()

        async def cancel_mid_flight() -> None:
            task = asyncio.ensure_future(t.deliver(vt, self.payload, sha))
            await asyncio.sleep(0)  # let the delivery start, then cancel it at its first await
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except (DeliveryError, TargetError):
                pass
            await asyncio.sleep(0.05)  # let any worker thread the delivery started finish

        _run(cancel_mid_flight())
        if not self.read_back:
            return
        if _run(t.exists(vt.object_id)):  # the write completed before the cancel: it must be whole
            data = _run(t.open(vt.object_id, len(self.payload)))
            assert data == self.payload, "a cancelled delivery left a partial object"

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
        with pytest.raises(TargetError) as e:
            _run(t.open(vt.object_id, 1 << 20))
        self._no_secret(str(e.value), "ObjectNotFound/TargetError message")

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

    def test_error_codes_are_stable_and_secrets_never_surface(self, caplog: Any) -> None:
        t = self.guarded()
        self._no_secret(repr(t.inner), "target repr")
        spec = self.target_spec(self.fresh_key())
        self._no_secret(repr(t.validate(spec)), "ValidatedTarget repr")
        missing_spec = self.target_spec(self.fresh_key())  # built outside the capture (test code may sign URLs)
        caplog.set_level(logging.DEBUG)  # stdlib logging of every library the target uses (fsspec, httpx, ...)
        errors: list[str] = []
        with structlog.testing.capture_logs() as logs:
            vt = t.validate(spec)
            self._no_secret(json.dumps(t.describe(vt), default=str), "describe() journal reference")
            _run(t.deliver(vt, self.payload, hashlib.sha256(self.payload).hexdigest()))
            other = self.payload[::-1]  # different bytes (a same-bytes retry may legitimately succeed)
            with pytest.raises(DeliveryError) as e:
                _run(t.deliver(vt, other, hashlib.sha256(other).hexdigest()))
            missing = t.validate(missing_spec)
            for call in (lambda: t.open(missing.object_id, 1 << 20), lambda: t.exists(missing.object_id),
                         lambda: t.delete(missing.object_id, "0" * 64)):
                try:
                    _run(call())
                except (TargetError, DeliveryError) as err:
                    errors.append(f"{type(err).__name__}: {err}")
        code = e.value.code
        assert code in ERROR_MESSAGES, f"code {code!r} is not a documented receipt code"
        self._no_secret(str(e.value), "DeliveryError message")
        self._no_secret("\n".join(errors), "read-back error messages")
        self._no_secret(json.dumps(logs, default=str), "structlog events")
        self._no_secret("\n".join(f"{r.name}: {r.getMessage()} {r.args!r}" for r in caplog.records),
                        "stdlib log records")


class ContentConformance:
    """Subclass with a ``Test`` name; set :attr:`content` and implement :meth:`make_host` if the plugin is not
    installed (default: the installed plugin of that name plus the kit's memory target).

    Optional overrides: :meth:`engine` (a :class:`~genartifact.testing.FakeEngine` answering the content's
    worker calls for ``prompt``/``completion``), :meth:`model` (the ``ModelInfo`` the producer is admitted
    against; default :func:`genartifact.testing.model_info` with no arguments — pass ``worker_captures=[...]``
    to it, which replaces the default list, when your ``admit`` checks that a worker captures your content), and
    the class attributes:

    * :attr:`sampling` — the request's sampling parameters (``{"temperature": 1.0}``; e.g. add ``"logprobs": 5``
      for a content that reads the top-5 logprobs of each delta);
    * :attr:`prompt`, :attr:`completion` — the token ids of the request every case runs (a few ids each);
    * :attr:`logprobs` — per completion token the sampled token's logprob, or a function ``(position, token) ->
      {token_id: logprob}``, fed through the deltas (None: no logprobs in the deltas);
    * :attr:`changes_sampling` — True if the content must change the engine's sampling parameters beyond
      ``extra_args`` (the suite otherwise checks it does not);
    * :attr:`aligned_to_tokens` — False if its tensors do not depend on the token counts (the suite otherwise
      checks that the reader refuses a section whose tensors disagree with them);
    * :attr:`per_step` — deliver one delta per token (True) or a single final delta (False);
    * :attr:`capture_key` — for a content captured in the workers, its ``WorkerCapture.capture_key`` (the
      ``SamplingParams.extra_args`` key whose value is the request's capture id): the suite then checks that each
      request gets its own capture id of the form the workers accept, and that a request ending without its rows
      fetched discards them through :meth:`engine`'s ``"<content>.discard"`` verb.

    Every content is also checked to keep the ``extra_args`` it is given (the caller's, another content's): a
    producer adds its keys, it never replaces the dict."""

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
    #: the worker capture's ``capture_key`` (``SamplingParams.extra_args``), for a content captured in the workers
    capture_key: str | None = None

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

    def ready_session(self, prompt: Sequence[int] | None = None, completion: Sequence[int] | None = None) -> Any:
        """:meth:`session` that must end ``ready``; otherwise the test fails with the receipt's state,
        ``error_code`` and ``error`` (tests that need the artifact use this, so they fail with the cause
        instead of an ``AttributeError`` on a missing artifact)."""
        res = self.session(prompt, completion)
        if res.receipt.get("state") != "ready" or res.artifact is None:
            pytest.fail(f"content {self.content!r}: the round trip did not produce an artifact: "
                        f"{_receipt_problem(res.receipt)}", pytrace=False)
        return res

    def _logprobs(self, n: int) -> Any:
        if self.logprobs is None or callable(self.logprobs):
            return self.logprobs
        return list(self.logprobs)[:n]

    # tests --------------------------------------------------------------------------------------------
    def test_strict_decode_round_trip(self) -> None:
        res = self.ready_session()
        art = res.artifact
        assert art.token_ids.tolist() == [*self.prompt, *self.completion]
        assert art.completion_token_count == len(self.completion)
        assert self.content in art.manifest["sections"]
        art.content(self.content)  # the typed view (or tensors) is reachable, isolated like inspect's

    def test_reader_summary_and_summary_text(self) -> None:
        """What ``genartifact inspect`` (and ``--json``) calls, isolated the same way: ``summary`` returns a
        JSON object, ``summary_text`` (optional) one line of text, ``view`` (optional) does not raise."""
        from genartifact.errors import PluginFault

        art = self.ready_session().artifact
        try:
            summary = art.content_summary(self.content)
            text = art._reader(self.content).summary_text(summary)
            art.content(self.content)
        except PluginFault as e:
            pytest.fail(f"inspect would isolate this reader as a plugin fault: {e}", pytrace=False)
        json.dumps(summary, allow_nan=False)
        assert isinstance(text, str) and "\n" not in text.strip(), "summary_text must return one line of text"

    def test_recording_past_max_tokens_is_bounded(self) -> None:
        """Drive more completion tokens than admitted: the content must refuse (``CaptureError``) or keep
        its retained bytes within what it admitted — never grow without a bound. The producer is fed past the
        session's own ``max_tokens`` check, and with more tokens than its largest admitted byte count (at most
        65,536), so a content that keeps even one byte per token without a bound of its own exceeds what it
        admitted (with a few tokens only, the slack of its section's bytes hid such a content)."""
        from genartifact.errors import CaptureError
        from genartifact.session import ArtifactSession
        from genartifact.spec import parse_request
        from genartifact.testing import deltas

        host = self.make_host()
        spec = {"format": "generation_artifact_v1", "contents": [self.content], "codec": "zstd",
                "delivery": {"mode": "object_store", "target": {"kind": "memory", "object_key": "k"}}}
        s = ArtifactSession.for_request(host, parse_request(spec), self.model(), {"memory": {}})
        admitted_tokens = max(1, len(self.completion) // 2)
        s.admit(len(self.prompt), admitted_tokens, sampling=dict(self.sampling))
        s.sampling_overrides(dict(self.sampling))
        if not any(p.consumes_deltas for p in s._producers):
            s.release()
            pytest.skip("content takes no deltas (consumes_deltas = False): nothing to feed past max_tokens; its "
                        "bytes are bounded at finalize by the host's admitted-bytes rule")
        n = max(4 * len(self.completion), min(1 << 16, 1 + max((p.admitted or 0) for p in s._producers)))
        over = (list(self.completion) * (n // len(self.completion) + 1))[:n]
        try:
            for d in deltas(self.prompt, over, per_step=True, logprobs=self._logprobs_for(over)):
                try:
                    for p in s._producers:  # the producer itself, past the session's own token check
                        if p.consumes_deltas:  # the host never feeds a content that declared it takes none
                            p.on_delta(d)
                except CaptureError:
                    return
                for p in s._producers:
                    held, limit = p.retained_bytes(), p.admitted
                    assert held <= limit, (f"{self.content} retains {held} bytes after more tokens than "
                                           f"admitted ({admitted_tokens}); admitted {limit}")
        finally:
            s.release()

    def _logprobs_for(self, completion: Sequence[int]) -> Any:
        if self.logprobs is None or callable(self.logprobs):
            return self.logprobs
        lp = list(self.logprobs)
        return [lp[i % len(lp)] for i in range(len(completion))] if lp else None

    def test_deltas_of_several_tokens_round_trip(self) -> None:
        """Per-step deltas that carry several tokens each, as vLLM's DELTA output does whenever the driver's loop
        took a request's output after more than one engine step: the content must still end ``ready``, aligned
        to every completion token (a content that keeps one value per delta instead of one per token fails here,
        or in its reader, instead of in production). Runs on a completion of at least 7 tokens, split 1, 2, 3, ..."""
        from genartifact.testing import deltas, run_session

        if not self.per_step:
            pytest.skip("the suite feeds this content one final delta (per_step = False)")
        completion = list(self.completion)
        while len(completion) < 7:
            completion += list(self.completion)
        sizes, left, k = [], len(completion), 1
        while left:
            sizes.append(min(k, left))
            left -= sizes[-1]
            k += 1
        p = list(self.prompt)
        lps = self._logprobs_for(completion)
        res = run_session(self.make_host(), [self.content], p, completion, model=self.model(),
                          engine=self.engine(p, completion), logprobs=lps, sampling=dict(self.sampling),
                          deltas_=deltas(p, completion, logprobs=lps, sizes=sizes))
        if res.receipt.get("state") != "ready" or res.artifact is None:
            pytest.fail(f"content {self.content!r}: deltas of {sizes} tokens did not produce an artifact: "
                        f"{_receipt_problem(res.receipt)}", pytrace=False)
        assert res.artifact.completion_token_count == len(completion)

    def test_release_is_idempotent_and_clears_retained_bytes(self) -> None:
        res = self.ready_session()
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

        res = self.ready_session()
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
        res = self.ready_session()
        art = res.artifact
        reader = res.session.host.content_readers()[self.content]
        own = {k: v for k, v in art.tensors.items() if k.startswith(self.content + ".")}
        if not own:
            pytest.skip("content has no tensors")
        with pytest.raises(ArtifactFormatError):
            reader.validate(art.manifest, art.manifest["sections"][self.content], {})

    def _overridden(self, sampling: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
        """A fresh session of this content admitted for :attr:`prompt`/:attr:`completion` and its producers'
        sampling overrides of (a copy of) ``sampling``: ``(session, params)``."""
        from genartifact.testing import new_session

        s = new_session(self.make_host(), [self.content], model=self.model())
        params = copy.deepcopy(dict(sampling))
        s.admit(len(self.prompt), len(self.completion), sampling=params)
        s.sampling_overrides(params)
        return s, params

    def test_extra_args_of_others_are_kept(self) -> None:
        """vLLM has one ``extra_args`` dict per request, shared by the caller and every content: a producer adds its
        keys and keeps the others (a producer that replaced the dict dropped another content's capture id, whose
        worker then never saw the request)."""
        theirs = {"callers_key": "kept", "genartifact_other_content_id": "0123abcd"}
        s, params = self._overridden({**self.sampling, "extra_args": dict(theirs)})
        s.release()
        extra = params.get("extra_args") or {}
        lost = {k: v for k, v in theirs.items() if extra.get(k) != v}
        assert not lost, f"content {self.content!r}: sampling_overrides dropped or changed extra_args {sorted(lost)}"

    def test_capture_id_is_per_request_and_one_the_workers_accept(self) -> None:
        if self.capture_key is None:
            pytest.skip("no capture_key: not a worker-captured content")
        from genartifact.engine.worker_ext import CAPTURE_ID_PATTERN

        ids = []
        for _ in range(3):
            s, params = self._overridden(self.sampling)
            s.release()
            cid = (params.get("extra_args") or {}).get(self.capture_key)
            assert isinstance(cid, str) and CAPTURE_ID_PATTERN.fullmatch(cid), (
                f"content {self.content!r}: extra_args[{self.capture_key!r}] is {type(cid).__name__} of "
                f"{len(cid) if isinstance(cid, str) else 0} characters; workers accept only 1-128 of [A-Za-z0-9_-] "
                f"(CAPTURE_ID_PATTERN) and run any other request uncaptured")
            ids.append(cid)
        assert len(set(ids)) == len(ids), (f"content {self.content!r}: requests share a capture id; each request "
                                           f"needs its own (a worker refuses an id held for another request)")

    def test_a_request_ending_unfetched_discards_its_worker_rows(self) -> None:
        """A request that ends without its rows fetched (aborted, failed, cancelled) must discard them, or its
        worker keeps them until the engine stops."""
        if self.capture_key is None:
            pytest.skip("no capture_key: not a worker-captured content")
        from genartifact.testing import deltas, run_session

        p, c = list(self.prompt), list(self.completion)
        eng = self.engine(p, c)
        if eng is None or not hasattr(eng, "calls"):
            pytest.skip("engine() gives no FakeEngine to watch the discard")
        ds = deltas(p, c, per_step=self.per_step, logprobs=self._logprobs(len(c)), finish_reason="abort")
        res = run_session(self.make_host(), [self.content], p, c, model=self.model(), engine=eng, deltas_=ds,
                          sampling=dict(self.sampling))
        assert res.receipt.get("state") == "failed", _receipt_problem(res.receipt)
        cid = (res.sampling.get("extra_args") or {}).get(self.capture_key)
        discards = [a for m, a in eng.calls if m == f"{self.content}.discard"]
        assert discards and str(discards[-1][0]) == str(cid), (
            f"content {self.content!r}: an aborted request did not discard its worker rows "
            f"(worker calls: {[m for m, _ in eng.calls]})")

    def test_no_sampling_change_unless_declared(self) -> None:
        if self.changes_sampling:
            pytest.skip("content declares that it changes sampling")
        res = self.session()
        after = {k: v for k, v in res.sampling.items() if k != "extra_args"}
        assert after == dict(self.sampling), f"sampling changed: {dict(self.sampling)} -> {after}"


__all__ = ["ContentConformance", "TargetConformance"]
