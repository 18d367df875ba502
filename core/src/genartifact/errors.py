"""Exception hierarchy. Every message names the offending field and the allowed values, and never
contains a secret (URLs, signed header values, credentials)."""

from __future__ import annotations


class GenartifactError(Exception):
    """Base class of all genartifact errors."""


class ArtifactFormatError(GenartifactError, ValueError):
    """A ``generation_artifact_v1`` object or encoder input violates the format (docs/format.md)."""


class RequestSpecError(GenartifactError, ValueError):
    """The artifact request spec is malformed (raised before inference)."""


class AdmissionError(GenartifactError, ValueError):
    """The worst-case artifact does not fit a limit, or the engine cannot produce a content (before inference)."""


class CaptureError(GenartifactError, ValueError):
    """Engine data violated the admitted bounds during capture or at finalize."""


class TargetError(GenartifactError, ValueError):
    """A storage target's request fields or settings are invalid (side-effect free validation)."""


class TargetNotReadableError(TargetError):
    """The target kind cannot read, test or delete stored objects (e.g. ``presigned_http_put``: a write-only
    grant). Raised by ``StorageTarget.open``/``exists``/``delete``."""


class ObjectNotFoundError(TargetError, LookupError):
    """``StorageTarget.open``: no object is stored under the given id."""


class ObjectTooLargeError(TargetError):
    """``StorageTarget.open``/``delete``: the stored object is larger than the caller's ``max_bytes``."""


class DeliveryError(GenartifactError):
    """Delivering bytes to storage failed. ``code`` is a stable error code (docs/receipts.md)."""

    def __init__(self, message: str, code: str = "delivery_failed") -> None:
        super().__init__(message)
        self.code = code


class PluginError(GenartifactError):
    """Plugin discovery/selection/loading failed."""


class UnknownPluginError(PluginError, LookupError):
    """A config or request names a plugin that no installed distribution provides."""


class DuplicatePluginError(PluginError):
    """Two different distributions claim the same plugin name within one kind."""


class PluginLoadError(PluginError, ImportError):
    """Importing or validating a selected plugin's entry point failed (import error, no ``@hookimpl``
    function, a misspelled ``genartifact_*`` hook, two entry points resolving to one object)."""


class PluginFault(PluginError):
    """A plugin broke its contract while serving one request: it raised an exception outside its documented
    set, or returned a value of the wrong type/shape. The request gets a ``failed`` receipt with
    ``error_code: internal_error``; other requests run on.

    ``plugin``: ``"<name> (<distribution> <version>)"``; ``method``: the plugin method or hook that failed;
    ``error_type``: the original exception's class name (or ``"bad_return"`` for a return-value violation).
    The message is already redacted (no URLs' queries, credentials or signed header values)."""

    def __init__(self, message: str, *, plugin: str = "", method: str = "", error_type: str = "") -> None:
        super().__init__(message)
        self.plugin = plugin
        self.method = method
        self.error_type = error_type


class ConfigError(GenartifactError, ValueError):
    """The TOML configuration is invalid."""


class EngineStartError(GenartifactError, RuntimeError):
    """The engine started but its workers disagree with the driver (e.g. a worker enabled a different set of
    contents/probes than the engine sent in ``init``); the engine is shut down."""
