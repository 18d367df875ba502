"""A stand-in for a started :class:`~genartifact.engine.vllm_adapter.VllmEngine` (no vLLM start), shared by the tests
that need one (on ``pythonpath`` via the root pytest config)."""

from __future__ import annotations

import asyncio
import types


class EngineDeadError(Exception):
    """Stands in for vllm.v1.engine.exceptions.EngineDeadError (raised by AsyncLLM.generate once the engine
    core died)."""


class DeadEngine:
    """An engine whose every request fails as vLLM's do after its worker process was killed (-9): what the server and
    the generate job touch of a started engine, and nothing more."""

    def __init__(self, host, model=None, **kw):
        self.host = host
        self.llm = types.SimpleNamespace(errored=False)
        self.model_info = types.SimpleNamespace(engine_options={})
        self.tokenizer = lambda text: {"input_ids": [1, 2, 3]}
        self.shut = False

    async def start(self):
        return self

    def prepare(self, *a, **kw):
        return types.SimpleNamespace(session=types.SimpleNamespace(release=lambda: None))

    async def execute(self, prep, stream=True):
        await asyncio.sleep(0)
        raise EngineDeadError("EngineCore encountered an issue. See stack trace (above) for the root cause.")
        yield  # an async generator, as VllmEngine.execute

    def shutdown(self):
        self.shut = True
