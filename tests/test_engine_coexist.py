"""A framework that owns the engine (verl-style): it builds its own ``AsyncLLM`` with its own
``worker_extension_cls``; genartifact attaches to it (``VllmEngine.attach``) and captures per-request artifacts
through its ``vllm.general_plugins`` entry point, without owning the extension slot. Both RPC surfaces work,
and the artifacts are oracle-exact. Capture detection comes from the workers' ``init`` answer."""

from __future__ import annotations

import os

import pytest
import pytest_asyncio
from deploy_helpers import Deadline, check, run_six

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]

EXT = "framework_ext_standin.FrameworkWorkerExtension"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def framework_llm(qwen_model):
    from genartifact.engine.vllm_adapter import CPU_ENV, vllm_plugin_installed
    from vllm import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    assert vllm_plugin_installed(), "the 'genartifact' vllm.general_plugins entry point must be installed " \
                                    "(pip install -e ./core)"
    for k, v in CPU_ENV.items():
        os.environ.setdefault(k, v)
    with Deadline(900):  # the framework's own engine: its extension, its options, tokenizer on
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(qwen_model), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
            enable_prefix_caching=False, disable_log_stats=True, worker_extension_cls=EXT))
    try:
        yield llm
    finally:
        import gc

        llm.shutdown()
        del llm
        gc.collect()  # AsyncLLM.__del__ runs now, not at interpreter exit (when it fails on torn-down globals)


async def test_framework_extension_and_genartifact_side_by_side(framework_llm, host, qwen_model, tmp_path):
    from genartifact.engine.vllm_adapter import VllmEngine

    assert framework_llm.vllm_config.parallel_config.worker_extension_cls == EXT  # the slot stays the framework's
    eng = await VllmEngine.attach(host, framework_llm)
    opts = eng.model_info.engine_options
    assert opts["worker_capture"] and opts["worker_captures"] == ["moe_route_weights", "moe_routes", "selected_logprobs"]
    ping = await framework_llm.collective_rpc("framework_ping", args=("hello",))
    assert ping == [{"echo": "hello", "rank": 0, "genartifact_rpc": True}]
    res = await run_six(eng, tmp_path)
    got = check(res, qwen_model, tmp_path)
    print("coexist-attach", {k: v for k, v in got.items() if k != "failures"})
    assert got["ready"] == 6, got["failures"]
    assert got["route_agreement_min"] >= 0.97 and got["logprob_max_abs_err"] < 1e-4 and got["logprobs_equal_engine"]
    # the framework's RPC still works after capture ran, and attach's shutdown leaves the caller's engine up
    assert isinstance((await framework_llm.collective_rpc("framework_weight_sum"))[0], float)
    eng.shutdown()
    assert framework_llm.errored is False
    assert (await framework_llm.collective_rpc("framework_ping", args=(1,)))[0]["echo"] == 1
