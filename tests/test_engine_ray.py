"""Ray: vLLM's Ray executors (V1 ``RayDistributedExecutor`` and the default V2 ``RayExecutorV2``) on a local
loopback Ray cluster. The worker config (enabled contents/probes and settings) travels in the ``init`` RPC, not
in environment variables (V1 does not copy those to its workers), and every worker's answer is checked at
start. vLLM-CPU refuses Ray ("current platform cpu does not support ray"): the marked test-only stand-in in
``vllm_cpu_standins`` (checked by its own test) lifts that."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import vllm_cpu_standins
from deploy_helpers import check, run_six, start_engine

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    saved = dict(os.environ)
    vllm_cpu_standins.enable_in_children()
    tmp = Path(f"/tmp/ray-ga-{os.getpid()}")
    ctx = ray.init(address="local", num_cpus=2, resources={vllm_cpu_standins.RAY_RESOURCE: 4},
                   include_dashboard=False, _temp_dir=str(tmp), log_to_driver=False)
    os.environ["RAY_ADDRESS"] = ctx.address_info["address"]  # vLLM's engine core joins this cluster, no other
    try:
        yield ctx
    finally:
        import shutil

        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        os.environ.clear()
        os.environ.update(saved)


@pytest.mark.parametrize("executor", ["v1", "v2"])
async def test_ray_executor_artifacts_exact_and_config_from_init(ray_cluster, executor, host, qwen_model, tmp_path,
                                                                 monkeypatch):
    assert not [k for k in os.environ if k.startswith("GENARTIFACT_WORKER")]  # nothing travels by env
    monkeypatch.setenv("VLLM_USE_RAY_V2_EXECUTOR_BACKEND", "1" if executor == "v2" else "0")
    eng = await start_engine(host, qwen_model, distributed_executor_backend="ray", seed=0)
    try:
        assert eng.llm.vllm_config.parallel_config.distributed_executor_backend == "ray"
        assert [w["enabled"]["contents"] for w in eng.workers] == [[p.name for p in host.enabled["contents"]]]
        assert eng.workers[0]["captures"] == ["moe_route_weights", "moe_routes", "selected_logprobs"]
        res = await run_six(eng, tmp_path)
        got = check(res, qwen_model, tmp_path)
        print(f"ray-{executor}", {k: v for k, v in got.items() if k != "failures"},
              "start_s", round(eng.start_seconds, 1))
        assert got["ready"] == 6, got["failures"]
        assert got["route_agreement_min"] >= 0.97 and got["logprob_max_abs_err"] < 1e-4
        assert got["logprobs_equal_engine"]
    finally:
        eng.shutdown()
