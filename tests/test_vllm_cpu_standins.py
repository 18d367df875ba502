"""Checks of the TEST-ONLY stand-ins for vLLM-CPU gaps (``tests/vllm_cpu_standins.py``): each patch computes
what the upstream collective/platform contract says, and the stand-ins reach vLLM's child processes."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import vllm_cpu_standins as S

pytestmark = pytest.mark.engine  # needs vllm (the engine extra)


def _collectives_rank(rank: int, world: int, port: int, q) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    comm = SimpleNamespace(world_size=world, rank_in_group=rank, device_group=dist.group.WORLD)
    sizes = [3, 1]
    x = torch.arange(sizes[rank] * 4, dtype=torch.float32).reshape(sizes[rank], 4) + 100 * rank
    g = S._all_gatherv(comm, x, 0, sizes)
    gl = S._all_gatherv(comm, [x, x * 2], 0, sizes)
    y = torch.arange(4 * 5, dtype=torch.float32).reshape(4, 5) * (rank + 1)
    rs = S._reduce_scatterv(comm, y, 0, sizes)
    # dim=1 (row-major transposed) variant
    rs1 = S._reduce_scatterv(comm, y.T.contiguous(), 1, sizes)
    q.put((rank, g.tolist(), [t.tolist() for t in gl], rs.tolist(), rs1.tolist()))
    dist.destroy_process_group()


def test_cpu_collectives_standin_matches_the_contract():
    import multiprocessing as mp

    import torch
    from genartifact.testing import free_port

    port = free_port()  # bound later by the spawned ranks: outside the ephemeral range
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_collectives_rank, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    for _ in procs:
        r, *vals = q.get(timeout=120)
        out[r] = vals
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    x0 = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    x1 = torch.arange(4, dtype=torch.float32).reshape(1, 4) + 100
    full = torch.cat([x0, x1]).tolist()
    y = torch.arange(20, dtype=torch.float32).reshape(4, 5) * 3  # sum over ranks of y*(r+1)
    for r in (0, 1):
        g, gl, rs, rs1 = out[r]
        assert g == full
        assert gl == [full, (torch.tensor(full) * 2).tolist()]
        assert rs == (y[:3] if r == 0 else y[3:]).tolist()
        assert rs1 == (y[:3] if r == 0 else y[3:]).T.tolist()


def test_standins_reach_child_processes():
    env = {**os.environ, **S.child_env()}
    code = ("import vllm.platforms.cpu as c, vllm.distributed.device_communicators.cpu_communicator as m;"
            "print(c.CpuPlatform.ray_device_key, m.CpuCommunicator.all_gatherv.__module__)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [S.RAY_RESOURCE, "vllm_cpu_standins"]
    # without the flag nothing is patched (the folder on PYTHONPATH alone does not act)
    env.pop("GENARTIFACT_TEST_VLLM_STANDINS")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] != "vllm_cpu_standins"


@pytest.mark.parametrize("modname", ["vllm.v1.executor.ray_utils", "vllm.v1.executor.ray_executor_v2"])
def test_ray_worker_id_standin_is_installed_on_both_executors(modname):
    pytest.importorskip("ray")
    import importlib

    S.install()
    mod = importlib.import_module(modname)
    S.patch_ray_worker_ids(mod)
    cls = getattr(mod, "RayWorkerWrapper", None) or mod.RayWorkerProc
    assert cls.get_node_and_physical_gpu_ids is S._node_and_ids
