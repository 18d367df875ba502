"""genartifact: generation artifacts captured from vLLM — a pluggy plugin host.

Light on import: only pluggy, numpy, zstandard and structlog. Engine glue lives in
:mod:`genartifact.engine` and is imported lazily (it needs vllm and torch).
"""

from __future__ import annotations

import pluggy

from genartifact.errors import (
    AdmissionError,
    ArtifactFormatError,
    CaptureError,
    DeliveryError,
    GenartifactError,
    PluginError,
    RequestSpecError,
    TargetError,
)
from genartifact.format import FORMAT_NAME, decode, encode

__version__ = "0.1.0"
hookimpl = pluggy.HookimplMarker("genartifact")

__all__ = [
    "FORMAT_NAME",
    "AdmissionError",
    "ArtifactFormatError",
    "CaptureError",
    "DeliveryError",
    "GenartifactError",
    "PluginError",
    "RequestSpecError",
    "TargetError",
    "__version__",
    "decode",
    "encode",
    "hookimpl",
]
