"""Content readers: per-content validation, typed views and ``inspect`` summaries, owned by content plugins.

A content plugin implements ``genartifact_content_reader(name)`` (see :mod:`genartifact.hookspecs`). Readers are
found lazily by content name: first readers registered in this process (:func:`register_reader`, used by
:mod:`genartifact.testing`), then the ``genartifact.contents`` entry point of that name — importing only that
plugin's entry-point module, which must not import vLLM or torch, so :func:`genartifact.decode` works
without an engine. The in-repo contents (``moe_routes``, ``selected_logprobs``) are found the same way as a
third party's: through their entry points (their dotted paths), never imported by core by name.
"""

from __future__ import annotations

import threading
from typing import Any

from genartifact.errors import PluginError

_registered: dict[str, Any] = {}
_found: dict[str, Any] = {}
_lock = threading.Lock()


def register_reader(name: str, reader: Any) -> None:
    """Register ``reader`` for content ``name`` in this process (takes precedence over entry points)."""
    with _lock:
        _registered[name] = reader


def unregister_reader(name: str) -> None:
    """Undo :func:`register_reader` (and forget a cached entry-point lookup of ``name``)."""
    with _lock:
        _registered.pop(name, None)
        _found.pop(name, None)


def reader_for(name: str) -> Any:
    """The reader of content ``name``, or None when no installed content plugin of that name provides one.
    A plugin that fails to import or to load raises :class:`~genartifact.errors.ArtifactFormatError`
    naming it (a reader that cannot load cannot vouch for the content). Successful lookups are cached."""
    with _lock:
        if name in _registered:
            return _registered[name]
        if name in _found:
            return _found[name]
    from genartifact.errors import ArtifactFormatError
    from genartifact.host import PluginHost

    try:
        host = PluginHost({})
        if name not in host.installed("contents"):
            return None
        host = PluginHost({"contents": [name]})
        reader = host.hooks.content_reader(name=name)
    except PluginError as e:
        raise ArtifactFormatError(f"reader of content {name!r} cannot load: {e}") from None
    if reader is not None:
        with _lock:
            _found[name] = reader
    return reader
