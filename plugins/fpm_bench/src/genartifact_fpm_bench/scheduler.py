"""``InstrumentedScheduler``: a vLLM ``Scheduler`` subclass that records one FPM per non-empty forward pass.

Use it with ``scheduler_cls="genartifact_fpm_bench.scheduler.InstrumentedScheduler"`` (it runs in vLLM's
EngineCore process). It adds no device synchronization and no per-step RPC: the batch shape is read from the
``SchedulerOutput`` the scheduler itself produced, the timestamps are host ``time.monotonic()`` readings around
the scheduler's own calls, and records leave through a background publisher thread.

Environment (read once at construction, in the EngineCore process):

* ``GENARTIFACT_FPM_STREAM`` — ``1`` to publish on a ZMQ PUB socket (default off: recording only).
* ``GENARTIFACT_FPM_PORT_BASE`` — base TCP port (default 20380); rank *r* binds ``base + r`` on
  ``GENARTIFACT_FPM_BIND_HOST`` (default ``127.0.0.1``).
* ``GENARTIFACT_FPM_QUEUE`` — publisher queue capacity (default 10000); when full, FPMs are dropped and counted.

vLLM notes: the scheduler runs ``schedule()`` → forward → ``update_from_output()`` once per step; on CPU async
scheduling is off, so each ``update_from_output`` answers the batch from the immediately preceding
``schedule()``. The FIFO of schedule timestamps keeps timing right when async scheduling overlaps steps.
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import Any

import structlog
from vllm.v1.core.sched.scheduler import Scheduler

from genartifact_fpm_bench.fpm import FPM, VERSION, ScheduledStats, frames, stats

log = structlog.get_logger("genartifact.fpm")
DEFAULT_PORT_BASE = 20380
PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def dp_rank_of(vllm_config: Any) -> int:
    """The data-parallel rank: ``GENARTIFACT_FPM_DP_RANK`` when set (one single-rank engine per rank, as the
    bench launcher does), else ``parallel_config.data_parallel_index`` when vLLM sets it (external DP zeroes
    ``data_parallel_rank`` in children), else ``data_parallel_rank``."""
    override = os.environ.get("GENARTIFACT_FPM_DP_RANK")
    if override:  # external DP launchers that start one single-rank engine per rank
        return int(override)
    pc = vllm_config.parallel_config
    idx = getattr(pc, "data_parallel_index", None)
    return int(idx if isinstance(idx, int) else pc.data_parallel_rank)


def ephemeral_overlap(ports: range, path: str = PORT_RANGE_FILE) -> tuple[int, int] | None:
    """The host's ephemeral port range if ``ports`` overlaps it; None when disjoint or the file is absent."""
    try:
        lo, hi = (int(x) for x in open(path).read().split()[:2])
    except (OSError, ValueError):
        return None
    return (lo, hi) if ports.start <= hi and lo <= ports.stop - 1 else None


class FpmPublisher:
    """Background ZMQ PUB publisher; ``submit`` never blocks (full queue or full socket → dropped, counted)."""

    def __init__(self, port: int, host: str = "127.0.0.1", capacity: int = 10000) -> None:
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, capacity)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://{host}:{port}")
        self.port = port
        self.q: queue.Queue[FPM | None] = queue.Queue(maxsize=capacity)
        self.seq = 0
        self.dropped = 0
        self._t = threading.Thread(target=self._run, name="genartifact-fpm-pub", daemon=True)
        self._t.start()

    def submit(self, fpm: FPM) -> None:
        try:
            self.q.put_nowait(fpm)
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        while True:
            fpm = self.q.get()
            if fpm is None:
                return
            try:
                self.sock.send_multipart(frames(self.seq, fpm), flags=self._zmq.NOBLOCK)
                self.seq += 1
            except self._zmq.Again:
                self.dropped += 1

    def close(self) -> None:
        try:
            self.q.put_nowait(None)
        except queue.Full:
            pass
        self._t.join(timeout=1.0)
        self.sock.close(0)


class InstrumentedScheduler(Scheduler):
    """vLLM's ``Scheduler`` plus FPM recording (see module docstring). Keeps the last 4096 FPMs in ``fpms``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fpm_dp_rank = dp_rank_of(self.vllm_config)
        self.fpm_counter = 0
        self.fpms: collections.deque[FPM] = collections.deque(maxlen=4096)
        self._sched_times: collections.deque[tuple[int, float]] = collections.deque()
        self._last_output: float | None = None
        self._recorder_s = 0.0
        self.fpm_publisher: FpmPublisher | None = None
        if os.environ.get("GENARTIFACT_FPM_STREAM", "0") == "1":
            base = int(os.environ.get("GENARTIFACT_FPM_PORT_BASE", DEFAULT_PORT_BASE))
            dp_size = int(getattr(self.vllm_config.parallel_config, "data_parallel_size", 1) or 1)
            overlap = ephemeral_overlap(range(base, base + max(1, dp_size)))
            if overlap is not None:
                log.warning("fpm_ports_in_ephemeral_range", ports=f"{base}..{base + max(1, dp_size) - 1}",
                            ephemeral_range=f"{overlap[0]}..{overlap[1]}",
                            remedy=f"set GENARTIFACT_FPM_PORT_BASE below {overlap[0]} (an outbound connection may "
                                   f"take the port: intermittent 'Address already in use')")
            self.fpm_publisher = FpmPublisher(base + self.fpm_dp_rank, os.environ.get("GENARTIFACT_FPM_BIND_HOST",
                                                                                     "127.0.0.1"),
                                              int(os.environ.get("GENARTIFACT_FPM_QUEUE", 10000)))

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        out = super().schedule(*args, **kwargs)
        t0 = time.perf_counter()
        if out.total_num_scheduled_tokens > 0:
            self._sched_times.append((id(out), time.monotonic()))
        self._recorder_s += time.perf_counter() - t0
        return out

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        t_out = time.monotonic()
        t0 = time.perf_counter()
        shape = None
        if scheduler_output.total_num_scheduled_tokens > 0:
            # read the shape before the base class retires finished requests
            shape = (self._scheduled_stats(scheduler_output), self._queued_stats())
        spent = time.perf_counter() - t0
        result = super().update_from_output(scheduler_output, model_runner_output)
        t1 = time.perf_counter()
        if shape is not None:
            t_sched = self._pop_schedule_time(id(scheduler_output), t_out)
            fpm = FPM(version=VERSION, dp_rank=self.fpm_dp_rank, counter_id=self.fpm_counter,
                      wall_time=t_out - t_sched,
                      inter_output=None if self._last_output is None else t_out - self._last_output,
                      t_schedule=t_sched, t_output=t_out, scheduled=shape[0], queued=shape[1],
                      recorder_s=self._recorder_s + spent + (time.perf_counter() - t1))
            self._recorder_s = 0.0
            self.fpm_counter += 1
            self.fpms.append(fpm)
            if self.fpm_publisher is not None:
                self.fpm_publisher.submit(fpm)
        self._last_output = t_out
        return result

    def _pop_schedule_time(self, key: int, default: float) -> float:
        while self._sched_times:
            k, t = self._sched_times.popleft()
            if k == key:
                return t
        return default

    def _scheduled_stats(self, so: Any) -> ScheduledStats:
        prefill, decode = [], []
        entries = [(r.req_id, r.num_computed_tokens) for r in so.scheduled_new_reqs]
        cached = so.scheduled_cached_reqs
        entries += list(zip(cached.req_ids, cached.num_computed_tokens, strict=False))
        for rid, computed in entries:
            n = int(so.num_scheduled_tokens.get(rid, 0))
            req = self.requests.get(rid)
            prompt_len = int(req.num_prompt_tokens) if req is not None else computed + n
            if computed < prompt_len:
                prefill.append((n, int(computed), prompt_len))
            else:
                decode.append(int(computed))
        return stats(prefill, decode)

    def _queued_stats(self) -> ScheduledStats:
        prefill, decode = [], []
        for req in list(self.waiting):
            done = int(req.num_computed_tokens)
            if done < req.num_prompt_tokens:
                prefill.append((req.num_prompt_tokens - done, done, int(req.num_prompt_tokens)))
            else:  # preempted while decoding: counts as queued decode with its computed context
                decode.append(done)
        return stats(prefill, decode)

    def shutdown(self) -> None:
        if self.fpm_publisher is not None:
            log.info("fpm_publisher_closed", published=self.fpm_publisher.seq, dropped=self.fpm_publisher.dropped)
            self.fpm_publisher.close()
        super().shutdown()
