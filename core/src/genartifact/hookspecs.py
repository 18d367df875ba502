"""pluggy hook specifications, grouped by plugin kind. All hook names carry the ``genartifact_`` prefix.

Kinds and their entry-point groups:

* contents -> ``genartifact.contents`` (entry-point name = content name, e.g. ``moe_routes``)
* targets  -> ``genartifact.targets``  (entry-point name = target kind, e.g. ``managed_fsspec``)
* probes   -> ``genartifact.probes``   (benchmark/provenance collectors)
* commands -> ``genartifact.commands`` (entry-point name = CLI subcommand, e.g. ``bench``; always available
  when installed, imported only when that subcommand runs)

Run order: for every hook, implementations run in config order (``[plugins].<kind>`` list order; the host
registers with pluggy so that its LIFO call order equals config order). ``firstresult`` hooks stop at the
first non-None result in that order. Hook wrappers are not supported.

Content plugins may also implement the worker hooks: they run inside vLLM worker processes through the one
genartifact worker runtime (``genartifact.engine.worker_ext``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from genartifact.types import ContentProducer, ContentReader, ModelInfo, StorageTarget

PROJECT = "genartifact"
hookspec = pluggy.HookspecMarker(PROJECT)


class ContentSpecs:
    """Hooks of content producers (group ``genartifact.contents``)."""

    @hookspec(firstresult=True)
    def genartifact_content_producer(self, name: str, model: ModelInfo,
                                     settings: Mapping[str, Any]) -> ContentProducer | None:
        """Create the per-request producer for content ``name``.

        :param name: the requested content name.
        :param model: model and engine facts.
        :param settings: the config table ``[contents.<name>]`` (empty when absent) plus ``base_dir`` (str:
            the directory relative paths resolve against). An implementation may omit this parameter.
        :return: a :class:`~genartifact.types.ContentProducer` if this plugin provides ``name``, else None.
        Stops at the first non-None result. Raise :class:`~genartifact.errors.ConfigError` for bad settings.
        """

    @hookspec(firstresult=True)
    def genartifact_content_reader(self, name: str) -> ContentReader | None:
        """The reader of content ``name`` (a :class:`~genartifact.types.ContentReader`): strict validation of
        its manifest section and tensors on decode/encode, typed accessor, ``inspect`` summary. Must import
        neither vLLM nor torch (``genartifact.decode`` runs without an engine). None if not ``name``."""

    @hookspec
    def genartifact_engine_options(self, options: dict[str, Any], worker_capture: bool) -> None:
        """Adjust engine construction kwargs in place before the engine starts (e.g. disable prefix
        caching). ``worker_capture``: genartifact's worker capture will run in this engine (its RPC reaches
        the workers). Called in config order for every enabled content plugin. Returns nothing."""


class WorkerSpecs:
    """Hooks run inside engine worker processes by the genartifact worker runtime
    (:mod:`genartifact.engine.worker_ext`), after the engine's ``init`` RPC delivered the enabled plugins."""

    @hookspec
    def genartifact_worker_capture(self, worker: Any, settings: Mapping[str, Any]) -> Any:
        """Return this content plugin's :class:`~genartifact.engine.worker_ext.WorkerCapture` for ``worker``
        (the vLLM worker: has ``model_runner``, ``vllm_config``), or None. Called once per capturing worker
        (tensor-parallel rank 0 of each engine), after the model is loaded. ``settings``: plugin name ->
        settings of the enabled plugins, as sent by the engine in ``init``. The runtime then fires the
        capture's step hook and serves its ``"<content>.fetch" / ".discard" / ".stats"`` RPC verbs."""

    @hookspec(firstresult=True)
    def genartifact_worker_call(self, worker: Any, method: str, args: list[Any]) -> Any:
        """Handle a worker RPC ``method`` (namespaced ``"<plugin>.<verb>"``) not served by a worker capture
        (e.g. a probe's ``"fpm.probe"``), with msgpack-native ``args``. Return a msgpack-native result, or None
        if this plugin does not own ``method``. Runs on every worker. Stops at the first non-None result."""


class TargetSpecs:
    """Hooks of storage targets (group ``genartifact.targets``)."""

    @hookspec(firstresult=True)
    def genartifact_storage_target(self, kind: str, settings: Mapping[str, Any]) -> StorageTarget | None:
        """Create the target for ``kind`` from its server-side ``settings`` (config table
        ``[targets.<kind>]``). Return None if this plugin does not provide ``kind``.
        Raise :class:`~genartifact.errors.ConfigError` for invalid settings. Stops at the first non-None.
        ``settings`` always carries ``base_dir`` (str): the config file's directory, which relative paths in
        settings resolve against."""

    @hookspec(firstresult=True)
    def genartifact_target_shorthand(self, kind: str, value: str, run_id: str, index: int) -> dict[str, Any] | None:
        """Expand ``generate --target KIND:VALUE`` for request ``index`` of run ``run_id`` into a full target
        object (``{"kind": kind, ...}``), or None if this plugin does not provide ``kind``. Raise
        :class:`~genartifact.errors.RequestSpecError` for a malformed ``value``."""


class ProbeSpecs:
    """Hooks of benchmark/provenance probes (group ``genartifact.probes``)."""

    @hookspec
    def genartifact_collect_provenance(self, context: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """Return one provenance block for the run described by ``context``, or None: ``{"name": <this probe's
        entry-point name>, "data": <JSON-compatible value, or an awaitable of one>}``. ``genartifact bench run``
        passes ``{"engine": <the started VllmEngine>}``, awaits ``data`` under a timeout and records a wrong answer or
        an exception as this probe's error instead of failing the run (docs/fpm.md, "Provenance")."""


class CommandSpecs:
    """Hooks of CLI command plugins (group ``genartifact.commands``; the entry-point name is the subcommand).
    The module is imported only when its subcommand runs, so ``genartifact --help`` stays fast."""

    @hookspec(firstresult=True)
    def genartifact_command(self, name: str, parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int] | None:
        """Add the arguments of subcommand ``name`` to ``parser`` and return its handler (``args -> exit
        code``), or None if this plugin does not provide ``name``. Errors for bad input must derive from
        :class:`~genartifact.errors.GenartifactError` (the CLI prints one ``error:`` line, exit 2)."""


ALL_SPECS = (ContentSpecs, WorkerSpecs, TargetSpecs, ProbeSpecs, CommandSpecs)
