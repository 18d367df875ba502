"""The plugin host: discover entry points, select by config list, load only what is selected, register
with a private pluggy ``PluginManager``, reject unknown hooks, and expose a typed facade.

Discovery reads ``importlib.metadata`` only; no plugin module is imported until it is selected.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib.metadata as md
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pluggy

from genartifact.errors import DuplicatePluginError, PluginLoadError, UnknownPluginError
from genartifact.hookspecs import ALL_SPECS, PROJECT

KINDS: dict[str, str] = {
    "contents": "genartifact.contents",
    "targets": "genartifact.targets",
    "probes": "genartifact.probes",
}
_SINGULAR = {"contents": "content", "targets": "target", "probes": "probe"}


@dataclass(frozen=True)
class PluginInfo:
    """One discovered plugin: ``kind`` (contents/targets/probes), ``name`` (entry-point name),
    ``dist``/``version`` of the providing distribution, ``value`` (``module[:attr]``)."""

    kind: str
    name: str
    dist: str
    version: str
    value: str

    def label(self) -> str:
        return f"{self.name} ({self.dist} {self.version})"


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
    for ep in source(KINDS[kind]):
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


def unknown_plugin_message(kind: str, name: str, installed: Mapping[str, PluginInfo], where: str) -> str:
    """The error text for an unknown plugin name: kind, name, where it was named, what is installed,
    and the closest installed name."""
    listing = ", ".join(i.label() for i in sorted(installed.values(), key=lambda i: i.name)) or "none"
    msg = f"unknown {_SINGULAR[kind]} '{name}' in {where}; installed: {listing}"
    close = difflib.get_close_matches(normalize(name), list(installed), n=1, cutoff=0.5)
    if close:
        msg += f"; did you mean '{close[0]}'?"
    return msg


class Hooks:
    """Typed facade over the plugin manager's hooks; the only way call sites reach plugins."""

    def __init__(self, pm: pluggy.PluginManager) -> None:
        self._pm = pm

    def content_producer(self, name: str, model: Any) -> Any:
        return self._pm.hook.genartifact_content_producer(name=name, model=model)

    def engine_options(self, options: dict[str, Any], worker_capture: bool = False) -> None:
        self._pm.hook.genartifact_engine_options(options=options, worker_capture=worker_capture)

    def storage_target(self, kind: str, settings: Mapping[str, Any]) -> Any:
        return self._pm.hook.genartifact_storage_target(kind=kind, settings=settings)

    def worker_captures(self, worker: Any, settings: Mapping[str, Any]) -> list[Any]:
        """The enabled content plugins' worker captures (None results dropped; each capture is independent, so
        their order carries no meaning)."""
        return list(self._pm.hook.genartifact_worker_capture(worker=worker, settings=settings))

    def worker_call(self, worker: Any, method: str, args: list[Any]) -> Any:
        return self._pm.hook.genartifact_worker_call(worker=worker, method=method, args=args)

    def provenance_impls(self) -> list[tuple[str, Any]]:
        """``(plugin name, hook function)`` per probe implementation, in registration (config) order, for
        callers that must isolate failures per collector."""
        impls = self._pm.hook.genartifact_collect_provenance.get_hookimpls()
        return [(i.plugin_name, i.function) for i in reversed(impls)]


class PluginHost:
    """Owns one pluggy ``PluginManager`` with the plugins enabled by config lists.

    :param enabled: kind -> ordered list of plugin names (config order is run order).
    :param source: entry-point lookup (``importlib.metadata.entry_points`` by default; injectable in tests).
    :raises UnknownPluginError: a name no installed distribution provides (names kind, installed, closest).
    :raises DuplicatePluginError: two distributions claim one name.
    :raises PluginLoadError: importing a selected plugin failed (names plugin, distribution, cause).
    :raises pluggy.PluginValidationError: a plugin implements a ``genartifact_*`` hook that does not exist.
    """

    def __init__(self, enabled: Mapping[str, Sequence[str]], source: EntryPointSource = _default_source) -> None:
        unknown_kinds = set(enabled) - set(KINDS)
        if unknown_kinds:
            raise UnknownPluginError(f"unknown plugin kind(s) {sorted(unknown_kinds)}; allowed: {sorted(KINDS)}")
        self._source = source
        self._pm = pluggy.PluginManager(PROJECT)
        for spec in ALL_SPECS:
            self._pm.add_hookspecs(spec)
        self._installed: dict[str, dict[str, tuple[PluginInfo, Any]]] = {}
        self.enabled: dict[str, list[PluginInfo]] = {k: [] for k in KINDS}
        for kind, names in enabled.items():
            for raw in names:
                self._load(kind, normalize(raw), where=f"config [plugins].{kind}")
        self._pm.check_pending()
        self.hooks = Hooks(self._pm)
        self._pipelines: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = (
            weakref.WeakKeyDictionary()
        )

    def installed(self, kind: str) -> dict[str, PluginInfo]:
        """Installed plugins of ``kind`` (discovered once, nothing imported)."""
        if kind not in self._installed:
            self._installed[kind] = discover(kind, self._source)
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
                f"{type(e).__name__}: {e}"
            ) from e
        self._pm.register(obj, name=f"{kind}:{name}")
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
        raise UnknownPluginError(unknown_plugin_message(kind, name, enabled or installed, where))

    def pipeline(self) -> asyncio.Semaphore:
        """The encode+deliver semaphore of the running event loop (one per loop, size from
        ``GENARTIFACT_PIPELINE_CONCURRENCY``, default 2)."""
        from genartifact.limits import pipeline_concurrency

        loop = asyncio.get_running_loop()
        sem = self._pipelines.get(loop)
        if sem is None:
            sem = self._pipelines[loop] = asyncio.Semaphore(pipeline_concurrency())
        return sem

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
