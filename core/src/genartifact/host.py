"""The plugin host: discover entry points, select by config list, load only what is selected, check each
plugin at load time, register with a private pluggy ``PluginManager``, and expose a typed facade through which
every call into a plugin is isolated.

Discovery reads ``importlib.metadata`` only; no plugin module is imported until it is selected.

Run order: pluggy calls implementations last-registered-first, so the host imports plugins in config order
and then registers them in *reverse* config order; every hook (pluggy's own ``pm.hook.*`` calls as well as the
facade) then runs in config order (``tryfirst``/``trylast`` keep their meaning).

Fault isolation: every call from the host into a plugin goes through :func:`call_plugin` /
:func:`acall_plugin` or a guarded wrapper (:class:`GuardedProducer`, :class:`GuardedTarget`). An exception
outside the method's documented set, or a wrong return value, becomes a :class:`PluginFault` naming the plugin
(name, distribution, version), the method and the exception type, with the message redacted; callers turn it
into that request's ``failed`` receipt with ``error_code: internal_error``.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib.metadata as md
import inspect
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pluggy
import structlog

from genartifact.errors import (
    AdmissionError,
    ArtifactFormatError,
    CaptureError,
    ConfigError,
    DeliveryError,
    DuplicatePluginError,
    PluginFault,
    PluginLoadError,
    RequestSpecError,
    TargetError,
    UnknownPluginError,
)
from genartifact.format import TensorPart
from genartifact.hookspecs import ALL_SPECS, PROJECT
from genartifact.types import ValidatedTarget, content_section_bytes

log = structlog.get_logger("genartifact.host")

KINDS: dict[str, str] = {
    "contents": "genartifact.contents",
    "targets": "genartifact.targets",
    "probes": "genartifact.probes",
}
#: Every entry-point group, including CLI commands (which are not selected by config: installed = available).
GROUPS: dict[str, str] = {**KINDS, "commands": "genartifact.commands"}
_SINGULAR = {"contents": "content", "targets": "target", "probes": "probe", "commands": "command"}
_IN_PROCESS = "<in-process>"


@dataclass(frozen=True)
class PluginInfo:
    """One discovered plugin: ``kind`` (contents/targets/probes/commands), ``name`` (entry-point name),
    ``dist``/``version`` of the providing distribution, ``value`` (``module[:attr]``)."""

    kind: str
    name: str
    dist: str
    version: str
    value: str

    def label(self) -> str:
        return f"{self.name} ({self.dist} {self.version})"

    @property
    def entry_point(self) -> str:
        """``group: name = value`` as written in the distribution's metadata."""
        return f"{GROUPS[self.kind]}: {self.name} = {self.value}"


def normalize(name: str) -> str:
    """Plugin names compare with ``-`` and ``_`` equivalent (``moe-routes`` == ``moe_routes``)."""
    return name.strip().replace("-", "_")


EntryPointSource = Callable[[str], Iterable[Any]]


def _default_source(group: str) -> Iterable[Any]:
    return md.entry_points(group=group)


def discover(kind: str, source: EntryPointSource = _default_source) -> dict[str, tuple[PluginInfo, Any]]:
    """Map name -> (info, entry point) for ``kind`` without importing anything.

    The same distribution seen twice (e.g. duplicate ``sys.path`` entries) is de-duplicated; two
    different distributions claiming one name raise :class:`DuplicatePluginError` naming both.
    """
    found: dict[str, tuple[PluginInfo, Any]] = {}
    for ep in source(GROUPS[kind]):
        dist = getattr(ep, "dist", None)
        info = PluginInfo(
            kind=kind,
            name=normalize(ep.name),
            dist=getattr(dist, "name", None) or "unknown",
            version=getattr(dist, "version", None) or "unknown",
            value=ep.value,
        )
        prev = found.get(info.name)
        if prev is not None:
            if prev[0].dist == info.dist:
                continue
            raise DuplicatePluginError(
                f"{_SINGULAR[kind]} '{info.name}' is provided by two distributions: "
                f"{prev[0].dist} {prev[0].version} ({prev[0].value}) and {info.dist} {info.version} ({info.value}); "
                f"uninstall one"
            )
        found[info.name] = (info, ep)
    return found


def unknown_plugin_message(kind: str, name: str, installed: Mapping[str, PluginInfo], where: str,
                           listed: str = "installed") -> str:
    """The error text for an unknown plugin name: kind, name, where it was named, the plugins ``installed`` (or, with
    ``listed="enabled"``, the enabled ones it may name), and the closest of their names."""
    listing = ", ".join(i.label() for i in sorted(installed.values(), key=lambda i: i.name)) or "none"
    msg = f"unknown {_SINGULAR[kind]} '{name}' in {where}; {listed}: {listing}"
    close = difflib.get_close_matches(normalize(name), list(installed), n=1, cutoff=0.5)
    if close:
        msg += f"; did you mean '{close[0]}'?"
    return msg


# ------------------------------------------------------------------------------------------ redaction
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*://)([^\s/?#@]*@)?([^\s/?#]*)([^\s?#]*)(\?[^\s#]*)?(#\S*)?")
#: ``key=value`` / ``key: value`` (also a quoted key, as in a printed dict or JSON, and ``%3D``, an encoded ``=``) whose
#: key names a secret; the value quoted, or up to the next separator, after an auth scheme if one leads it
#: (``Authorization: Bearer <token>``); ``sig`` is Azure SAS's signature parameter
_SECRET_KV = re.compile(
    r"(?i)([\"']?\b(?:[A-Za-z0-9_-]*(?:signature|token|secret|password|passwd|credential|authorization|"
    r"api[_-]?key|access[_-]?key|session)[A-Za-z0-9_-]*|sig)[\"']?)(\s*[=:]\s*|%3D)"
    r"((?:(?:bearer|basic|digest|negotiate|aws4-hmac-sha256)\s+)?(?:\"[^\"]*\"|'[^']*'|[^\s,;&'\"]+))")


def redact(text: str, limit: int = 500) -> str:
    """``text`` with secrets removed: URL user-info and query strings (presigned URLs carry their signature
    there), and values of ``key=value`` / ``key: value`` pairs (a quoted key too, as a printed dict or JSON
    shows it; ``%3D`` for ``=``) whose key names a signature (``sig`` included), token, secret, password,
    credential, authorization, API/access key or session, with the auth scheme that leads a value (``Bearer
    <token>``). Truncated to ``limit`` characters."""
    def url(m: re.Match[str]) -> str:
        return m.group(1) + ("<redacted>@" if m.group(2) else "") + m.group(3) + m.group(4) + (
            "?<redacted>" if m.group(5) else "")

    out = _SECRET_KV.sub(lambda m: m.group(1) + m.group(2) + "<redacted>", _URL.sub(url, str(text)))
    return out if len(out) <= limit else out[:limit] + "..."


# ------------------------------------------------------------------------------------------ fault isolation
def fault(info: PluginInfo | None, method: str, exc: BaseException | None = None, *, problem: str = "") -> PluginFault:
    """Build (and log, once) the :class:`PluginFault` for ``info``'s ``method``: either the unexpected
    exception ``exc`` or a contract ``problem`` (bad return value)."""
    who = info.label() if info is not None else "unknown plugin"
    kind = _SINGULAR.get(info.kind, "") if info is not None else ""
    if exc is not None:
        etype, detail = type(exc).__name__, redact(str(exc))
        msg = f"{kind} plugin {who} raised {etype} in {method}: {detail}"
    else:
        etype, detail = "bad_return", redact(problem)
        msg = f"{kind} plugin {who} broke the {method} contract: {detail}"
    log.error("plugin_fault", plugin=info.name if info else None, dist=info.dist if info else None,
              version=info.version if info else None, method=method, error_type=etype, error=detail)
    return PluginFault(msg.strip(), plugin=who, method=method, error_type=etype)


def call_plugin(info: PluginInfo | None, method: str, fn: Callable[..., Any], *args: Any,
                expected: tuple[type[BaseException], ...] = (), **kwargs: Any) -> Any:
    """Call ``fn(*args, **kwargs)`` of plugin ``info``. Exceptions in ``expected`` (and :class:`PluginFault`)
    propagate unchanged; any other ``Exception`` becomes a :class:`PluginFault`."""
    try:
        return fn(*args, **kwargs)
    except PluginFault:
        raise
    except expected:
        raise
    except Exception as e:  # noqa: BLE001 - isolated: attributed to the plugin
        raise fault(info, method, e) from e


async def acall_plugin(info: PluginInfo | None, method: str, fn: Callable[..., Any], *args: Any,
                       expected: tuple[type[BaseException], ...] = (), **kwargs: Any) -> Any:
    """Async twin of :func:`call_plugin` (``fn`` returns an awaitable)."""
    try:
        res = fn(*args, **kwargs)
        if not inspect.isawaitable(res):
            raise fault(info, method, problem=f"returned {type(res).__name__}, expected an awaitable (async def)")
        return await res
    except PluginFault:
        raise
    except expected:
        raise
    except Exception as e:  # noqa: BLE001 - isolated: attributed to the plugin
        raise fault(info, method, e) from e


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


class GuardedProducer:
    """A content producer as the session sees it: every method isolated, return values checked.

    Checks: ``admit`` returns an int >= 0 (bytes); ``retained_bytes`` an int in ``0..admitted``; ``finalize``
    a ``(dict, list[TensorPart])`` whose tensors are named ``"<content>.<tensor>"``, are numpy arrays, and
    whose tensor bytes plus the section's canonical-JSON bytes (:func:`content_section_bytes`) total at most
    the admitted bytes — the one over-admission rule; a breach is a plugin fault (``internal_error``). Documented exceptions pass through: ``AdmissionError`` from
    ``admit``/``sampling_overrides``, ``CaptureError`` from ``on_delta``/``collect``/``finalize``."""

    def __init__(self, inner: Any, info: PluginInfo | None, name: str) -> None:
        self.inner, self.info, self.name = inner, info, name
        self.admitted: int | None = None

    def __repr__(self) -> str:
        return f"GuardedProducer({self.name!r}, {self.info.label() if self.info else '?'})"

    @property
    def per_step_deltas(self) -> bool:
        """True if the content needs one delta per engine step (optional attribute ``per_step_deltas`` of the
        producer, default False). :raises PluginFault: the attribute raises or is not a bool (see :meth:`_flag`)."""
        return self._flag("per_step_deltas", False)

    @property
    def consumes_deltas(self) -> bool:
        """False if the producer declares ``consumes_deltas = False`` (it takes nothing from deltas; its data comes
        from ``collect``): the session then skips its ``on_delta`` and per-delta ``retained_bytes``. Default True.
        :raises PluginFault: the attribute raises or is not a bool (see :meth:`_flag`)."""
        return self._flag("consumes_deltas", True)

    def _flag(self, attr: str, default: bool) -> bool:
        """The producer's optional boolean attribute ``attr`` (``default`` when absent). Only ``True``/``False``
        (or a numpy bool scalar) count: anything else (``None``, ``0``, the string ``"False"``...) is a plugin
        fault rather than a guess, since a wrong guess silently drops or floods the content's deltas."""
        try:
            v = getattr(self.inner, attr, default)
        except Exception as e:  # noqa: BLE001 - isolated: attributed to the plugin
            raise fault(self.info, attr, e) from e
        if v is True or v is False:
            return v
        if type(v).__module__ == "numpy" and type(v).__name__ in ("bool", "bool_"):  # numpy.bool_ (numpy 1 and 2)
            return bool(v)
        raise fault(self.info, attr, problem=f"is {v!r:.80}; allowed: True or False")

    def admit(self, ctx: Any) -> int:
        n = call_plugin(self.info, "admit", self.inner.admit, ctx, expected=(AdmissionError,))
        if not _is_count(n):
            raise fault(self.info, "admit", problem=f"returned {n!r}; expected the worst-case bytes (int >= 0)")
        self.admitted = n
        return n

    def sampling_overrides(self, params: dict[str, Any]) -> None:
        call_plugin(self.info, "sampling_overrides", self.inner.sampling_overrides, params, expected=(AdmissionError,))

    def on_delta(self, delta: Any) -> None:
        call_plugin(self.info, "on_delta", self.inner.on_delta, delta, expected=(CaptureError,))

    async def collect(self, final: Any) -> None:
        await acall_plugin(self.info, "collect", self.inner.collect, final, expected=(CaptureError,))

    def finalize(self, final: Any) -> tuple[dict[str, Any], list[Any]]:
        res = call_plugin(self.info, "finalize", self.inner.finalize, final, expected=(CaptureError,))
        if not (isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], dict) and isinstance(res[1], list)):
            raise fault(self.info, "finalize", problem=f"returned {type(res).__name__}; expected (dict section, "
                                                       f"list of TensorPart)")
        section, parts = res
        tensor_bytes = 0
        for t in parts:
            if not isinstance(t, TensorPart) or not isinstance(t.array, np.ndarray):
                raise fault(self.info, "finalize", problem=f"tensor {t!r:.80} is not a TensorPart of a numpy array")
            if not t.name.startswith(self.name + "."):
                raise fault(self.info, "finalize", problem=f"tensor {t.name!r} must be named '{self.name}.<tensor>'")
            tensor_bytes += t.array.nbytes
        # a section JSON cannot carry is the encoder's to reject (``encode_failed``); it counts 0 here
        section_bytes = content_section_bytes(section) or 0
        total = tensor_bytes + section_bytes
        if self.admitted is not None and total > self.admitted:
            raise fault(self.info, "finalize", problem=f"tensors ({tensor_bytes} bytes) + manifest section "
                                                       f"({section_bytes} bytes) = {total} bytes; admit() declared "
                                                       f"at most {self.admitted}")
        return section, parts

    def retained_bytes(self) -> int:
        n = call_plugin(self.info, "retained_bytes", self.inner.retained_bytes)
        if not _is_count(n):
            raise fault(self.info, "retained_bytes", problem=f"returned {n!r}; expected an int >= 0")
        if self.admitted is not None and n > self.admitted:
            raise fault(self.info, "retained_bytes", problem=f"retains {n} bytes; admit() declared at most {self.admitted}")
        return n

    def release(self) -> None:
        """Never raises: a failing ``release`` is logged as a plugin fault (cleanup must not mask outcomes)."""
        try:
            call_plugin(self.info, "release", self.inner.release)
        except PluginFault:
            pass

    async def discard(self, engine: Any) -> None:
        """The producer's optional ``discard(engine)`` (drop engine-side state); faults are logged, not raised."""
        fn = getattr(self.inner, "discard", None)
        if fn is None:
            return
        try:
            await acall_plugin(self.info, "discard", fn, engine)
        except PluginFault:
            pass


class GuardedTarget:
    """A storage target as the host sees it: every method isolated, return values checked.

    ``validate`` must return a :class:`~genartifact.types.ValidatedTarget` of this kind with ``max_bytes`` an int
    >= 1 and a non-empty string ``object_id``; ``deliver`` must return exactly that ``object_id`` (the receipt
    always carries the validated id). Documented exceptions pass through: ``TargetError`` (validate, deliver,
    read-back), ``DeliveryError`` (deliver, read-back)."""

    def __init__(self, inner: Any, info: PluginInfo | None, kind: str) -> None:
        self.inner, self.info, self.kind = inner, info, kind

    def __repr__(self) -> str:
        return f"GuardedTarget({self.kind!r}, {self.info.label() if self.info else '?'})"

    def validate(self, spec: Mapping[str, Any]) -> Any:
        vt = call_plugin(self.info, "validate", self.inner.validate, spec, expected=(TargetError,))
        if not isinstance(vt, ValidatedTarget):
            raise fault(self.info, "validate", problem=f"returned {type(vt).__name__}; expected ValidatedTarget")
        if normalize(vt.kind) != self.kind:
            raise fault(self.info, "validate", problem=f"ValidatedTarget.kind {vt.kind!r} != target kind {self.kind!r}")
        if not _is_count(vt.max_bytes) or vt.max_bytes < 1:
            raise fault(self.info, "validate", problem=f"ValidatedTarget.max_bytes {vt.max_bytes!r}; expected int >= 1")
        if not isinstance(vt.object_id, str) or not vt.object_id:
            raise fault(self.info, "validate", problem="ValidatedTarget.object_id must be a non-empty string")
        return vt

    def describe(self, target: Any) -> dict[str, Any]:
        """The target's optional non-secret journal reference (``{}`` when it has no ``describe``)."""
        fn = getattr(self.inner, "describe", None)
        if fn is None:
            return {}
        ref = call_plugin(self.info, "describe", fn, target)
        if not isinstance(ref, dict):
            raise fault(self.info, "describe", problem=f"returned {type(ref).__name__}; expected a dict")
        return ref

    async def deliver(self, target: Any, data: bytes, sha256: str) -> str:
        oid = await acall_plugin(self.info, "deliver", self.inner.deliver, target, data, sha256,
                                 expected=(DeliveryError, TargetError))
        if oid != target.object_id:
            shown = repr(oid) if isinstance(oid, str | int | type(None)) else type(oid).__name__
            raise fault(self.info, "deliver", problem=f"returned {redact(shown, 100)}; expected the validated "
                                                      f"object_id (a string)")
        return str(oid)

    def __getattr__(self, name: str) -> Any:
        """Other public methods of the target (e.g. ``leftovers``), isolated the same way (no return checks)."""
        if name.startswith("_"):
            raise AttributeError(name)
        fn = getattr(self.inner, name)
        if not callable(fn):
            return fn
        if inspect.iscoroutinefunction(fn):
            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                return await acall_plugin(self.info, name, fn, *args, expected=(TargetError, DeliveryError), **kwargs)
            return guarded_async

        def guarded(*args: Any, **kwargs: Any) -> Any:
            return call_plugin(self.info, name, fn, *args, expected=(TargetError, DeliveryError), **kwargs)
        return guarded

    def _read_method(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.inner, name, None)
        if fn is None:
            raise TargetError(f"target kind '{self.kind}' ({self.info.label() if self.info else '?'}) cannot "
                              f"read objects back: it has no {name}()")
        return fn

    async def open(self, object_id: str, max_bytes: int) -> bytes:
        """Read back at most ``max_bytes`` bytes of ``object_id``; raises ``TargetError``/``DeliveryError``."""
        data = await acall_plugin(self.info, "open", self._read_method("open"), object_id, max_bytes,
                                  expected=(TargetError, DeliveryError))
        if not isinstance(data, bytes | bytearray | memoryview):
            raise fault(self.info, "open", problem=f"returned {type(data).__name__}; expected bytes")
        if len(data) > max_bytes:
            raise fault(self.info, "open", problem=f"returned {len(data)} bytes; max_bytes was {max_bytes}")
        return bytes(data)

    async def exists(self, object_id: str) -> bool:
        res = await acall_plugin(self.info, "exists", self._read_method("exists"), object_id,
                                 expected=(TargetError, DeliveryError))
        if not isinstance(res, bool):
            raise fault(self.info, "exists", problem=f"returned {type(res).__name__}; expected bool")
        return res

    async def delete(self, object_id: str, sha256: str) -> bool:
        res = await acall_plugin(self.info, "delete", self._read_method("delete"), object_id, sha256,
                                 expected=(TargetError, DeliveryError))
        if not isinstance(res, bool):
            raise fault(self.info, "delete", problem=f"returned {type(res).__name__}; expected bool")
        return res


class GuardedReader:
    """A content reader as callers see it: ``summary``, ``summary_text`` and ``view`` isolated like every other
    plugin call (an exception or a wrong return value becomes a :class:`PluginFault` naming the plugin);
    ``validate`` lets ``ArtifactFormatError`` (the content is invalid) through and turns any other exception into a
    :class:`PluginFault` (the reader is broken): at encode that request's receipt is ``internal_error``; at decode
    :mod:`genartifact.format` reports it as a format error naming the content and the plugin.

    ``summary(manifest, section, tensors)`` -> JSON-compatible dict (absent: ``{"tensors": [names]}``);
    ``summary_text(summary)`` -> one line of text (absent: the summary as sorted JSON);
    ``view(manifest, section, tensors)`` -> the reader's typed view (absent: the tensors dict)."""

    def __init__(self, inner: Any, info: PluginInfo | None, name: str) -> None:
        self.inner, self.info, self.name = inner, info, name

    def __repr__(self) -> str:
        return f"GuardedReader({self.name!r}, {self.info.label() if self.info else '?'})"

    def validate(self, manifest: Mapping[str, Any], section: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
        call_plugin(self.info, "validate", self.inner.validate, manifest, section, tensors,
                    expected=(ArtifactFormatError,))

    def summary(self, manifest: Mapping[str, Any], section: Mapping[str, Any],
                tensors: Mapping[str, Any]) -> dict[str, Any]:
        import json

        fn = getattr(self.inner, "summary", None)
        if fn is None:
            return {"tensors": sorted(tensors)}
        res = call_plugin(self.info, "summary", fn, manifest, section, tensors)
        try:
            if not isinstance(res, dict):
                raise TypeError(type(res).__name__)
            json.dumps(res, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise fault(self.info, "summary", problem=f"returned a value that is not a JSON object ({e})") from None
        return res

    def summary_text(self, summary: Mapping[str, Any]) -> str:
        import json

        fn = getattr(self.inner, "summary_text", None)
        if fn is None:
            return json.dumps(summary, sort_keys=True)
        res = call_plugin(self.info, "summary_text", fn, summary)
        if not isinstance(res, str):
            raise fault(self.info, "summary_text", problem=f"returned {type(res).__name__}; expected str")
        return res

    def view(self, manifest: Mapping[str, Any], section: Mapping[str, Any], tensors: Mapping[str, Any]) -> Any:
        fn = getattr(self.inner, "view", None)
        if fn is None:
            return tensors
        return call_plugin(self.info, "view", fn, manifest, section, tensors)


def guard_reader(reader: Any, info: PluginInfo | None, name: str) -> Any:
    """``reader`` wrapped in a :class:`GuardedReader` (None and already guarded readers unchanged)."""
    if reader is None or isinstance(reader, GuardedReader):
        return reader
    return GuardedReader(reader, info, name)


_PRODUCER_METHODS = ("admit", "sampling_overrides", "on_delta", "collect", "finalize", "retained_bytes", "release")
_TARGET_METHODS = ("validate", "deliver")


class Hooks:
    """Typed facade over the plugin manager's hooks; the only way call sites reach plugins. Every hook runs
    its implementations in config order, each call isolated (see :func:`call_plugin`)."""

    def __init__(self, pm: pluggy.PluginManager, infos: Mapping[str, PluginInfo] | None = None) -> None:
        self._pm = pm
        self._infos = dict(infos or {})

    def _impls(self, hook: str) -> list[Any]:
        """Implementations of ``hook`` in call order (pluggy calls ``get_hookimpls()`` last-first)."""
        return list(reversed(getattr(self._pm.hook, hook).get_hookimpls()))

    def info_of(self, plugin_name: str) -> PluginInfo | None:
        return self._infos.get(plugin_name)

    def _call(self, hook: str, kwargs: Mapping[str, Any], *, first: bool,
              expected: tuple[type[BaseException], ...] = ()) -> Any:
        results = []
        for impl in self._impls(hook):
            info = self.info_of(impl.plugin_name)
            res = call_plugin(info, hook, impl.function, *[kwargs[a] for a in impl.argnames], expected=expected)
            if res is not None:
                if first:
                    return res, info
                results.append(res)
        return (None, None) if first else results

    def content_producer(self, name: str, model: Any, settings: Mapping[str, Any] | None = None) -> Any:
        """The guarded producer of content ``name`` (or None). Raises :class:`PluginFault` if the factory
        raised or returned an object without the producer methods or with another ``name``."""
        p, info = self._call("genartifact_content_producer", {"name": name, "model": model,
                                                               "settings": dict(settings or {})},
                             first=True, expected=(ConfigError, AdmissionError))
        if p is None:
            return None
        missing = [m for m in _PRODUCER_METHODS if not callable(getattr(p, m, None))]
        if missing:
            raise fault(info, "genartifact_content_producer",
                        problem=f"returned {type(p).__name__} without method(s) {missing}")
        if normalize(str(getattr(p, "name", ""))) != name:
            raise fault(info, "genartifact_content_producer",
                        problem=f"producer.name {getattr(p, 'name', None)!r} != requested content {name!r}")
        return GuardedProducer(p, info, name)

    def engine_options(self, options: dict[str, Any], worker_capture: bool = False) -> None:
        self._call("genartifact_engine_options", {"options": options, "worker_capture": worker_capture},
                   first=False, expected=(ConfigError,))

    def storage_target(self, kind: str, settings: Mapping[str, Any]) -> Any:
        """The guarded target of ``kind`` (or None). Raises :class:`~genartifact.errors.ConfigError` for bad
        settings, :class:`PluginFault` for anything else the factory did wrong."""
        t, info = self._call("genartifact_storage_target", {"kind": kind, "settings": settings}, first=True,
                             expected=(ConfigError,))
        if t is None:
            return None
        missing = [m for m in _TARGET_METHODS if not callable(getattr(t, m, None))]
        if missing:
            raise fault(info, "genartifact_storage_target",
                        problem=f"returned {type(t).__name__} without method(s) {missing}")
        return GuardedTarget(t, info, kind)

    def target_shorthand(self, kind: str, value: str, run_id: str, index: int) -> dict[str, Any] | None:
        res, info = self._call("genartifact_target_shorthand", {"kind": kind, "value": value, "run_id": run_id,
                                                                 "index": index}, first=True,
                               expected=(RequestSpecError, TargetError))
        if res is not None and not (isinstance(res, dict) and normalize(str(res.get("kind", ""))) == kind):
            raise fault(info, "genartifact_target_shorthand", problem=f"expected a target dict with kind {kind!r}")
        return res

    def content_reader(self, name: str) -> Any:
        """The :class:`GuardedReader` of content ``name`` (or None)."""
        res, info = self._call("genartifact_content_reader", {"name": name}, first=True)
        return guard_reader(res, info, name)

    def worker_captures(self, worker: Any, settings: Mapping[str, Any]) -> list[tuple[PluginInfo | None, Any]]:
        """Each enabled plugin's worker capture, in config order, isolated per plugin: ``(its PluginInfo, the
        capture it returned or the PluginFault it caused)``; plugins that returned None are left out. One plugin's
        fault never stops another's capture from being installed (the worker runtime fails only that plugin's
        requests)."""
        out: list[tuple[PluginInfo | None, Any]] = []
        for impl in self._impls("genartifact_worker_capture"):
            info = self.info_of(impl.plugin_name)
            kw = {"worker": worker, "settings": settings}
            try:
                res = call_plugin(info, "genartifact_worker_capture", impl.function, *[kw[a] for a in impl.argnames])
            except PluginFault as e:
                out.append((info, e))
                continue
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - a BaseException of the plugin's own: still only its fault
                out.append((info, fault(info, "genartifact_worker_capture", e)))
                continue
            if res is not None:
                out.append((info, res))
        return out

    def worker_call(self, worker: Any, method: str, args: list[Any]) -> Any:
        res, _ = self._call("genartifact_worker_call", {"worker": worker, "method": method, "args": args},
                            first=True, expected=(CaptureError,))
        return res

    def provenance_impls(self) -> list[tuple[str, Any]]:
        """``(plugin name, hook function)`` per probe implementation, in config order, for callers that must
        isolate failures per collector."""
        return [(i.plugin_name, i.function) for i in self._impls("genartifact_collect_provenance")]


def _hook_names() -> set[str]:
    return {n for spec in ALL_SPECS for n in vars(spec) if n.startswith(PROJECT + "_")}


def check_plugin_object(info: PluginInfo, obj: Any) -> None:
    """Load-time contract checks of one plugin object; raises :class:`PluginLoadError` naming the entry point,
    the distribution and the fix: a ``genartifact_*`` function without ``@hookimpl``, a ``@hookimpl`` whose name
    is no hook (typo, with the closest hook name), a hook wrapper, or no hook implementation at all."""
    where = f"{_SINGULAR[info.kind]} '{info.name}' ({info.entry_point}; distribution {info.dist} {info.version})"
    known = _hook_names()
    marker = f"{PROJECT}_impl"
    impls = []
    for attr in dir(obj):
        if attr.startswith("__"):
            continue
        try:
            val = getattr(obj, attr)
        except Exception:  # noqa: BLE001, S112 - a property that fails is not a hook
            continue
        opts = getattr(val, marker, None) if inspect.isroutine(val) else None
        if opts is None:
            if attr.startswith(PROJECT + "_") and inspect.isroutine(val) and attr in known:
                raise PluginLoadError(f"{where}: {attr} is not decorated with @hookimpl; decorate it with "
                                      f"genartifact.hookimpl (pluggy.HookimplMarker('genartifact'))")
            continue
        name = opts.get("specname") or attr
        if name not in known:
            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
            raise PluginLoadError(f"{where}: @hookimpl {name} is not a genartifact hook"
                                  + (f"; did you mean {close[0]}?" if close else f"; hooks: {sorted(known)}"))
        if opts.get("hookwrapper") or opts.get("wrapper"):
            raise PluginLoadError(f"{where}: {name} is a hook wrapper; genartifact hooks do not support wrappers")
        impls.append(name)
    if not impls:
        raise PluginLoadError(f"{where} has no @hookimpl functions; implement its hooks (e.g. "
                              f"genartifact_content_producer / genartifact_storage_target) and decorate each with "
                              f"genartifact.hookimpl")


class _ObjectEP:
    """An entry point standing for an in-process object (tests, the plugin-author kit)."""

    def __init__(self, name: str, obj: Any) -> None:
        self.name, self._obj = name, obj
        self.value = f"{getattr(obj, '__name__', type(obj).__name__)}"
        self.dist = type("D", (), {"name": _IN_PROCESS, "version": "0"})()

    def load(self) -> Any:
        return self._obj


class PluginHost:
    """Owns one pluggy ``PluginManager`` with the plugins enabled by config lists.

    :param enabled: kind -> ordered list of plugin names (config order is run order, for every hook).
    :param source: entry-point lookup (``importlib.metadata.entry_points`` by default; injectable in tests).
    :param objects: kind -> {name: plugin object} registered as if installed (no entry point needed); they take
        precedence over installed plugins of the same name. Used by :mod:`genartifact.testing`.
    :param content_settings: content name -> its settings (config ``[contents.<name>]`` plus ``base_dir``),
        handed to ``genartifact_content_producer``.
    :raises UnknownPluginError: a name no installed distribution provides (names kind, installed, closest).
    :raises DuplicatePluginError: two distributions claim one name.
    :raises PluginLoadError: importing a selected plugin failed, or its object fails the load-time checks
        (:func:`check_plugin_object`), or two entry points resolve to one object.
    """

    def __init__(self, enabled: Mapping[str, Sequence[str]], source: EntryPointSource = _default_source,
                 objects: Mapping[str, Mapping[str, Any]] | None = None,
                 content_settings: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self.content_settings = {normalize(k): dict(v) for k, v in (content_settings or {}).items()}
        unknown_kinds = set(enabled) - set(KINDS)
        if unknown_kinds:
            raise UnknownPluginError(f"unknown plugin kind(s) {sorted(unknown_kinds)}; allowed: {sorted(KINDS)}")
        self._objects = {k: {normalize(n): o for n, o in v.items()} for k, v in (objects or {}).items()}
        self._source = source
        self._pm = pluggy.PluginManager(PROJECT)
        for spec in ALL_SPECS:
            self._pm.add_hookspecs(spec)
        self._installed: dict[str, dict[str, tuple[PluginInfo, Any]]] = {}
        self.enabled: dict[str, list[PluginInfo]] = {k: [] for k in KINDS}
        self._loaded: list[tuple[PluginInfo, Any]] = []
        for kind, names in enabled.items():
            for raw in names:
                self._load(kind, normalize(raw), where=f"config [plugins].{kind}")
        infos = {}
        for info, obj in reversed(self._loaded):  # pluggy calls last-registered first: reverse = config order
            pname = f"{info.kind}:{info.name}"
            self._pm.register(obj, name=pname)
            infos[pname] = info
        try:
            self._pm.check_pending()
        except pluggy.PluginValidationError as e:  # not reachable after check_plugin_object; kept as a net
            raise PluginLoadError(str(e)) from e
        self.hooks = Hooks(self._pm, infos)
        self._pipelines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._small_pipelines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )
        self._readers: dict[str, Any] = {}  # content name -> its GuardedReader (found ones only: see reader())

    def _group_source(self, group: str) -> Iterable[Any]:
        kind = next(k for k, g in GROUPS.items() if g == group)
        objs = self._objects.get(kind, {})
        eps = [ep for ep in self._source(group) if normalize(ep.name) not in objs]
        return [*eps, *(_ObjectEP(n, o) for n, o in objs.items())]

    def installed(self, kind: str) -> dict[str, PluginInfo]:
        """Installed plugins of ``kind`` (discovered once, nothing imported)."""
        if kind not in self._installed:
            self._installed[kind] = discover(kind, self._group_source)
        return {n: v[0] for n, v in self._installed[kind].items()}

    def _load(self, kind: str, name: str, where: str) -> None:
        installed = self.installed(kind)
        if name not in installed:
            raise UnknownPluginError(unknown_plugin_message(kind, name, installed, where))
        if any(p.name == name for p in self.enabled[kind]):
            return
        info, ep = self._installed[kind][name]
        try:
            obj = ep.load()
        except Exception as e:  # noqa: BLE001 - re-raised with context
            raise PluginLoadError(
                f"error importing {_SINGULAR[kind]} '{name}' from {info.dist} {info.version} ({info.value}): "
                f"{type(e).__name__}: {redact(str(e))}"
            ) from e
        for other, o in self._loaded:
            if o is obj:
                raise PluginLoadError(
                    f"entry points '{other.entry_point}' ({other.dist}) and '{info.entry_point}' ({info.dist}) "
                    f"resolve to the same object; give each entry point its own module or object "
                    f"(e.g. module:attribute)"
                )
        check_plugin_object(info, obj)
        self._loaded.append((info, obj))
        self.enabled[kind].append(info)

    def require(self, kind: str, name: str, where: str) -> PluginInfo:
        """Return the enabled plugin ``name`` of ``kind`` or raise :class:`UnknownPluginError` that says
        whether it is installed-but-not-enabled or not installed at all."""
        name = normalize(name)
        for p in self.enabled[kind]:
            if p.name == name:
                return p
        installed = self.installed(kind)
        if name in installed:
            raise UnknownPluginError(
                f"{_SINGULAR[kind]} '{name}' in {where} is installed ({installed[name].label()}) but not enabled; "
                f"add it to [plugins].{kind} in the config; enabled: {[p.name for p in self.enabled[kind]]}"
            )
        enabled = {p.name: p for p in self.enabled[kind]}
        raise UnknownPluginError(unknown_plugin_message(kind, name, enabled or installed, where,
                                                        "enabled" if enabled else "installed"))

    def pipeline(self, small: bool = False) -> asyncio.Semaphore:
        """The encode+deliver semaphore of the running event loop (one per loop and lane).

        Two lanes: artifacts whose admitted worst-case encoded size is above
        :data:`~genartifact.limits.SMALL_ARTIFACT_BYTES` (1 MiB) take a slot of the main lane
        (``GENARTIFACT_PIPELINE_CONCURRENCY``, default 2: their encode runs in a thread, their bytes can be tens of
        MiB); smaller ones, every ordinary per-request artifact, take a slot of the ``small`` lane
        (``GENARTIFACT_PIPELINE_SMALL_CONCURRENCY``, default 32: at most 32 MiB in flight), so that a wave of
        requests finishing together is encoded and delivered together (one batch of ``file://`` writes, one group
        commit) instead of two at a time behind one another. Both bound memory and concurrent deliveries."""
        from genartifact.limits import pipeline_concurrency, small_pipeline_concurrency

        loop = asyncio.get_running_loop()
        lanes = self._small_pipelines if small else self._pipelines
        sem = lanes.get(loop)
        if sem is None:
            sem = lanes[loop] = asyncio.Semaphore(small_pipeline_concurrency() if small else pipeline_concurrency())
        return sem

    def reader(self, name: str) -> Any:
        """The :class:`GuardedReader` of content ``name`` (``genartifact_content_reader``), or None. Asked once per
        content for this host's life: a reader is a stateless validator (docs/plugins.md), and every artifact of a
        run asked the hook again (a pluggy call per content per request on the driver's loop). A lookup that
        finds none, or raises (:class:`PluginFault`), is not kept: the next call asks again."""
        r = self._readers.get(name)
        if r is None:
            r = self.hooks.content_reader(name=name)
            if r is not None:
                self._readers[name] = r
        return r

    def content_readers(self) -> dict[str, Any]:
        """``content name -> reader`` of every enabled content plugin that provides one (for encode)."""
        out = {}
        for p in self.enabled["contents"]:
            r = self.reader(p.name)
            if r is not None:
                out[p.name] = r
        return out

    def listing(self) -> list[dict[str, Any]]:
        """Every installed plugin of every kind with ``enabled`` flag and implemented hooks."""
        rows = []
        for kind in KINDS:
            enabled = {p.name for p in self.enabled[kind]}
            for name, info in sorted(self.installed(kind).items()):
                hooks: list[str] = []
                plugin = self._pm.get_plugin(f"{kind}:{name}")
                if plugin is not None:
                    hooks = sorted(h.name for h in self._pm.get_hookcallers(plugin) or [])
                rows.append(
                    {"kind": kind, "name": name, "dist": info.dist, "version": info.version,
                     "enabled": name in enabled, "hooks": hooks}
                )
        return rows


def load_command(name: str, parser: Any, source: EntryPointSource = _default_source) -> Callable[[Any], int]:
    """Import the ``genartifact.commands`` plugin named ``name``, let it add its arguments to ``parser`` and
    return its handler. Raises :class:`UnknownPluginError` / :class:`PluginLoadError` / :class:`PluginFault`."""
    found = discover("commands", source)
    if normalize(name) not in found:
        raise UnknownPluginError(unknown_plugin_message("commands", name, {k: v[0] for k, v in found.items()},
                                                        "the command line"))
    info, ep = found[normalize(name)]
    try:
        obj = ep.load()
    except Exception as e:  # noqa: BLE001 - re-raised with context
        raise PluginLoadError(f"error importing command '{name}' from {info.dist} {info.version} ({info.value}): "
                              f"{type(e).__name__}: {redact(str(e))}") from e
    check_plugin_object(info, obj)
    pm = pluggy.PluginManager(PROJECT)
    for spec in ALL_SPECS:
        pm.add_hookspecs(spec)
    pm.register(obj, name=f"commands:{info.name}")
    hooks = Hooks(pm, {f"commands:{info.name}": info})
    # the hook gets the entry point's own spelling (CLI names keep their hyphens: ``replay-check``)
    handler, _ = hooks._call("genartifact_command", {"name": ep.name, "parser": parser}, first=True)
    if handler is None or not callable(handler):
        raise fault(info, "genartifact_command", problem=f"returned {type(handler).__name__} for command "
                                                         f"{name!r}; expected a handler (args -> int)")
    return handler


__all__ = ["GROUPS", "KINDS", "GuardedProducer", "GuardedReader", "GuardedTarget", "Hooks", "PluginHost", "PluginInfo",
           "acall_plugin", "call_plugin", "check_plugin_object", "content_section_bytes", "discover", "fault",
           "guard_reader", "load_command", "normalize",
           "redact"]
