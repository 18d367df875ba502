"""The one worker-capture mechanism (``genartifact.engine.worker_ext``) without an engine: a fake worker whose
runner has ``execute_model``/``sample_tokens``, fake captures registered through the real hook, and
``fetch_capture``'s answers for data-parallel and tensor-parallel layouts."""

from __future__ import annotations

import os
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace as NS

import pluggy
import pytest
from genartifact.engine.worker_ext import WorkerCapture, WorkerRuntime, _dispatch, fetch_capture, register_vllm_plugin
from genartifact.errors import CaptureError, PluginFault
from genartifact.host import PluginHost

hookimpl = pluggy.HookimplMarker("genartifact")


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("a buggy plugin's exception cannot even describe itself")


class Recorder(WorkerCapture):
    name = "fake"
    capture_key = "fake_id"

    def __init__(self, worker, fail_in=None):
        self.worker, self.fail_in, self.events, self.rows = worker, fail_in, [], {}

    def begin_step(self, step):
        self.events.append(("begin", step.index, dict(step.flagged["fake"])))
        if self.fail_in == "begin":
            raise KeyError("boom")
        if self.fail_in == "unprintable":
            raise Unprintable()
        if self.fail_in == "secret":
            raise RuntimeError("PUT https://s3.example/b/k?X-Amz-Signature=SECRETSIG failed " + "x" * 100_000)

    def end_step(self, step):
        self.events.append(("end", step.index, step.model_output, step.failed))
        for rid, cid in step.flagged["fake"].items():
            self.rows.setdefault(cid, []).append(step.scheduler_output.num_scheduled_tokens[rid])

    def pop(self, cid, args):
        if self.fail_in == "pop":
            raise ValueError("pop broke")
        return self.rows.pop(cid, None)

    def drop(self, cid):
        return self.rows.pop(cid, None) is not None

    def stats(self):
        return {"requests": len(self.rows)}


@dataclass
class FakeEP:
    name: str
    value: str
    dist: object

    def load(self):
        return sys.modules[self.value]


def make_host(fail_in=None, cls=None):
    mod = types.ModuleType("fake_worker_content")

    @hookimpl
    def genartifact_worker_capture(worker, settings):
        worker.settings_seen = settings
        return (cls or Recorder)(worker, fail_in)

    mod.genartifact_worker_capture = genartifact_worker_capture
    sys.modules[mod.__name__] = mod
    eps = {"genartifact.contents": [FakeEP("fake", mod.__name__, NS(name="fake-dist", version="1"))],
           "genartifact.targets": [], "genartifact.probes": []}
    return PluginHost({"contents": ["fake"]}, source=lambda g: eps[g])


class FakeRunner:
    def __init__(self):
        self.calls = []

    def execute_model(self, so):
        self.calls.append("exec")
        return None

    def sample_tokens(self, grammar):
        self.calls.append("sample")
        return f"out{len(self.calls)}"


def fake_worker(rank=0, tp=1, dp_rank=0, dp=1):
    return NS(rank=rank, model_runner=FakeRunner(),
              vllm_config=NS(parallel_config=NS(tensor_parallel_size=tp, data_parallel_rank=dp_rank,
                                                data_parallel_size=dp)))


def new(rid, cid=None):
    return NS(req_id=rid, sampling_params=NS(extra_args={"fake_id": cid} if cid else None))


def step(new_reqs=(), finished=(), sched=None):
    return NS(scheduled_new_reqs=list(new_reqs), finished_req_ids=set(finished), num_scheduled_tokens=sched or {})


CFG = {"contents": ["fake"], "probes": [], "settings": {"fake": {"x": 1}}}


def test_step_hook_fires_only_for_flagged_steps_and_fetch_hands_over_once():
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host())
    cap = rt.captures["fake"]
    assert w.settings_seen == {"fake": {"x": 1}}  # settings travel in init, not by environment
    mr = w.model_runner
    mr.execute_model(step([new("a")], sched={"a": 5}))  # unflagged: no hook
    mr.sample_tokens(None)
    assert cap.events == []
    mr.execute_model(step([new("b", "cid-b")], sched={"a": 1, "b": 7}))
    out = mr.sample_tokens(None)
    assert cap.events == [("begin", 1, {"b": "cid-b"})]  # end_step: after the output went back (deferred)
    rt.settle()
    assert cap.events == [("begin", 1, {"b": "cid-b"}), ("end", 1, out, False)]
    mr.execute_model(step(finished=["b"], sched={"a": 1}))  # b finished: back to the fast path
    mr.sample_tokens(None)
    assert len(cap.events) == 2
    assert rt.call("fake.stats", [])["live_flagged"] == 0
    got = rt.call("fake.fetch", ["cid-b"])
    assert got["found"] == [7] and got["dp_rank"] == 0
    assert rt.call("fake.fetch", ["cid-b"])["absent"] == "fetched"  # a second fetch names the cause
    assert rt.call("fake.fetch", ["never"])["absent"] == "unknown"


def test_a_failing_step_hook_fails_its_requests_not_the_engine():
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host(fail_in="begin"))
    w.model_runner.execute_model(step([new("b", "cid-b")], sched={"b": 3}))
    w.model_runner.sample_tokens(None)  # the engine step itself completes
    ans = rt.call("fake.fetch", ["cid-b"])
    assert ans["absent"] == "failed" and "KeyError" in ans["error"] and "begin_step" in ans["error"]


@pytest.mark.parametrize("fail_in, hook, handing", [("begin", "begin_step", False), ("pop", "pop", False),
                                                   ("handover", "handover", True)])
async def test_a_worker_plugin_fault_is_an_internal_error_of_its_request(tmp_path, fail_in, hook, handing):
    """A worker capture's own exception (a step hook, pop on the RPC fetch, handover out of band) reaches the driver
    as a PluginFault naming the content's worker capture and the method: the request's receipt is
    ``internal_error`` (a plugin broke its contract, as for a driver-side plugin), not ``capture_invalid`` (engine
    data out of bounds; the engine test test_engine_worker_faults checks the receipt); the RPC never raises, and the
    request's rows are dropped."""
    if handing:
        ho, w, rt, eng = handing_engine(tmp_path, fail_in)
    else:
        w = fake_worker()
        rt = WorkerRuntime(w, CFG, host=make_host(fail_in=fail_in))
        eng, ho = HandoverEngine(rt, None), None
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))
    with pytest.raises(PluginFault, match=f"worker capture failed on dp rank 0: {hook}: ") as fault:
        await _fetch_no_wait(eng, "c1")
    assert (fault.value.plugin, fault.value.method) == ("fake worker capture", hook)
    assert rt.captures["fake"].rows == {} and "found" not in rt.call("fake.fetch", ["c1"])
    if ho is not None:
        assert ho.files() == []
        ho.close()


@pytest.mark.parametrize("fail_in", ["unprintable", "secret"])
def test_a_hostile_hook_exception_text_cannot_escape_or_leak(fail_in):
    """An exception whose __str__ raises used to escape the isolation (the engine step failed); a plugin's
    message carrying a presigned URL or 100 KB reached the logs and the fetch answer verbatim."""
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host(fail_in=fail_in))
    w.model_runner.execute_model(step([new("b", "cid-b")], sched={"b": 3}))
    assert w.model_runner.sample_tokens(None) is not None  # the engine step itself completes
    ans = rt.call("fake.fetch", ["cid-b"])
    assert ans["absent"] == "failed" and "begin_step" in ans["error"]
    assert "SECRETSIG" not in ans["error"] and len(ans["error"]) < 400


def test_only_tp_rank_zero_captures_and_other_ranks_answer_none():
    w1 = fake_worker(rank=1, tp=2)
    rt = WorkerRuntime(w1, CFG, host=make_host())
    assert rt.capturing is False and rt.captures == {}
    assert w1.model_runner.execute_model.__func__ is FakeRunner.execute_model  # nothing wrapped
    assert rt.call("fake.fetch", ["x"]) is None
    a = rt.answer()
    assert a["enabled"] == {"contents": ["fake"], "probes": []} and a["captures"] == [] and a["tp_rank"] == 1


def test_init_rpc_and_reinit_with_another_config_is_refused(monkeypatch):
    import genartifact.engine.worker_ext as wx

    w = fake_worker()
    monkeypatch.setattr(wx, "WorkerRuntime", lambda worker, cfg: WorkerRuntime(worker, cfg, host=make_host()))
    with pytest.raises(RuntimeError, match="not initialised"):
        _dispatch(w, "fake.stats")
    ans = _dispatch(w, "init", CFG)
    assert ans["captures"] == ["fake"] and ans["capturing"] is True
    assert _dispatch(w, "init", CFG) == ans  # idempotent
    with pytest.raises(RuntimeError, match="already initialised"):
        _dispatch(w, "init", {"contents": [], "probes": []})
    assert _dispatch(w, "batch", "fake.fetch", [["a"], ["b"]]) == [
        {"absent": "unknown", "dp_rank": 0, "tp_rank": 0, "rank": 0}] * 2


class Answers:
    def __init__(self, answers):
        self.answers = answers
        self.data_parallel_size = max(int(a.get("dp_size", 1)) for a in answers if a) if any(answers) else 1

    async def worker_call(self, method, *args):
        return self.answers


def ab(dp, how="unknown", dp_size=2):
    return {"absent": how, "dp_rank": dp, "tp_rank": 0, "dp_size": dp_size}


async def test_fetch_capture_picks_the_serving_engine_and_names_causes():
    # engine 1 of 2 served the request; rank 1 of each TP pair answers None
    got = await fetch_capture(Answers([ab(0), None, {"found": "rows", "dp_rank": 1, "tp_rank": 0}, None]),
                              "fake", "c")
    assert got == "rows"
    with pytest.raises(CaptureError, match=r"answers came from data-parallel ranks \[0\] of 2"):
        await fetch_capture(Answers([ab(0), None]), "fake", "c")
    with pytest.raises(CaptureError, match="already fetched"):
        await fetch_capture(Answers([ab(0), ab(1, "fetched")]), "fake", "c")
    with pytest.raises(CaptureError, match="none of the 2 capturing workers"):
        await fetch_capture(Answers([ab(0), ab(1)]), "fake", "c")
    with pytest.raises(CaptureError, match="2 workers"):
        await fetch_capture(Answers([{"found": 1, "dp_rank": 0}, {"found": 2, "dp_rank": 1}]), "fake", "c")
    with pytest.raises(CaptureError, match="not installed"):
        await fetch_capture(Answers([None, None]), "fake", "c")


def test_vllm_general_plugin_attaches_the_rpc_method_only():
    pytest.importorskip("vllm")
    from vllm.v1.worker.worker_base import WorkerBase

    register_vllm_plugin()
    register_vllm_plugin()  # idempotent
    assert callable(WorkerBase.genartifact_call)
    w = WorkerBase.__new__(WorkerBase)
    with pytest.raises(RuntimeError, match="not initialised"):  # passive until a genartifact engine sends init
        w.genartifact_call("moe_routes.fetch", "x", 0, 1)


async def test_start_fails_clearly_when_a_worker_reports_another_plugin_set():
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.errors import EngineStartError

    def ans(dp, tp, contents, captures):
        return {"enabled": {"contents": contents, "probes": []}, "captures": captures, "capturing": tp == 0,
                "rank": tp, "dp_rank": dp, "tp_rank": tp, "dp_size": 1}

    class FakeLLM:
        def __init__(self, answers):
            self.answers = answers

        async def collective_rpc(self, name, args=()):
            assert name == "genartifact_call" and args[0] == "init"
            assert args[1]["contents"] == ["moe_routes"]  # the config travels in the call
            assert args[1]["step_end"] == "deferred"  # (VllmEngine(worker_step_end=...))
            return self.answers

    eng = VllmEngine(PluginHost({"contents": ["moe_routes"]}), "/m")
    eng.llm = FakeLLM([ans(0, 0, ["moe_routes"], ["moe_routes"]), ans(0, 1, [], [])])
    with pytest.raises(EngineStartError, match=r"tensor-parallel rank 1\) enabled .*'contents': \[\]"):
        await eng._init_workers()
    eng.llm = FakeLLM([ans(0, 0, ["moe_routes"], ["moe_routes"]), ans(0, 1, ["moe_routes"], [])])
    assert await eng._init_workers() == {"moe_routes"}


def test_init_config_carries_enabled_plugins_and_content_settings(tmp_path):
    from genartifact.engine.worker_ext import init_config

    host = PluginHost({"contents": ["moe_routes", "selected_logprobs"]},
                      content_settings={"moe_routes": {"base_dir": tmp_path, "x": 1}})
    cfg = init_config(host)
    assert cfg == {"contents": ["moe_routes", "selected_logprobs"], "probes": [],
                   "settings": {"moe_routes": {"base_dir": str(tmp_path), "x": 1}}}


async def test_worker_init_failure_is_a_start_error_and_a_missing_method_turns_capture_off():
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.errors import EngineStartError

    class FakeLLM:
        def __init__(self, msg):
            self.msg = msg

        async def collective_rpc(self, name, args=()):
            raise RuntimeError(self.msg)

    eng = VllmEngine(PluginHost({"contents": ["moe_routes"]}), "/m")
    eng.llm = FakeLLM("Call to collective_rpc method failed: UnknownPluginError: unknown content 'moe_routes' "
                      "(while running genartifact_call)")
    with pytest.raises(EngineStartError, match="worker init failed: .*UnknownPluginError"):
        await eng._init_workers()
    eng.llm = FakeLLM("AttributeError: 'CPUWorker' object has no attribute 'genartifact_call'")
    assert await eng._init_workers() == set() and eng.workers == []


# ------------------------------------------------------------------- out-of-band handover (no collective_rpc)

class HandingRecorder(Recorder):
    def handover(self, cid, extra_args):
        if self.fail_in == "handover":
            raise OSError("handover broke")
        rows = self.rows.pop(cid, None)
        return None if rows is None else {"rows": rows, "extra": dict(extra_args)}


def handing_host(fail_in=None):
    return make_host(fail_in, HandingRecorder)


class HandoverEngine:
    """A driver-side engine handle over one fake worker runtime: worker_call is the RPC path."""

    def __init__(self, rt, handover):
        self.rt, self.handover, self.rpcs, self.data_parallel_size = rt, handover, [], 1

    async def worker_call(self, method, *args):
        self.rpcs.append(method)
        return [self.rt.call(method, args)]


def handing_engine(tmp_path, fail_in=None):
    """A handover folder under ``tmp_path`` covering ``fake``, a fake worker whose runtime hands over into it,
    and the driver-side engine over both: ``(handover, worker, runtime, engine)``."""
    from genartifact.engine.worker_ext import Handover

    ho = Handover(str(tmp_path))
    ho.contents = {"fake"}
    w = fake_worker()
    rt = WorkerRuntime(w, {**CFG, "handover": ho.config()}, host=handing_host(fail_in))
    return ho, w, rt, HandoverEngine(rt, ho)


def run_request(mr, rid, cid, tokens=(5, 1, 1)):
    mr.execute_model(step([NS(req_id=rid, sampling_params=NS(extra_args={"fake_id": cid, "start": 3}))],
                          sched={rid: tokens[0]}))
    mr.sample_tokens(None)
    for n in tokens[1:]:
        mr.execute_model(step(sched={rid: n}))
        mr.sample_tokens(None)


async def test_handover_writes_finished_rows_out_of_band_and_fetch_needs_no_rpc(tmp_path):
    from genartifact.engine.worker_ext import Handover

    ho = Handover(str(tmp_path))
    w = fake_worker()
    rt = WorkerRuntime(w, {**CFG, "handover": ho.config()}, host=handing_host())
    assert rt.answer()["handover"] == ["fake"]
    ho.contents = {"fake"}
    eng = HandoverEngine(rt, ho)
    run_request(w.model_runner, "r1", "c1")
    assert ho.files() == []  # nothing before vLLM tells the worker that the request finished
    w.model_runner.execute_model(step(finished=["r1"]))  # the engine core's step after the last one
    assert ho.files() == ["fake.c1"]
    got = await fetch_capture(eng, "fake", "c1", "ignored-args")
    assert got == {"rows": [5, 1, 1], "extra": {"fake_id": "c1", "start": 3}}
    assert eng.rpcs == [] and ho.files() == [] and rt.call("fake.stats", [])["requests"] == 0
    with pytest.raises(CaptureError, match="already handed over"):  # second fetch: file gone, worker names it
        await _fetch_no_wait(eng, "c1")
    ho.close()
    assert not (tmp_path / ho.dir).exists()


async def test_requests_finishing_in_one_step_are_handed_over_in_one_file(tmp_path):
    """Three flagged requests that finish in the same engine step: the worker writes one step file for all of them
    (one write on the engine's critical path, one read on the driver's), and each capture is taken from it."""
    from genartifact.engine.worker_ext import Handover

    ho = Handover(str(tmp_path))
    w = fake_worker()
    rt = WorkerRuntime(w, {**CFG, "handover": ho.config()}, host=handing_host())
    ho.contents = {"fake"}
    eng = HandoverEngine(rt, ho)
    mr = w.model_runner
    new = [NS(req_id=f"r{i}", sampling_params=NS(extra_args={"fake_id": f"c{i}"})) for i in range(3)]
    mr.execute_model(step(new, sched={f"r{i}": 2 + i for i in range(3)}))
    mr.sample_tokens(None)
    mr.execute_model(step(finished=["r0", "r1", "r2"]))
    on_disk = sorted(n for n in os.listdir(ho.dir) if n != "token")
    assert len(on_disk) == 1 and on_disk[0].startswith("step.") and rt.handover_written == 3
    for i in range(3):
        assert (await fetch_capture(eng, "fake", f"c{i}"))["rows"] == [2 + i]
    assert eng.rpcs == [] and ho.files() == [] and ho.taken == 3 and os.listdir(ho.dir) == ["token"]
    ho.close()


async def test_large_binary_answers_go_as_blobs_and_large_step_files_are_read_off_the_event_loop(tmp_path,
                                                                                                  monkeypatch):
    """A worker's binary values of at least STEP_BLOB_MIN bytes in an answer's maps go after the step file's header
    (written from the worker's own buffer, read back into ``bytes`` with ``pread``); smaller ones, and those in
    lists, stay in the header. A step file above STEP_INLINE_MAX is read by the handover's reader thread (the event
    loop runs on meanwhile), a smaller one on the loop; both give the answers exactly as the worker made them."""
    import threading

    import genartifact.engine.worker_ext as wx
    import numpy as np

    reads = []
    real = wx.read_step_file

    def spy(fd, size):
        reads.append((size, threading.current_thread() is threading.main_thread()))
        return real(fd, size)

    monkeypatch.setattr(wx, "read_step_file", spy)
    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    big = np.arange(wx.STEP_INLINE_MAX, dtype=np.uint16).reshape(-1, 64)  # 512 KiB, 2-D, not bytes
    entries = {"fake.big": {"found": {"data": memoryview(big), "small": b"x" * 100, "edge": bytes(wx.STEP_BLOB_MIN),
                                      "nested": {"deep": bytearray(b"y" * 5000)}, "listed": [b"z" * 5000]},
                            "dp_rank": 0},
               "fake.other": {"found": [1]}}
    assert len(wx.step_file_parts(entries)) == 4  # prefix + header, then data, edge, deep
    _put_step(ho, "step.1.1", entries)
    f = (await ho.take("fake", "big", wait_s=2.0))["found"]
    assert reads[-1] == (len(wx.encode_step_file(entries)), False)  # the reader thread
    assert type(f["data"]) is bytes and f["data"] == big.tobytes()
    assert f["small"] == b"x" * 100 and f["edge"] == bytes(wx.STEP_BLOB_MIN)
    assert f["nested"] == {"deep": b"y" * 5000} and f["listed"] == [b"z" * 5000]
    assert await ho.take("fake", "other") == {"found": [1]}  # read with it, kept for its own take
    _put_step(ho, "step.1.2", {"fake.small": {"found": [2]}})
    assert await ho.take("fake", "small", wait_s=2.0) == {"found": [2]}
    assert reads[-1][1] is True  # small: on the loop, no thread hop
    assert ho.files() == [] and os.listdir(ho.dir) == ["token"]
    ho.close()


async def test_a_large_step_file_is_written_by_the_writer_thread_while_the_next_step_runs(tmp_path, monkeypatch):
    """A step file of ``handover_thread_bytes`` or more goes to the worker's writer thread: the step that hands it
    over returns without waiting for the write, the requests count as handed over only once the file is in the
    folder (reaped at a later step's entry), and an RPC verb arriving meanwhile (a fetch whose wait ran out) waits
    for the write and answers as if it had been written inline. The driver takes the same answers as from an
    inline write."""
    import threading

    import genartifact.engine.worker_ext as wx

    ho, w, rt, eng = handing_engine(tmp_path)
    w._genartifact_runtime = rt  # (as the init RPC leaves it: the runtime's verbs reach it)
    assert rt.answer()["handover_thread_bytes"] == wx.HANDOVER_THREAD_BYTES
    assert _dispatch(w, "handover_writer", 0)["handover_thread_bytes"] == 0  # every file in the thread
    gate, writers = threading.Event(), []
    real = wx._write_step_file

    def gated(path, parts):
        writers.append(threading.current_thread().name)
        assert gate.wait(10)
        real(path, parts)

    monkeypatch.setattr(wx, "_write_step_file", gated)
    mr = w.model_runner
    run_request(mr, "r1", "c1")
    mr.execute_model(step(finished=["r1"]))  # returns while its file is still being written
    assert ho.files() == [] and rt.handover_written == 0 and "c1" in rt._live["fake"] and len(rt._writes) == 1
    threading.Timer(0.2, gate.set).start()
    assert rt.call("fake.fetch", ["c1"])["absent"] == "handed_over"  # waited for the write, then answered
    assert rt.handover_written == 1 and not rt._writes and writers[0].startswith("genartifact-handover-writer")
    assert (await fetch_capture(eng, "fake", "c1"))["rows"] == [5, 1, 1]
    run_request(mr, "r2", "c2", tokens=(4, 1))
    mr.execute_model(step(finished=["r2"]))
    for _ in range(200):  # written by the thread meanwhile; the next step's entry accounts for it, no RPC needed
        if not rt._writes[0][0].done():
            threading.Event().wait(0.01)
    mr.execute_model(step())
    assert rt.handover_written == 2 and not rt._writes and "c2" not in rt._live["fake"]
    eng.rpcs.clear()
    assert (await fetch_capture(eng, "fake", "c2"))["rows"] == [4, 1] and eng.rpcs == []
    with pytest.raises(ValueError, match=r"handover_writer min_bytes -1; allowed: an int >= 0"):
        _dispatch(w, "handover_writer", -1)
    with pytest.raises(ValueError, match="allowed: an int >= 0"):
        _dispatch(w, "handover_writer", "big")
    assert _dispatch(w, "handover_writer")["handover_thread_bytes"] == wx.HANDOVER_THREAD_BYTES
    assert os.listdir(ho.dir) == ["token"]
    ho.close()


@pytest.mark.fault("worker", "a capture's handover blob that views a buffer it reuses")
@pytest.mark.parametrize(("kind", "threaded"), [(bytes, True), (bytearray, True), (memoryview, False)])
def test_only_files_of_owned_blobs_go_to_the_writer_thread(tmp_path, monkeypatch, kind, threaded):
    """A capture's ``bytes``/``bytearray`` blobs are the runtime's once handed over, so their file may be written
    while the next step runs; a ``memoryview`` blob may be a window on a buffer the capture reuses for that step, so
    its file is written before the step, whatever its size (nothing can change under the write)."""
    import threading

    import genartifact.engine.worker_ext as wx

    ho, w, rt, eng = handing_engine(tmp_path)
    rt.handover_thread_bytes = 0
    kept = bytearray(b"k" * 8192)  # the capture's own buffer, reused for the next request
    blob = {bytes: lambda: bytes(kept), bytearray: lambda: bytearray(kept), memoryview: lambda: memoryview(kept)}[kind]
    orig = rt.captures["fake"].handover
    monkeypatch.setattr(rt.captures["fake"], "handover", lambda cid, extra: {**orig(cid, extra), "blob": blob()})
    writers = []
    real = wx._write_step_file
    monkeypatch.setattr(wx, "_write_step_file", lambda p, parts: (writers.append(threading.current_thread()),
                                                                  real(p, parts)))
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))
    kept[:] = b"x" * 8192  # the capture reuses its buffer as soon as the next step runs
    rt.reap_writes(wait=True)
    assert (writers[0] is not threading.main_thread()) is threaded
    got = ho.read("fake", "c1")["found"]
    assert got["rows"] == [5, 1, 1] and (got["blob"] == b"k" * 8192 or threaded and kind is memoryview)
    ho.close()


@pytest.mark.fault("worker", "the handover writer thread cannot be started (thread limit)")
def test_a_writer_thread_that_cannot_start_leaves_the_file_written_before_the_step(tmp_path, monkeypatch):
    """No thread to be had (a process at its thread limit): the step file is written before the step as a small
    one is, the step runs on, no write is left queued to run later behind the runtime's back, and the next large
    file tries a writer thread again."""
    import threading

    import genartifact.engine.worker_ext as wx

    ho, w, rt, eng = handing_engine(tmp_path)
    rt.handover_thread_bytes = 0
    written = []
    real_write = wx._write_step_file
    monkeypatch.setattr(wx, "_write_step_file", lambda p, parts: (written.append(os.path.basename(p)),
                                                                  real_write(p, parts)))
    real_start = threading.Thread.start

    def no_thread(self):
        if self.name.startswith("genartifact-handover-writer"):
            raise RuntimeError("can't start new thread")
        return real_start(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(threading.Thread, "start", no_thread)
        run_request(w.model_runner, "r1", "c1")
        assert w.model_runner.execute_model(step(finished=["r1"])) is None  # the step ran
        assert rt.handover_written == 1 and not rt._writes and rt._writer is None and ho.files() == ["fake.c1"]
        assert "c1" not in rt._live["fake"] and rt.unwritten["fake"] == {}
    run_request(w.model_runner, "r2", "c2")
    w.model_runner.execute_model(step(finished=["r2"]))
    rt.reap_writes(wait=True)
    assert rt._writer is not None and rt.handover_written == 2
    assert sorted(ho.files()) == ["fake.c1", "fake.c2"]
    assert len(written) == len(set(written)) == 2  # c1's file written once: the cancelled queued write never ran
    ho.close()


def test_the_idle_wait_accounts_for_finished_writes(tmp_path):
    """After the last step of a burst, a step file the writer thread finished is accounted for (its requests
    handed over, its answers freed) in the worker's wait for the engine's next call, not only at the next step."""
    import genartifact.engine.worker_ext as wx

    class Loop:  # vLLM's worker loop, as _hook_idle_wait finds it among its callers
        def __init__(self):
            self.rpc_broadcast_mq = NS(dequeue=lambda *a, **kw: "the next call")

        def worker_busy_loop(self):
            pass

        def hook(self, rt):
            return wx._hook_idle_wait(rt)

    ho, w, rt, eng = handing_engine(tmp_path)
    rt.handover_thread_bytes = 0
    loop = Loop()
    assert loop.hook(rt) == "Loop"
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))
    rt._writes[0][0].result(timeout=10)  # written; not yet accounted for
    assert rt.handover_written == 0 and "c1" in rt._live["fake"]
    assert loop.rpc_broadcast_mq.dequeue() == "the next call"  # the worker's loop waits for the engine
    assert not rt._writes and rt.handover_written == 1 and "c1" not in rt._live["fake"]
    ho.close()


def _no_space(src, dst):
    """``os.replace`` on a full ``/dev/shm``."""
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.fault("worker", "/dev/shm full while the writer thread writes a step file")
async def test_a_failed_threaded_write_keeps_its_rows_for_rpc_and_leaves_no_file(tmp_path, monkeypatch):
    """The writer thread's write fails (``/dev/shm`` full): nothing of it stays in the folder, its requests'
    answers are kept for the RPC fetch, which gets them unchanged; a discard drops them; the folder switched
    off meanwhile waits for a write under way first."""
    import threading

    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.01)
    ho, w, rt, eng = handing_engine(tmp_path)
    w._genartifact_runtime = rt
    _dispatch(w, "handover_writer", 0)

    monkeypatch.setattr(wx.os, "replace", _no_space)
    for rid, cid in (("r1", "c1"), ("r2", "c2")):
        run_request(w.model_runner, rid, cid)
        w.model_runner.execute_model(step(finished=[rid]))
    assert (await wx.fetch_capture(eng, "fake", "c1"))["rows"] == [5, 1, 1]  # reaped by the RPC, then fetched
    # c2's marker (made by the writer thread when its write failed, read by c1's take or by this scan) tells the
    # driver that c2's answer comes by RPC only; no partial or temporary file is left
    assert list(rt.unwritten["fake"]) == ["c2"] and ho.files() == [] and list(ho._by_rpc) == ["fake.c2"]
    assert os.listdir(ho.dir) == ["token"]
    await wx.discard_capture(eng, "fake", "c2")
    assert rt.unwritten["fake"] == {} and os.listdir(ho.dir) == ["token"] and not ho._by_rpc
    monkeypatch.undo()
    gate = threading.Event()
    real = wx._write_step_file
    monkeypatch.setattr(wx, "_write_step_file", lambda p, parts: (gate.wait(10), real(p, parts)))
    run_request(w.model_runner, "r3", "c3")
    w.model_runner.execute_model(step(finished=["r3"]))
    threading.Timer(0.2, gate.set).start()
    _dispatch(w, "handover", None)  # off: the write under way finishes first, into the folder it was meant for
    assert rt.handover_written == 1 and ho.files() == ["fake.c3"]
    ho.close()


async def test_a_fetch_falling_back_to_rpc_waits_for_the_large_step_file_being_read(tmp_path, monkeypatch):
    """The take's wait ends while the reader thread still reads the large step file holding its answer, and the
    worker says it handed the rows over: the fetch waits for the read (Handover.settle) and gets the answer, not
    a 'handed over' error; closing the handover with a large file claimed and not yet read closes it."""
    import time

    import genartifact.engine.worker_ext as wx

    real = wx.read_step_file

    def slow(fd, size):
        time.sleep(0.2)
        return real(fd, size)

    monkeypatch.setattr(wx, "read_step_file", slow)
    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.0)
    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    rows = bytes(range(256)) * (wx.STEP_INLINE_MAX // 128)

    async def worker_call(method, *args):
        return [{"absent": "handed_over", "dp_rank": 0}]

    eng = types.SimpleNamespace(handover=ho, data_parallel_size=1, worker_call=worker_call)
    _put_step(ho, "step.1.1", {"fake.c": {"found": {"data": rows}}})
    assert (await wx.fetch_capture(eng, "fake", "c"))["data"] == rows
    _put_step(ho, "step.1.2", {"fake.d": {"found": {"data": rows}}})
    assert ho.read("fake", "d") is None  # claimed for the reader thread, not read yet
    (_, fd, _), = ho._claimed
    ho.close()
    with pytest.raises(OSError):
        os.fstat(fd)


def test_a_large_step_file_read_for_an_ended_or_abandoned_event_loop_is_not_lost(tmp_path, monkeypatch):
    """The reader thread's answers never depend on the task that awaited them: a read under way when
    ``asyncio.run`` ends (its drain cancelled) is merged by the next loop's take, and a drain left on a loop
    that never runs again neither holds up later large files nor breaks a later fetch's ``settle``."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    real = wx.read_step_file
    monkeypatch.setattr(wx, "read_step_file", lambda fd, size: (time.sleep(0.2), real(fd, size))[1])
    big = bytes(wx.STEP_INLINE_MAX + 10)
    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}

    async def first():
        _put_step(ho, "step.1.1", {"fake.a": {"found": [1]}})
        _put_step(ho, "step.1.2", {"fake.b": {"found": {"d": big}}})  # claimed for the reader thread
        return await ho.take("fake", "a", wait_s=1.0)

    assert asyncio.run(first()) == {"found": [1]}  # ends while b's file is read: its drain is cancelled
    assert asyncio.run(ho.take("fake", "b", wait_s=2.0)) == {"found": {"d": big}}

    abandoned = asyncio.new_event_loop()
    _put_step(ho, "step.1.3", {"fake.c": {"found": {"d": big}}})
    assert abandoned.run_until_complete(ho.take("fake", "c", wait_s=0.0)) is None  # claimed; its drain left pending

    async def worker_call(method, *args):
        return [{"absent": "handed_over", "dp_rank": 0}]

    eng = types.SimpleNamespace(handover=ho, data_parallel_size=1, worker_call=worker_call)
    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.05)

    async def later():
        _put_step(ho, "step.1.4", {"fake.d": {"found": {"d": big}}})
        return await wx.fetch_capture(eng, "fake", "d"), await wx.fetch_capture(eng, "fake", "c")

    assert asyncio.run(later()) == ({"d": big}, {"d": big})
    assert ho.files() == [] and os.listdir(ho.dir) == ["token"]
    ho.close()
    abandoned.close()


def test_step_file_limits_refuse_a_huge_header_and_tiny_blobs(tmp_path):
    """A writer keeps a header above STEP_HEADER_MAX for the RPC fetch (a driver would refuse it); a reader refuses
    a declared header above it unread, and blobs below STEP_BLOB_MIN (one pread each: a 256 KiB file of 1-byte blobs
    would hold the loop for tens of ms)."""
    import genartifact.engine.worker_ext as wx
    import msgspec

    with pytest.raises(ValueError, match="above STEP_HEADER_MAX"):
        wx.step_file_parts({"fake.a": {"found": list(range(wx.STEP_HEADER_MAX // 4))}})
    path = tmp_path / "f"
    tiny = msgspec.msgpack.encode([msgspec.msgpack.Ext(1, wx._BLOB_LEN.pack(1))])
    for data, why in ((wx._STEP_PREFIX.pack(wx.STEP_MAGIC, wx.STEP_VERSION, wx.STEP_HEADER_MAX + 1)
                       + bytes(wx.STEP_HEADER_MAX + 1), "at most"),
                      (wx._STEP_PREFIX.pack(wx.STEP_MAGIC, wx.STEP_VERSION, len(tiny)) + tiny + b"x",
                       "blobs are at least")):
        path.write_bytes(data)
        fd = os.open(path, os.O_RDONLY)
        try:
            with pytest.raises(ValueError, match=why):
                wx.read_step_file(fd, len(data))
        finally:
            os.close(fd)


def test_a_raising_drop_never_breaks_discard_nor_keeps_an_unwritten_answer(tmp_path):
    """discard of a request whose step file could not be written (its answer kept for RPC) forgets that answer
    even when the plugin's drop raises (logged); the RPC answers, and nothing stays for the worker's life."""
    import genartifact.engine.worker_ext as wx
    import numpy as np

    class D(HandingRecorder):
        def handover(self, cid, extra):
            return {"d": np.zeros(3)}  # not msgpack-native: the step file cannot be written

        def drop(self, cid):
            raise RuntimeError("drop broke")

    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    w = fake_worker()
    rt = WorkerRuntime(w, {**CFG, "handover": ho.config()}, host=make_host(None, D))
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))
    assert list(rt.unwritten["fake"]) == ["c1"]
    assert rt.call("fake.discard", ["c1"]) is True
    assert rt.unwritten["fake"] == {} and "c1" not in rt._live["fake"] and rt.gone["fake"]["c1"] == "discarded"
    ho.close()


def test_a_guarded_callable_with_a_hostile_name_cannot_escape_the_guard():
    """guard names the callable by its ``__qualname__``: a lookup that raises, or a name carrying a secret or
    100 KB, neither escapes into vLLM's call nor reaches the fault text unbounded."""
    import genartifact.engine.worker_ext as wx

    class Odd:
        def __getattr__(self, n):
            raise RuntimeError("no attributes here")

        def __call__(self):
            raise ValueError("x")

    class Long:
        __qualname__ = "token=SECRETSIG " + "y" * 100_000

        def __call__(self):
            raise ValueError("x")

    s = wx.WorkerStep(None, {}, 1)
    assert s.guard("c", Odd()) is None and s.faults["c"].startswith("callback: ValueError")
    assert s.guard("d", Long()) is None
    assert "SECRETSIG" not in s.faults["d"] and len(s.faults["d"]) < 300


async def _fetch_no_wait(eng, cid):
    import genartifact.engine.worker_ext as wx

    old, wx.HANDOVER_WAIT_S = wx.HANDOVER_WAIT_S, 0.01
    try:
        return await wx.fetch_capture(eng, "fake", cid)
    finally:
        wx.HANDOVER_WAIT_S = old


async def test_handover_falls_back_to_rpc_and_reports_failures_and_discards(tmp_path, monkeypatch):
    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.01)
    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    # a worker on another machine (token differs): no handover, fetch by RPC
    w2 = fake_worker()
    rt2 = WorkerRuntime(w2, {**CFG, "handover": {"dir": ho.dir, "token": "other"}}, host=handing_host())
    assert rt2.answer()["handover"] == [] and rt2.handover_dir is None
    eng2 = HandoverEngine(rt2, ho)
    run_request(w2.model_runner, "r1", "c1")
    w2.model_runner.execute_model(step(finished=["r1"]))
    assert ho.files() == []
    assert (await wx.fetch_capture(eng2, "fake", "c1")) == [5, 1, 1] and eng2.rpcs == ["fake.fetch"]
    # same machine: a failed step hook travels in the file; a discarded request leaves no file behind
    w = fake_worker()
    rt = WorkerRuntime(w, {**CFG, "handover": ho.config()}, host=handing_host("begin"))
    eng = HandoverEngine(rt, ho)
    run_request(w.model_runner, "r2", "c2")
    w.model_runner.execute_model(step(finished=["r2"]))
    with pytest.raises(PluginFault, match="capture failed.*boom") as fault:
        await wx.fetch_capture(eng, "fake", "c2")
    assert (fault.value.plugin, fault.value.method, fault.value.error_type) == ("fake worker capture", "begin_step",
                                                                                "KeyError")
    rt.failed["fake"].clear()
    rt.captures["fake"].fail_in = None
    run_request(w.model_runner, "r3", "c3")
    await wx.discard_capture(eng, "fake", "c3")  # cancelled before the worker learnt it finished
    w.model_runner.execute_model(step(finished=["r3"]))
    run_request(w.model_runner, "r4", "c4")
    w.model_runner.execute_model(step(finished=["r4"]))
    assert ho.files() == ["fake.c4"]
    await wx.discard_capture(eng, "fake", "c4")  # cancelled after the file was written
    assert ho.files() == []
    # a handover file that cannot be written (folder gone) leaves the rows for the RPC fetch: nothing is lost
    ho.close()
    run_request(w.model_runner, "r5", "c5")
    w.model_runner.execute_model(step(finished=["r5"]))
    assert list(rt.unwritten["fake"]) == ["c5"]
    eng.rpcs.clear()
    assert (await wx.fetch_capture(eng, "fake", "c5"))["rows"] == [5, 1, 1] and eng.rpcs == ["fake.fetch"]
    assert rt.unwritten["fake"] == {}
    with pytest.raises(CaptureError, match="already fetched"):
        await wx.fetch_capture(eng, "fake", "c5")


def test_stale_handover_folders_of_dead_drivers_are_swept(tmp_path):
    import subprocess

    from genartifact.engine.worker_ext import Handover, sweep_handover_dirs

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = tmp_path / f"genartifact-{p.pid}-abc"
    dead.mkdir()
    (dead / "moe_routes.x").write_bytes(b"rows")
    live = Handover(str(tmp_path))
    other = tmp_path / "unrelated"
    other.mkdir()
    assert not dead.exists() and Path(live.dir).exists() and other.exists()
    assert sweep_handover_dirs(str(tmp_path)) == []  # this process is alive: its folder stays
    live.close()


@pytest.mark.fault("worker", "handover folder liveness by lock, not pid")
def test_handover_sweep_judges_liveness_by_lock_not_pid(tmp_path):
    """A sweep must not delete a live engine's folder whose pid it cannot see (a driver in another pid namespace
    sharing /dev/shm: its pid looks dead here), and must delete an abandoned folder whose pid was reused."""
    import os
    import subprocess
    import time

    from genartifact.engine.worker_ext import _STAGING_STALE_S, Handover, sweep_handover_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    foreign = tmp_path / f"genartifact-{gone.pid}-ns"  # the pid of a driver in another namespace: dead here
    foreign.mkdir()
    (foreign / "moe_routes.c1").write_bytes(b"rows of a request in flight")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(foreign)!r}, os.O_RDONLY)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        reused = tmp_path / f"genartifact-{os.getpid()}-old"  # abandoned; its pid now names a live process
        reused.mkdir()
        (reused / "moe_routes.c2").write_bytes(b"leftover")
        staging = tmp_path / ".genartifact-new-x"  # a driver killed while making its folder
        staging.mkdir()
        old = time.time() - _STAGING_STALE_S - 1
        os.utime(staging, (old, old))
        fresh = tmp_path / ".genartifact-new-y"  # being made right now
        fresh.mkdir()
        live = Handover(str(tmp_path))
        assert foreign.exists() and (foreign / "moe_routes.c1").exists()
        assert not reused.exists() and not staging.exists() and fresh.exists()
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([foreign.name, fresh.name, Path(live.dir).name])
        assert sweep_handover_dirs(str(tmp_path)) == []  # held by this process and by the holder
    finally:
        holder.kill()
        holder.wait()
    assert sweep_handover_dirs(str(tmp_path)) == [str(foreign)]  # its last holder died (kill -9): swept
    assert Path(live.dir).exists()
    live.close()
    assert not Path(live.dir).exists() and live._lock_fd is None
    assert sweep_handover_dirs(str(tmp_path)) == []


@pytest.mark.fault("worker", "handover folder full (ENOSPC)")
async def test_full_handover_folder_keeps_rows_for_rpc_and_leaves_no_partial_file(tmp_path, monkeypatch):
    """/dev/shm full: the worker's write fails with ENOSPC; no partial or temporary file is left, the finished
    request's rows come through the RPC fetch unchanged, a discarded one's are dropped, and the next request
    (space back) is handed over out of band again."""
    import errno

    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.01)
    ho, w, rt, eng = handing_engine(tmp_path)
    real_replace = wx.os.replace

    def full(src, dst):
        with open(src, "r+b") as f:  # the write got partway
            f.truncate(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(wx.os, "replace", full)
    for rid, cid in (("r1", "c1"), ("r2", "c2")):
        run_request(w.model_runner, rid, cid)
        w.model_runner.execute_model(step(finished=[rid]))
    assert ho.files() == [] and sorted(rt.unwritten["fake"]) == ["c1", "c2"]
    assert (await wx.fetch_capture(eng, "fake", "c1"))["rows"] == [5, 1, 1]
    await wx.discard_capture(eng, "fake", "c2")
    assert rt.unwritten["fake"] == {}
    monkeypatch.setattr(wx.os, "replace", real_replace)
    run_request(w.model_runner, "r3", "c3")
    w.model_runner.execute_model(step(finished=["r3"]))
    assert ho.files() == ["fake.c3"]
    eng.rpcs.clear()
    assert (await wx.fetch_capture(eng, "fake", "c3"))["rows"] == [5, 1, 1] and eng.rpcs == []
    ho.close()


@pytest.mark.fault("worker", "/dev/shm full for many steps: one warning per interval and cause, not one per step")
async def test_a_persistently_full_handover_folder_logs_once_per_interval_and_cause(tmp_path, monkeypatch):
    """Step files keep failing: the first failure of each cause (a full /dev/shm; an answer the step file cannot
    hold, a plugin's bug) is a warning at once with its own error, later ones of that cause inside
    HANDOVER_FAIL_LOG_S are counted, not logged; the next line after the interval says how many it stood for; a
    successful write HANDOVER_FAIL_LOG_S after the last failure ends the episode with one
    ``worker_handover_recovered`` line and its totals. Every answer still comes through the RPC fetch unchanged."""
    import genartifact.engine.worker_ext as wx
    import structlog

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.01)
    monkeypatch.setattr(wx, "HANDOVER_FAIL_LOG_S", 3600.0)
    ho, w, rt, eng = handing_engine(tmp_path)
    real_replace, real_step_file = wx.os.replace, wx._step_file

    def unserializable(entries):
        raise TypeError("can not serialize 'Tensor' object")

    def finish(i):
        run_request(w.model_runner, f"r{i}", f"c{i}")
        w.model_runner.execute_model(step(finished=[f"r{i}"]))

    with structlog.testing.capture_logs() as logs:
        monkeypatch.setattr(wx.os, "replace", _no_space)
        for i in range(3):
            finish(i)
        monkeypatch.setattr(wx.os, "replace", real_replace)
        monkeypatch.setattr(wx, "_step_file", unserializable)
        finish(3)
        finish(4)
        monkeypatch.setattr(wx, "_step_file", real_step_file)
        monkeypatch.setattr(wx.os, "replace", _no_space)
        monkeypatch.setattr(wx, "HANDOVER_FAIL_LOG_S", 0.0)  # the interval is over
        finish(5)
        monkeypatch.setattr(wx.os, "replace", real_replace)
        finish(6)
        finish(7)
    lines = [(x["event"], x.get("error", "")[:7], x.get("suppressed_steps"), x.get("unwritten_steps"),
              x.get("unreported_steps")) for x in logs if x["event"].startswith("worker_handover_")]
    assert lines == [("worker_handover_unwritten", "OSError", 0, None, None),
                     ("worker_handover_unwritten", "TypeErr", 0, None, None),
                     ("worker_handover_unwritten", "OSError", 2, None, None),
                     ("worker_handover_recovered", "", None, 6, 1)]  # (the 2nd TypeError: never reported alone)
    for i in range(6):
        assert (await wx.fetch_capture(eng, "fake", f"c{i}"))["rows"] == [5, 1, 1]
    assert rt.unwritten["fake"] == {} and sorted(ho.files()) == ["fake.c6", "fake.c7"]
    assert rt.call("fake.stats", [])["unwritten_steps"] == 6
    ho.close()


@pytest.mark.fault("worker", "/dev/shm nearly full: every other step file fails")
async def test_flapping_step_file_writes_log_once_and_summarize_when_the_folder_changes(tmp_path, monkeypatch):
    """Failures and successes alternate (small files fit, larger ones do not): one warning, no "recovered" line
    per success (the failures have not stopped), the counts in ``stats``; switching the handover folder ends the
    episode with one summary line (nothing counted is left unreported)."""
    import errno

    import genartifact.engine.worker_ext as wx
    import structlog

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.01)
    monkeypatch.setattr(wx, "HANDOVER_FAIL_LOG_S", 3600.0)
    ho, w, rt, eng = handing_engine(tmp_path)
    real_replace = wx.os.replace
    calls = [0]

    def every_other(src, dst):
        calls[0] += 1
        if calls[0] % 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(wx.os, "replace", every_other)
    with structlog.testing.capture_logs() as logs:
        for i in range(10):
            run_request(w.model_runner, f"r{i}", f"c{i}")
            w.model_runner.execute_model(step(finished=[f"r{i}"]))
        stats = rt.call("fake.stats", [])
        rt.set_handover(None)
    lines = [(x["event"], x.get("unwritten_steps"), x.get("written"), x.get("unreported_steps"))
             for x in logs if x["event"].startswith("worker_handover_")]
    assert lines == [("worker_handover_unwritten", None, None, None),
                     ("worker_handover_unwritten_summary", 5, 5, 4)]
    assert (stats["unwritten_steps"], stats["unwritten_requests"], stats["handed_over"]) == (5, 5, 5)
    ho.close()


@pytest.mark.fault("worker", "handover folder full under the writer thread, engine idle afterwards")
async def test_a_threaded_write_that_fails_marks_its_answers_at_once(tmp_path, monkeypatch):
    """A step file of the writer thread fails (a long request's file, /dev/shm full) and no step follows (the engine
    is idle): the thread itself leaves the markers, so the fetch goes by RPC at once instead of waiting
    HANDOVER_WAIT_S for the next step or RPC to reap the failed write; nothing is left afterwards."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 60.0)
    ho, w, rt, eng = handing_engine(tmp_path)
    w._genartifact_runtime = rt
    _dispatch(w, "handover_writer", 0)  # every step file through the writer thread

    monkeypatch.setattr(wx.os, "replace", _no_space)
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))  # the write fails in the thread; no step reaps it
    t0 = time.monotonic()
    got = await asyncio.wait_for(wx.fetch_capture(eng, "fake", "c1"), 20)
    assert got["rows"] == [5, 1, 1] and time.monotonic() - t0 < 5
    assert os.listdir(ho.dir) == ["token"] and not ho._by_rpc and rt.unwritten["fake"] == {}
    ho.close()


def test_a_threaded_write_cancelled_before_it_ran_is_marked_when_reaped(tmp_path):
    """A queued write of the writer thread that never ran (cancelled: the executor shut down) made no marker in the
    thread: the main thread makes it when it reaps the write, and keeps the answer for the RPC fetch."""
    import concurrent.futures

    ho, w, rt, eng = handing_engine(tmp_path)
    fut = concurrent.futures.Future()
    assert fut.cancel()
    rt._writes.append((fut, [("fake", "c1", {"found": {"rows": [1]}})]))
    rt.reap_writes()
    assert sorted(os.listdir(ho.dir)) == ["nofile.fake.c1", "token"] and list(rt.unwritten["fake"]) == ["c1"]
    ho.close()


async def test_a_fetch_cancelled_after_a_marker_then_discarded_leaves_nothing(tmp_path, monkeypatch):
    """A fetch waits; the write fails (marker); the client goes (the fetch is cancelled) and the request is
    discarded before any scan: no marker, mark, tombstone or kept answer is left on either side."""
    import asyncio

    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 60.0)
    monkeypatch.setattr(wx, "HANDOVER_POLL_MAX_S", 30.0)
    ho, w, rt, eng = handing_engine(tmp_path)
    monkeypatch.setattr(wx.os, "replace", _no_space)
    run_request(w.model_runner, "r1", "c1")
    fetch = asyncio.ensure_future(wx.fetch_capture(eng, "fake", "c1"))
    await asyncio.sleep(0.05)
    w.model_runner.execute_model(step(finished=["r1"]))
    fetch.cancel()
    await asyncio.sleep(0)
    await wx.discard_capture(eng, "fake", "c1")
    await asyncio.sleep(0.05)
    assert os.listdir(ho.dir) == ["token"] and not ho._by_rpc and not ho._dropped and rt.unwritten["fake"] == {}
    ho.close()


async def test_a_marker_read_by_another_threads_scan_while_a_take_starts_waiting(tmp_path, monkeypatch):
    """A take has found neither an answer nor a mark, and before it registers its wait another thread's scan reads
    the request's marker: the take sees the mark once registered and does not wait HANDOVER_WAIT_S."""
    import asyncio
    import threading
    import time

    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 60.0)
    ho, w, rt, eng = handing_engine(tmp_path)
    monkeypatch.setattr(wx.os, "replace", _no_space)
    run_request(w.model_runner, "r1", "c1")
    real_check, fired = ho.check_folder, []

    def check_folder():  # runs inside take, between its mark check and its wait's registration
        if not fired:
            fired.append(1)
            w.model_runner.execute_model(step(finished=["r1"]))  # the worker's marker
            t = threading.Thread(target=ho.read, args=("fake", "other"))  # another thread's scan reads it
            t.start()
            t.join()
        return real_check()

    monkeypatch.setattr(ho, "check_folder", check_folder)
    t0 = time.monotonic()
    got = await asyncio.wait_for(wx.fetch_capture(eng, "fake", "c1"), 20)
    assert fired and got["rows"] == [5, 1, 1] and time.monotonic() - t0 < 5 and not ho._by_rpc
    ho.close()


@pytest.mark.fault("worker", "handover folder full: the driver's fetch does not wait for the file")
async def test_a_step_file_that_cannot_be_written_ends_the_drivers_wait_at_once(tmp_path, monkeypatch):
    """/dev/shm full: the worker leaves an empty ``nofile.<key>`` marker per answer it keeps for RPC, so a fetch
    (already waiting, or later) goes by RPC at once instead of after HANDOVER_WAIT_S (60 s here); the markers
    are consumed, a discard of a marked request leaves nothing behind on either side, and marker names that are
    not a capture's are removed without effect."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 60.0)
    ho, w, rt, eng = handing_engine(tmp_path)
    real_replace = wx.os.replace

    monkeypatch.setattr(wx.os, "replace", _no_space)
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))
    assert sorted(os.listdir(ho.dir)) == ["nofile.fake.c1", "token"]
    t0 = time.monotonic()
    got = await asyncio.wait_for(wx.fetch_capture(eng, "fake", "c1"), 20)
    assert got["rows"] == [5, 1, 1] and time.monotonic() - t0 < 5 and len(eng.rpcs) == 1
    assert os.listdir(ho.dir) == ["token"] and not ho._by_rpc and rt.unwritten["fake"] == {}

    # a fetch already waiting for the file when the write fails: the marker's rename wakes it (the folder's watch;
    # not the poller's safety scan, set to 30 s here)
    monkeypatch.setattr(wx, "HANDOVER_POLL_MAX_S", 30.0)
    run_request(w.model_runner, "r2", "c2")
    waiting = asyncio.ensure_future(wx.fetch_capture(eng, "fake", "c2"))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    t0 = time.monotonic()
    w.model_runner.execute_model(step(finished=["r2"]))
    assert (await asyncio.wait_for(waiting, 20))["rows"] == [5, 1, 1] and time.monotonic() - t0 < 5
    assert os.listdir(ho.dir) == ["token"] and not ho._by_rpc

    # a marked request discarded before any fetch: no marker, tombstone or kept answer left
    run_request(w.model_runner, "r3", "c3")
    w.model_runner.execute_model(step(finished=["r3"]))
    await wx.discard_capture(eng, "fake", "c3")
    ho.files()
    assert os.listdir(ho.dir) == ["token"] and not ho._by_rpc and not ho._dropped and rt.unwritten["fake"] == {}

    # names that are not a capture's marker: removed, nothing remembered; a directory so named is removed too
    for junk in ("nofile.", "nofile.other.c9", "nofile.fake.bad id", "nofile.fake"):
        open(os.path.join(ho.dir, junk), "w").close()
    os.makedirs(os.path.join(ho.dir, "nofile.other.c8", "sub"))
    assert ho.files() == [] and os.listdir(ho.dir) == ["token"] and not ho._by_rpc

    # space back: out of band again, no marker
    monkeypatch.setattr(wx.os, "replace", real_replace)
    run_request(w.model_runner, "r4", "c4")
    w.model_runner.execute_model(step(finished=["r4"]))
    eng.rpcs.clear()
    assert (await wx.fetch_capture(eng, "fake", "c4"))["rows"] == [5, 1, 1] and eng.rpcs == []
    assert os.listdir(ho.dir) == ["token"]
    ho.close()


@pytest.mark.fault("worker", "handover file that is not a worker's answer")
@pytest.mark.parametrize("data", [b"", b"\xc1garbage", b"\x93\x01\x02\x03", b"\x81\xa1x\x01"],
                         ids=["empty", "not-msgpack", "array", "other-map"])
@pytest.mark.parametrize("prefixed", [False, True], ids=["raw", "prefixed"])
async def test_unreadable_handover_file_fails_its_capture_clearly(tmp_path, monkeypatch, data, prefixed):
    """A handover step file that does not decode to a worker's step file (torn, or put there by another process)
    is deleted; a capture the worker says it handed over then fails with a CaptureError naming that file, never a
    decoder exception nor rows taken as found."""
    import genartifact.engine.worker_ext as wx

    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    if prefixed:  # the step file's prefix, then a header that is not a step file's map
        data = wx._STEP_PREFIX.pack(wx.STEP_MAGIC, wx.STEP_VERSION, len(data)) + data
    (Path(ho.dir) / "step.1.1").write_bytes(data)
    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 0.01)

    async def worker_call(method, *args):  # the worker wrote its answer to that file
        return [{"absent": "handed_over", "dp_rank": 0}]

    eng = types.SimpleNamespace(handover=ho, data_parallel_size=1, worker_call=worker_call)
    with pytest.raises(CaptureError, match="no answer for it was read.*handover file step.1.1"):
        await wx.fetch_capture(eng, "fake", "c9")
    assert ho.files() == [] and os.listdir(ho.dir) == ["token"]
    ho.close()


@pytest.mark.fault("worker", "handover step file entry that is not a worker's answer")
async def test_a_bad_entry_in_a_step_file_fails_only_its_capture(tmp_path):
    """A step file whose entry for one capture is not a worker's answer fails that capture, naming the file; the
    other captures in the same file are taken as written."""
    import genartifact.engine.worker_ext as wx

    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    (Path(ho.dir) / "step.1.1").write_bytes(wx.encode_step_file({"fake.bad": [1, 2], "fake.ok": {"found": [7]}}))
    eng = types.SimpleNamespace(handover=ho, data_parallel_size=1)
    with pytest.raises(CaptureError, match="handover file step.1.1: the entry of fake.bad"):
        await wx.fetch_capture(eng, "fake", "bad")
    assert await wx.fetch_capture(eng, "fake", "ok") == [7]
    assert ho.files() == []
    ho.close()


@pytest.mark.parametrize("watch", ["inotify", "polled"])
async def test_waiting_takes_share_one_poller_and_get_their_answer_within_a_period(tmp_path, monkeypatch, watch):
    """Sixteen takes waiting for step files that come a few ms later (a wave finishing together): one poller scans
    for all of them (not one listdir per take and period); watched (inotify), each take gets its answer within a
    few ms of its file's rename, polled (no inotify) within the backed-off period; a take whose file never comes
    gets None at its deadline, and a take cancelled while waiting leaves the answer for a later take."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    if watch == "polled":
        monkeypatch.setattr(wx, "_watch_renames", lambda path: None)
    ho = wx.Handover(str(tmp_path))
    assert (ho._notify_fd is not None) == (watch == "inotify" and sys.platform.startswith("linux"))
    ho.contents = {"fake"}

    async def put_later(delay, name, entries):
        await asyncio.sleep(delay)
        path = Path(ho.dir) / name
        path.with_suffix(".tmp").write_bytes(wx.encode_step_file(entries))
        os.replace(path.with_suffix(".tmp"), path)
        return time.monotonic()

    takes = [asyncio.ensure_future(ho.take("fake", f"c{i}", wait_s=2.0)) for i in range(16)]
    t_first = asyncio.ensure_future(put_later(0.008, "step.1.1", {f"fake.c{i}": {"found": [i]} for i in range(8)}))
    t_second = asyncio.ensure_future(put_later(0.009, "step.1.2", {f"fake.c{i}": {"found": [i]} for i in range(8, 16)}))
    done_at = []
    for i, t in enumerate(takes):
        assert (await t) == {"found": [i]}
        done_at.append(time.monotonic())
    first, second = await t_first, await t_second
    if watch == "inotify":  # woken by each rename (a doubling poll from 0.5 ms would look at 7.5, then 15.5 ms)
        assert max(done_at[:8]) - first < 0.004 and max(done_at[8:]) - second < 0.004
        assert ho.scans <= 6, ho.scans
    else:  # one poller for all 16, backing off while it finds nothing: a few scans, not 16 x periods
        assert max(done_at) - second < 0.025
        assert ho.scans <= 12, ho.scans
    assert ho.taken == 16 and ho.files() == []

    # never comes: None at the deadline
    t0 = time.monotonic()
    assert await ho.take("fake", "never", wait_s=0.05) is None
    assert 0.05 <= time.monotonic() - t0 < 0.5

    # cancelled while waiting: the answer that comes later stays for a later take (or a drop)
    take = asyncio.ensure_future(ho.take("fake", "early", wait_s=2.0))
    await asyncio.sleep(0.002)
    take.cancel()
    with pytest.raises(asyncio.CancelledError):
        await take
    (Path(ho.dir) / "step.1.3").write_bytes(wx.encode_step_file({"fake.early": {"found": [3]}}))
    assert await ho.take("fake", "early", wait_s=1.0) == {"found": [3]}
    ho.close()


async def test_a_take_cancelled_after_its_answer_was_found_puts_it_back(tmp_path):
    """The poller hands a take its answer and the take is cancelled before it resumes (its request aborted at that
    moment): the answer goes back to the ready answers, so a later take (or the discard's drop) finds it."""
    import asyncio

    import genartifact.engine.worker_ext as wx

    victim = []

    class CancelOnTake(wx.Handover):  # cancels the waiting take right after the poller resolved it
        @property
        def taken(self):
            return self._taken

        @taken.setter
        def taken(self, v):
            self._taken = v
            if victim:
                victim.pop().cancel()

    ho = CancelOnTake(str(tmp_path))
    ho.contents = {"fake"}
    take = asyncio.ensure_future(ho.take("fake", "late", wait_s=2.0))
    await asyncio.sleep(0.002)
    victim.append(take)
    (Path(ho.dir) / "step.1.1").write_bytes(wx.encode_step_file({"fake.late": {"found": [3]}}))
    with pytest.raises(asyncio.CancelledError):
        await take
    assert ho.taken == 0 and ho.files() == ["fake.late"]
    assert await ho.take("fake", "late") == {"found": [3]}
    ho.close()


async def test_close_ends_the_takes_still_waiting(tmp_path):
    """Engine shutdown while takes wait: each gets None at once (its fetch then goes by RPC), not after its
    deadline."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    takes = [asyncio.ensure_future(ho.take("fake", f"c{i}", wait_s=30.0)) for i in range(3)]
    await asyncio.sleep(0.005)
    t0 = time.monotonic()
    ho.close()
    assert await asyncio.gather(*takes) == [None, None, None]
    assert time.monotonic() - t0 < 1.0


async def test_a_watched_handover_folder_is_not_scanned_while_no_step_file_comes(tmp_path):
    """With inotify, a take that waits 150 ms for its step file costs a handful of scans (its first read, the
    rename's wake-up, a safety scan per 20 ms), not one per 0.5 ms period (~300), and gets its answer within a
    few ms of the rename."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    if not sys.platform.startswith("linux"):
        pytest.skip("inotify is Linux's")
    ho = wx.Handover(str(tmp_path))
    assert ho._notify_fd is not None
    ho.contents = {"fake"}
    take = asyncio.ensure_future(ho.take("fake", "c", wait_s=5.0))
    await asyncio.sleep(0.15)
    path = Path(ho.dir) / "step.1.1"
    path.with_suffix(".tmp").write_bytes(wx.encode_step_file({"fake.c": {"found": [1]}}))
    os.replace(path.with_suffix(".tmp"), path)
    t0 = time.monotonic()
    assert await take == {"found": [1]}
    assert time.monotonic() - t0 < 0.01
    assert ho.scans <= 12, ho.scans
    fd = ho._notify_fd
    ho.close()
    with pytest.raises(OSError):  # the watch is closed with the folder
        os.fstat(fd)


def _put_step(ho, name, entries):
    import genartifact.engine.worker_ext as wx

    path = Path(ho.dir) / name
    path.with_suffix(".tmp").write_bytes(wx.encode_step_file(entries))
    os.replace(path.with_suffix(".tmp"), path)


@pytest.mark.parametrize("entry", ["fifo", "directory", "symlink to /dev/zero", "msgpack nested too deep",
                                   "plain msgpack", "other format version", "blob beyond the end",
                                   "bytes after the last blob", "unknown extension", "header beyond the end",
                                   "large and torn"])
@pytest.mark.fault("worker", "hostile entry named like a handover step file")
async def test_a_hostile_step_entry_never_blocks_or_breaks_the_handover(tmp_path, entry):
    """An entry named ``step.*`` that no worker wrote — a FIFO (opening it for reading would block the event loop
    until a writer came), a directory, a symlink to an endless device, msgpack nested past the decoder's limit —
    is removed and named in ``unreadable``, without blocking; the takes of real step files beside it get their
    answers, and later scans are not broken by it."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx
    import msgspec

    def _prefixed(header: bytes) -> bytes:
        return wx._STEP_PREFIX.pack(wx.STEP_MAGIC, wx.STEP_VERSION, len(header)) + header

    ho = wx.Handover(str(tmp_path))
    ho.contents = {"fake"}
    bad = Path(ho.dir) / "step.9.9"
    if entry == "fifo":
        os.mkfifo(bad)
    elif entry == "directory":
        (bad / "inside").mkdir(parents=True)
    elif entry == "symlink to /dev/zero":
        bad.symlink_to("/dev/zero")
    elif entry == "msgpack nested too deep":  # [[[[...nil...]]]]: 200,000 nested arrays
        bad.write_bytes(_prefixed(b"\x91" * 200_000 + b"\xc0"))
        # (garbage of earlier tests, e.g. a worker runtime's writer-thread executor whose weakref callback puts to
        # a queue, collected while the decoder sits at the recursion limit, would raise there and fail this test
        # through pytest's unraisable-exception hook)
        import gc

        gc.collect()
    elif entry == "plain msgpack":  # a step file of the format before the prefix
        bad.write_bytes(msgspec.msgpack.encode({"fake.x": {"found": [1]}}))
    elif entry == "other format version":
        good = wx.encode_step_file({"fake.x": {"found": [1]}})
        bad.write_bytes(good[:4] + bytes([wx.STEP_VERSION + 1]) + good[5:])
    elif entry == "blob beyond the end":
        bad.write_bytes(wx.encode_step_file({"fake.x": {"found": {"data": bytes(8192)}}})[:-1])
    elif entry == "bytes after the last blob":
        bad.write_bytes(wx.encode_step_file({"fake.x": {"found": {"data": bytes(8192)}}}) + b"x")
    elif entry == "unknown extension":
        bad.write_bytes(_prefixed(msgspec.msgpack.encode({"fake.x": msgspec.msgpack.Ext(7, b"12345678")})))
    elif entry == "header beyond the end":
        bad.write_bytes(_prefixed(msgspec.msgpack.encode({"fake.x": {"found": [1]}}))[:-2])
    else:  # read by the reader thread (above STEP_INLINE_MAX), and it ends early
        bad.write_bytes(wx.encode_step_file({"fake.x": {"found": {"data": bytes(wx.STEP_INLINE_MAX + 1)}}})[:-100])
    _put_step(ho, "step.1.1", {"fake.a": {"found": [1]}})
    t0 = time.monotonic()
    assert await asyncio.wait_for(ho.take("fake", "a", wait_s=1.0), 5) == {"found": [1]}
    take = asyncio.ensure_future(ho.take("fake", "b", wait_s=2.0))
    await asyncio.sleep(0.01)
    _put_step(ho, "step.1.2", {"fake.b": {"found": [2]}})
    assert await asyncio.wait_for(take, 5) == {"found": [2]}
    assert time.monotonic() - t0 < 2.0
    await ho.settle()
    assert os.listdir(ho.dir) == ["token"] and any("step.9.9" in u for u in ho.unreadable), ho.unreadable
    assert "fake.x" not in ho._ready
    ho.close()


def test_a_take_keeps_its_deadline_and_rejects_a_wait_that_is_not_a_number(tmp_path):
    """A take returns None at its own deadline even when the poller serving its key belongs to an event loop that
    no longer runs; ``wait_s`` NaN is refused by name; after close a take does not wait."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    ho = wx.Handover(str(tmp_path))
    other = asyncio.new_event_loop()  # a loop left with a take (and its poller) pending, never run again
    other_take = other.create_task(ho.take("fake", "x", wait_s=30.0))
    other.run_until_complete(asyncio.sleep(0.01))

    async def main():
        with pytest.raises(ValueError, match="wait_s"):
            await ho.take("fake", "x", wait_s=float("nan"))
        t0 = time.monotonic()
        assert await ho.take("fake", "y", wait_s=0.1) is None
        assert 0.1 <= time.monotonic() - t0 < 0.6
        ho.close()
        t0 = time.monotonic()
        assert await ho.take("fake", "z", wait_s=5.0) is None and time.monotonic() - t0 < 0.1

    asyncio.run(main())
    assert other.run_until_complete(asyncio.wait_for(other_take, 1.0)) is None  # close ended it too
    other.run_until_complete(asyncio.sleep(0.05))  # its poller sees no waiter left and ends
    other.close()


def test_a_handover_serves_sequential_event_loops_with_its_watch(tmp_path):
    """Two ``asyncio.run`` in a row with one Handover: the second loop's takes are still woken by the rename
    (the watch moves to the new loop once the first is closed), not left to the safety scan."""
    import asyncio
    import time

    import genartifact.engine.worker_ext as wx

    ho = wx.Handover(str(tmp_path))

    async def one(cid):
        take = asyncio.ensure_future(ho.take("fake", cid, wait_s=2.0))
        await asyncio.sleep(0.05)
        _put_step(ho, f"step.1.{cid}", {f"fake.{cid}": {"found": [cid]}})
        t0 = time.monotonic()
        assert await take == {"found": [cid]}
        return time.monotonic() - t0

    asyncio.run(one("a"))
    assert asyncio.run(one("b")) < 0.01  # the safety scan would take up to 20 ms
    if sys.platform.startswith("linux"):
        assert ho._notify_fd is not None
    ho.close()


async def test_close_survives_a_broken_watch_and_still_ends_the_waits(tmp_path):
    """The inotify descriptor closed behind the Handover's back: close() does not raise, the waiting take gets
    None at once, and the folder's lock is released."""
    import asyncio

    import genartifact.engine.worker_ext as wx

    if not sys.platform.startswith("linux"):
        pytest.skip("inotify is Linux's")
    ho = wx.Handover(str(tmp_path))
    take = asyncio.ensure_future(ho.take("fake", "x", wait_s=30.0))
    await asyncio.sleep(0.01)
    asyncio.get_running_loop().remove_reader(ho._notify_fd)
    os.close(ho._notify_fd)
    ho.close()
    assert await asyncio.wait_for(take, 1.0) is None
    assert ho._lock_fd is None and not Path(ho.dir).exists()


@pytest.mark.fault("worker", "capture ids a session never made: malformed, reused while live, reused after fetch")
def test_capture_ids_no_session_made_are_not_captured_and_leave_nothing():
    """A request whose capture id cannot be one (not 1-128 of [A-Za-z0-9_-]), is held for another request (running,
    or finished and not yet fetched), or was already fetched runs uncaptured: no step hook sees it, no rows are kept for it (they could never be handed
    over or would mix with another request's). A request that comes back as new under the same id (preempted and
    rescheduled) stays captured."""
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host())
    cap, mr = rt.captures["fake"], w.model_runner
    mr.execute_model(step([new("a", "a/b/../c"), new("b", "x" * 300), new("c", "ok-1"), new("d", "ok-1")],
                          sched={"a": 2, "b": 2, "c": 3, "d": 4}))
    mr.sample_tokens(None)
    assert cap.events[0][2] == {"c": "ok-1"} and rt.call("fake.stats", [])["live_flagged"] == 1
    mr.execute_model(step([new("c", "ok-1")], sched={"c": 1}))  # c again as new (preempted, rescheduled)
    mr.sample_tokens(None)
    rt.settle()
    assert cap.events[-2][2] == {"c": "ok-1"}
    mr.execute_model(step(finished=["a", "b", "c", "d"]))
    assert rt.call("fake.fetch", ["ok-1"])["found"] == [3, 1]
    mr.execute_model(step([new("e", "ok-1")], sched={"e": 5}))  # fetched already: its rows could not be handed over
    mr.sample_tokens(None)
    assert len(cap.events) == 4 and cap.rows == {} and rt.call("fake.stats", [])["live_flagged"] == 0
    # finished, not yet fetched (the RPC path): a new request under its id would join its rows
    mr.execute_model(step([new("f", "ok-2")], sched={"f": 2}))
    mr.sample_tokens(None)
    mr.execute_model(step(finished=["f"]))
    mr.execute_model(step([new("g", "ok-2")], sched={"g": 9}))
    mr.sample_tokens(None)
    assert rt.call("fake.fetch", ["ok-2"])["found"] == [2] and cap.rows == {}


@pytest.mark.fault("worker", "handover folder removed while fetches wait for their files")
async def test_a_handover_folder_removed_under_the_engine_is_replaced_and_costs_no_wait(tmp_path, monkeypatch):
    """The handover folder is removed while fetches wait for their files: the waits end at once (RPC fetch, the
    rows the worker could not write), not at their deadline; the engine is asked once to replace the folder; later
    fetches take no wait either until it does."""
    import asyncio
    import shutil

    import genartifact.engine.worker_ext as wx

    monkeypatch.setattr(wx, "HANDOVER_WAIT_S", 60.0)
    ho, w, rt, eng = handing_engine(tmp_path)
    renewals = []

    async def renew_handover():
        renewals.append(ho.dir)

    eng.renew_handover = renew_handover
    run_request(w.model_runner, "r1", "c1")
    waiting = asyncio.ensure_future(wx.fetch_capture(eng, "fake", "c1"))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # waiting for the file the worker writes when it learns r1 finished
    shutil.rmtree(ho.dir)
    w.model_runner.execute_model(step(finished=["r1"]))  # the write fails: kept for RPC
    assert (await asyncio.wait_for(waiting, 5))["rows"] == [5, 1, 1]
    assert ho.lost and eng.rpcs == ["fake.fetch"] and renewals == [ho.dir]
    run_request(w.model_runner, "r2", "c2")
    w.model_runner.execute_model(step(finished=["r2"]))
    assert (await asyncio.wait_for(wx.fetch_capture(eng, "fake", "c2"), 5))["rows"] == [5, 1, 1]
    assert len(renewals) == 1  # asked once per lost folder
    ho.close()


async def test_answers_the_workers_kept_for_rpc_are_not_waited_for(tmp_path):
    """The workers say (answer to the ``handover`` RPC) that some answers could not be written (their files went to
    a folder that was lost before the workers heard of the new one): the takes waiting for them end at once, later
    takes for them do not wait, and a drop forgets the mark; other takes still wait for their files."""
    import asyncio
    import time

    from genartifact.engine.worker_ext import Handover

    ho = Handover(str(tmp_path))
    ho.contents = {"fake"}
    waiting = asyncio.ensure_future(ho.take("fake", "c1", wait_s=30))
    other = asyncio.ensure_future(ho.take("fake", "c9", wait_s=0.3))
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    ho.no_file(["fake.c1", "fake.c2", "fake.c3"])
    assert await waiting is None and time.monotonic() - t0 < 1
    t0 = time.monotonic()
    assert await ho.take("fake", "c2", wait_s=30) is None and time.monotonic() - t0 < 1
    ho.drop("fake", "c3")
    t0 = time.monotonic()
    assert await ho.take("fake", "c3", wait_s=0.05) is None and time.monotonic() - t0 >= 0.04  # waited: no mark
    assert await other is None  # not marked: waited for its file until its deadline
    ho.no_file(["other.c4", "fake.bad id", "fake.c5.x", 7, b"fake.c6", "fake." + "x" * 200])  # none of its keys
    assert list(ho._by_rpc) == ["fake.c1"]  # remembered (a take of it does not wait) until its RPC fetch came
    ho.fetched_by_rpc("fake", "c1")
    assert list(ho._by_rpc) == []
    ho.close()


def test_answers_kept_for_rpc_end_takes_waiting_on_another_threads_loop(tmp_path):
    """``no_file`` called on one thread ends a take waiting on another thread's event loop through that loop
    (as ``close`` does), so the take returns at once, not at its deadline nor never."""
    import asyncio
    import threading
    import time

    from genartifact.engine.worker_ext import Handover

    ho = Handover(str(tmp_path))
    ho.contents = {"fake"}
    got, started = [], threading.Event()

    async def waiter():
        started.set()
        t0 = time.monotonic()
        got.append((await ho.take("fake", "c1", wait_s=30), time.monotonic() - t0))

    th = threading.Thread(target=lambda: asyncio.run(waiter(), debug=True))
    th.start()
    assert started.wait(10)
    time.sleep(0.1)
    ho.no_file(["fake.c1"])
    th.join(10)
    assert not th.is_alive() and got and got[0][0] is None and got[0][1] < 5
    ho.close()


@pytest.mark.fault("worker", "a symlink planted at the worker's handover temp file")
def test_a_link_at_the_workers_temp_name_is_never_followed_and_the_rows_go_by_rpc(tmp_path):
    """Someone puts a symlink where the worker writes its next step file's temp name: the worker neither writes
    through it (the link's target is untouched) nor loses the rows (kept for the RPC fetch)."""
    from genartifact.engine.worker_ext import Handover

    (tmp_path / "h").mkdir()
    ho = Handover(str(tmp_path / "h"))
    w = fake_worker()
    rt = WorkerRuntime(w, {**CFG, "handover": ho.config()}, host=handing_host())
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, os.path.join(ho.dir, f"step.{os.getpid()}.1.tmp"))
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))
    assert victim.read_text() == "precious"
    assert list(rt.unwritten["fake"]) == ["c1"] and rt.call("fake.fetch", ["c1"])["found"]["rows"] == [5, 1, 1]
    ho.close()


@pytest.mark.fault("worker", "discard on an engine that died")
async def test_discard_on_a_dead_engine_is_logged_not_blamed_on_the_plugin():
    """An engine that died cannot be asked to drop rows (it holds none any more): ``discard_capture`` logs that
    and returns, so the content's guarded ``discard`` is not reported as a plugin fault for vLLM's death."""
    import structlog
    from genartifact.engine.worker_ext import discard_capture

    class Dead:
        handover = None

        async def worker_call(self, method, *args):
            raise RuntimeError("EngineDeadError: engine core died")

    with structlog.testing.capture_logs() as logs:
        await discard_capture(Dead(), "fake", "c1")
    assert [e["event"] for e in logs] == ["capture_discard_unreachable"]


@pytest.mark.fault("worker", "handover folder replacement whose RPC to the workers fails")
async def test_a_failed_handover_replacement_leaves_fetches_on_rpc_and_no_folder(tmp_path, monkeypatch):
    """The engine replaces a lost handover folder, but the RPC telling the workers fails (a dying engine): it keeps
    no handover (fetches go by RPC; a folder the workers never heard of would make each fetch wait for files that
    cannot come) and leaves no folder behind."""
    import shutil

    import genartifact.engine.vllm_adapter as va
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.engine.worker_ext import Handover

    monkeypatch.setattr(va, "Handover", lambda: Handover(str(tmp_path)))  # the replacement's folder: here too

    class DyingLLM:
        async def collective_rpc(self, name, args=()):
            raise RuntimeError("EngineDeadError")

    eng = VllmEngine(PluginHost({"contents": ["moe_routes"]}), "/m")
    eng.llm = DyingLLM()
    eng.handover = old = Handover(str(tmp_path))
    shutil.rmtree(old.dir)
    assert not old.check_folder() and old.lost
    with pytest.raises(RuntimeError, match="EngineDeadError"):
        await eng.renew_handover()
    assert eng.handover is None
    assert not [n for n in os.listdir(tmp_path) if n.startswith("genartifact-")]


class FakeMQ:
    """vLLM's ``MessageQueue`` as the worker loop uses it: ``dequeue`` hands over the engine's next call."""

    def __init__(self, calls, proc):
        self.calls, self.proc, self.seen = list(calls), proc, []

    def dequeue(self, indefinite=False):
        self.seen.append(self.proc.events())  # what had run by the time the worker waited for this call
        return self.calls.pop(0)


class WorkerProc:
    """vLLM 0.32's multiprocessing worker loop (``multiproc_executor.WorkerProc``), reduced: every RPC runs between
    two ``self.rpc_broadcast_mq.dequeue(indefinite=True)`` calls, its output sent (``handle_output``) before the
    next one."""

    def __init__(self, worker, calls):
        self.worker, self.rt, self.sent = worker, None, []
        self.rpc_broadcast_mq = FakeMQ(calls, self)

    def events(self):
        return [e[0] for e in self.rt.captures["fake"].events] if self.rt else None

    def worker_busy_loop(self):
        while self.rpc_broadcast_mq.calls:
            self._execute_worker_rpc(self.rpc_broadcast_mq.dequeue(indefinite=True))

    def _execute_worker_rpc(self, req):
        method, args = req
        if method == "init":  # (the init RPC, its host given: the fake content is no installed distribution)
            self.rt = WorkerRuntime(self.worker, CFG, host=make_host())
        elif method == "fetch":
            self.rt.call("fake.fetch", args)
        else:
            getattr(self.worker.model_runner, method)(*args)
        self.sent.append(self.events())


def test_end_step_runs_after_the_output_went_back_while_the_worker_waits_for_the_next_call():
    """Deferred end hooks (the default): a step's ``end_step`` has not run when the step's output goes back to the
    engine; it runs when vLLM's worker loop next waits for a call (its ``dequeue``, found from the init RPC),
    before the next call is taken, in step order; the init answer names the loop."""
    calls = [("init", ()), ("execute_model", (step([new("b", "cid-b")], sched={"b": 7}),)), ("sample_tokens", (None,)),
             ("execute_model", (step(sched={"b": 1}),)), ("sample_tokens", (None,)), ("fetch", ["cid-b"])]
    proc = WorkerProc(fake_worker(), calls)
    proc.worker_busy_loop()
    rt, seen = proc.rt, proc.rpc_broadcast_mq.seen
    assert rt.idle_hook == "WorkerProc" and rt.answer()["step_end"] == "deferred"
    assert proc.sent[2] == ["begin"]  # step 1's output went back before its end_step ran ...
    assert seen[3] == ["begin", "end"]  # ... which ran in the worker's next wait, before the next call
    assert proc.sent[4] == ["begin", "end", "begin"] and seen[5] == ["begin", "end", "begin", "end"]
    assert rt.captures["fake"].rows == {}  # the fetch took both steps' rows
    # the wait is wrapped once, and only from within a worker loop
    assert getattr(proc.rpc_broadcast_mq.dequeue, "_genartifact_settles", None) is rt
    import genartifact.engine.worker_ext as wx

    assert wx._hook_idle_wait(rt) is None


def test_a_deferred_end_step_settles_before_anything_that_could_see_it():
    """Without a hooked wait (Ray, an in-process executor) the pending end hooks run at the worker's next entry:
    the next step (before its begin_step and before it hands over finished requests), and every RPC verb, so a
    fetch right after the last step has that step's rows."""
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host())
    cap, mr = rt.captures["fake"], w.model_runner
    assert rt.idle_hook is None
    mr.execute_model(step([new("a", "c-a")], sched={"a": 4}))
    mr.sample_tokens(None)
    mr.execute_model(step(sched={"a": 1}))
    assert [e[0] for e in cap.events] == ["begin", "end", "begin"]  # step 1's end before step 2's begin
    mr.sample_tokens(None)
    assert rt.call("fake.stats", [])["requests"] == 1 and [e[0] for e in cap.events][-1] == "end"
    assert rt.call("fake.fetch", ["c-a"])["found"] == [4, 1]


@pytest.mark.fault("worker", "a deferred end_step raises, or settling itself fails, in vLLM's worker loop")
def test_a_failing_deferred_end_step_fails_its_requests_never_the_workers_loop(monkeypatch):
    """A capture's deferred ``end_step`` that raises fails that step's flagged requests (their fetch names it), as
    inline; and whatever goes wrong while settling in vLLM's wait is logged, never raised into the loop."""
    import genartifact.engine.worker_ext as wx

    class EndFails(Recorder):
        def end_step(self, step):
            raise KeyError("end boom")

    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host(cls=EndFails))
    mq = NS(dequeue=lambda indefinite=False: "next call")

    def rpc(self):  # called as vLLM's worker loop calls the init RPC: the frame's ``self`` is the loop's object
        return wx._hook_idle_wait(rt)

    assert rpc(NS(worker_busy_loop=None, rpc_broadcast_mq=mq)) == "SimpleNamespace"
    mr = w.model_runner
    mr.execute_model(step([new("a", "c-a")], sched={"a": 2}))
    mr.sample_tokens(None)
    assert mq.dequeue(indefinite=True) == "next call"
    mr.execute_model(step(finished=["a"]))
    got = rt.call("fake.fetch", ["c-a"])
    assert got["absent"] == "failed" and "end_step: KeyError" in got["error"]
    mr.execute_model(step([new("b", "c-b")], sched={"b": 2}))
    mr.sample_tokens(None)
    monkeypatch.setattr(rt, "_fire", lambda *a, **k: 1 / 0)
    assert mq.dequeue(indefinite=True) == "next call"  # logged (worker_step_end_failed), the loop goes on


def test_step_end_inline_and_a_capture_that_opts_out_run_before_the_output_goes_back():
    """``step_end`` ``inline`` (the ``step_end`` RPC) runs every end hook before ``sample_tokens`` returns, as before
    deferral; a capture whose ``end_step_deferred`` is False runs inline whatever the mode; an unknown mode is
    refused naming the allowed ones."""
    w = fake_worker()
    rt = w._genartifact_runtime = WorkerRuntime(w, CFG, host=make_host())
    cap, mr = rt.captures["fake"], w.model_runner
    assert _dispatch(w, "step_end", "inline")["step_end"] == "inline"
    mr.execute_model(step([new("a", "c-a")], sched={"a": 2}))
    mr.sample_tokens(None)
    assert [e[0] for e in cap.events] == ["begin", "end"] and rt._pending is None
    with pytest.raises(ValueError, match=r"step_end 'later' unknown; allowed: \['deferred', 'inline'\]"):
        _dispatch(w, "step_end", "later")
    w3 = fake_worker()
    run = w3.model_runner.execute_model
    with pytest.raises(ValueError, match="step_end 'x' unknown"):
        WorkerRuntime(w3, {**CFG, "step_end": "x"}, host=make_host())
    assert w3.model_runner.execute_model == run  # a refused init wraps nothing
    from genartifact.engine.vllm_adapter import VllmEngine

    with pytest.raises(ValueError, match=r"worker_step_end 'later' unknown; allowed: \['deferred', 'inline'\]"):
        VllmEngine(PluginHost({"contents": []}), "/m", worker_step_end="later")

    class Inline(Recorder):
        end_step_deferred = False

    w2 = fake_worker()
    rt2 = WorkerRuntime(w2, CFG, host=make_host(cls=Inline))
    assert rt2.step_end == "deferred"
    w2.model_runner.execute_model(step([new("a", "c-a")], sched={"a": 2}))
    w2.model_runner.sample_tokens(None)
    assert [e[0] for e in rt2.captures["fake"].events] == ["begin", "end"]
    rt2.settle()
    assert [e[0] for e in rt2.captures["fake"].events] == ["begin", "end"]  # not run twice


def test_a_step_is_closed_before_its_deferred_end_step_runs():
    """``WorkerStep.closed`` is False for ``begin_step`` (and the forward) and True once the step's output went back,
    before its deferred ``end_step``: what a capture's in-model callbacks check to ignore runs outside the step."""
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host())
    cap, mr, seen = rt.captures["fake"], w.model_runner, []
    begin, end = cap.begin_step, cap.end_step
    cap.begin_step = lambda s: (seen.append(("begin", s.closed)), begin(s))
    cap.end_step = lambda s: (seen.append(("end", s.closed)), end(s))
    mr.execute_model(step([new("a", "c-a")], sched={"a": 2}))
    mr.sample_tokens(None)
    assert rt._pending is not None and rt._pending.closed and seen == [("begin", False)]
    rt.settle()
    assert seen == [("begin", False), ("end", True)]


@pytest.mark.parametrize("verb", ["discard", "fetch"])
def test_rows_fetched_or_discarded_while_the_request_still_runs_are_never_recreated(verb):
    """A client that goes away makes the driver discard its capture before vLLM's abort reaches the scheduler,
    so the request runs more steps on the worker. Those steps must not capture it again: its id is buried (never
    handed over, never fetched), so rows re-created for it would stay in the worker until restart (found by the
    attacker of issue 13's thirteenth pass: one leaked row buffer per cancelled request). Same for a fetch of a
    request still running."""
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host())
    cap, mr = rt.captures["fake"], w.model_runner
    mr.execute_model(step([new("a", "cid-a"), new("b", "cid-b")], sched={"a": 4, "b": 3}))
    mr.sample_tokens(None)
    rt.call(f"fake.{verb}", ["cid-a"])  # settles the step first, then drops a's rows
    assert list(cap.rows) == ["cid-b"]
    for _ in range(3):  # a still scheduled: the abort has not landed yet
        mr.execute_model(step(sched={"a": 1, "b": 1}))
        mr.sample_tokens(None)
    rt.settle()
    begins = [e[2] for e in cap.events if e[0] == "begin"]
    assert begins == [{"a": "cid-a", "b": "cid-b"}] + [{"b": "cid-b"}] * 3 and cap.events[-1][0] == "end"
    assert list(cap.rows) == ["cid-b"] and cap.rows["cid-b"] == [3, 1, 1, 1]
    mr.execute_model(step(finished=["a", "b"]))
    assert rt.call("fake.stats", [])["live_flagged"] == 0
    assert rt.call("fake.fetch", ["cid-a"])["absent"] == ("discarded" if verb == "discard" else "fetched")
    assert rt.call("fake.fetch", ["cid-b"])["found"] == [3, 1, 1, 1] and cap.rows == {}


def test_a_batch_answers_every_verb_as_if_each_call_came_alone():
    """The engine merges concurrent ``worker_call``s of one method into one ``batch`` RPC; the worker answers
    each as if it came alone, runtime verbs (``step_end``, ``handover``) included. Two concurrent ``step_end``
    switches failed with "no enabled worker plugin handles method 'step_end'" (issue 13's attacker)."""
    w = fake_worker()
    rt = WorkerRuntime(w, CFG, host=make_host())
    w._genartifact_runtime = rt
    got = _dispatch(w, "batch", "step_end", [["inline"], ["inline"]])
    assert [a["step_end"] for a in got] == ["inline", "inline"] and rt.step_end == "inline"
    assert [a["handover"] for a in _dispatch(w, "batch", "handover", [[None]])] == [[]]  # handover off: no contents
    assert _dispatch(w, "batch", "fake.stats", [[], []])[1]["live_flagged"] == 0
    with pytest.raises(ValueError, match="step_end 'x' unknown"):
        _dispatch(w, "batch", "step_end", [["x"]])



class CallbackRecorder(Recorder):
    """A capture that also plants a callback inside the model (as a router hook does), run under ``step.guard``."""

    boom = False

    def begin_step(self, step):
        super().begin_step(step)
        self.step = step

    def inside_forward(self):
        def work(x):
            if self.boom:
                raise RuntimeError(f"callback broke on {x} https://s3.example/b/k?X-Amz-Signature=SECRETSIG")
            return x * 2
        self.results = [self.step.guard("fake", work, i) for i in range(3)]


def test_a_guarded_callback_fault_fails_the_steps_requests_and_the_run_goes_on():
    """``WorkerStep.guard``: a callback a capture plants inside vLLM (a router hook, a sampler wrapper) that raises
    fails that step's flagged requests of its content (their fetch names the callback and the exception, secrets
    redacted), skips the content's other guarded calls of the step, and raises nothing into the forward; requests
    not in that step and later steps are not touched."""
    w = fake_worker()
    inside = []
    runner = w.model_runner
    orig = runner.execute_model
    runner.execute_model = lambda so: (inside[0].inside_forward() if inside else None, orig(so))[1]
    rt = WorkerRuntime(w, CFG, host=make_host(cls=CallbackRecorder))
    cap = rt.captures["fake"]
    inside.append(cap)
    mr = w.model_runner
    mr.execute_model(step([new("a", "cid-a")], sched={"a": 4}))
    mr.sample_tokens(None)
    assert cap.results == [0, 2, 4]
    cap.boom = True
    mr.execute_model(step([new("b", "cid-b")], sched={"a": 1, "b": 2}))  # a and b in the failing step
    mr.sample_tokens(None)
    assert cap.results == [None, None, None]  # the first raised, the others were skipped: nothing escaped
    cap.boom = False
    mr.execute_model(step([new("c", "cid-c")], sched={"a": 1, "b": 1, "c": 3}))
    mr.sample_tokens(None)
    assert cap.results == [0, 2, 4]
    rt.settle()
    mr.execute_model(step(finished=["a", "b", "c"]))
    for cid in ("cid-a", "cid-b"):
        got = rt.call("fake.fetch", [cid])
        assert got["absent"] == "failed" and "RuntimeError: callback broke on 0" in got["error"], got
        assert "SECRETSIG" not in got["error"] and "inside_forward.<locals>.work" in got["error"]
    assert rt.call("fake.fetch", ["cid-c"])["found"] == [3]


# ------------------------------------------------------------------- a worker capture that cannot be installed
def _two_content_host(bad):
    """Contents "fake" (a good Recorder) and "bad", whose worker capture hook ``bad`` describes: raises, returns a
    wrong object, or returns a second capture for "fake"."""
    good, broken = types.ModuleType("fake_good_content"), types.ModuleType("fake_bad_content")

    @hookimpl
    def good_hook(worker, settings):
        return Recorder(worker)

    @hookimpl
    def bad_hook(worker, settings):
        if bad == "raises":
            raise RuntimeError("cannot find the layers: token=s3cr3t")
        if bad == "wrong":
            return object()
        if bad == "base":
            raise _Boom("the plugin's own BaseException at init")
        return Recorder(worker)  # "duplicate": a second capture claiming content "fake"

    good.genartifact_worker_capture, broken.genartifact_worker_capture = good_hook, bad_hook
    sys.modules[good.__name__], sys.modules[broken.__name__] = good, broken
    eps = {"genartifact.contents": [FakeEP("fake", good.__name__, NS(name="good-dist", version="1")),
                                    FakeEP("bad", broken.__name__, NS(name="bad-dist", version="2"))],
           "genartifact.targets": [], "genartifact.probes": []}
    return PluginHost({"contents": ["fake", "bad"]}, source=lambda g: eps[g])


@pytest.mark.parametrize("bad", ["raises", "wrong", "base", "duplicate"])
def test_a_worker_capture_that_cannot_be_installed_fails_only_its_content(bad):
    """A content plugin whose ``genartifact_worker_capture`` raises or returns a wrong object (or a second capture for
    a content another plugin captures) does not fail the worker's init: the other captures are installed and capture,
    and the init answer's ``init_faults`` names the content, for the driver to fail its requests at admission."""
    w = fake_worker()
    rt = WorkerRuntime(w, {**CFG, "contents": ["fake", "bad"]}, host=_two_content_host(bad))
    faults = rt.answer()["init_faults"]
    if bad == "duplicate":  # which of the two is meant cannot be known: the content is off
        assert sorted(rt.captures) == [] and "two worker captures for content 'fake'" in faults["fake"]
        return
    assert sorted(rt.captures) == ["fake"] and list(faults) == ["bad"]
    assert "bad (bad-dist 2)" in faults["bad"] and "genartifact_worker_capture" in faults["bad"]
    assert "s3cr3t" not in faults["bad"]
    run_request(w.model_runner, "r1", "c1")
    assert rt.call("fake.fetch", ["c1"])["found"]  # the good content captured


async def test_the_driver_fails_only_the_faulted_contents_requests_at_admission(monkeypatch):
    """The driver reads ``init_faults`` from the workers' init answers: the engine starts, a faulted content is not
    among the worker captures, and ``engine_options["worker_capture_faults"]`` makes each request asking for it a
    plugin fault at admission (``internal_error``), naming the content; requests without it are admitted."""
    from genartifact.engine.vllm_adapter import VllmEngine
    from genartifact.errors import PluginFault
    from genartifact.testing import make_host as kit_host
    from genartifact.testing import model_info

    class FakeLLM:
        async def collective_rpc(self, name, args=()):
            return [{"enabled": {"contents": ["fake", "bad"], "probes": []}, "capturing": True,
                     "captures": ["fake"], "init_faults": {"bad": "content plugin bad (bad-dist 2) raised ..."},
                     "handover": [], "dp_rank": 0, "tp_rank": 0, "rank": 0}]

    import genartifact.engine.vllm_adapter as va

    eng = VllmEngine(PluginHost({"contents": []}), "/m", capture_handover=False)
    eng.llm = FakeLLM()
    monkeypatch.setattr(va, "init_config", lambda host: {"contents": ["fake", "bad"], "probes": [], "settings": {}})
    assert await eng._init_workers() == {"fake"}
    assert eng.capture_faults == {"bad": "content plugin bad (bad-dist 2) raised ..."}

    from genartifact.testing import new_session

    host = kit_host(contents=["moe_routes"])

    def admit(faults):
        new_session(host, ["moe_routes"], model=model_info(worker_capture_faults=faults)).admit(3, 2)

    with pytest.raises(PluginFault, match="content 'moe_routes': its worker capture could not be installed"):
        admit({"moe_routes": "content plugin moe_routes (x 1) raised RuntimeError: boom"})
    admit({"other": "x"})  # another content's fault: this request is admitted


# ------------------------------------------------------------------- answers that cannot go back, BaseExceptions
class _Boom(BaseException):
    """A plugin's own BaseException subclass."""


class Hostile(Recorder):
    """A Recorder whose ``mode`` misbehaves: an answer msgpack cannot carry, a BaseException of its own in a step
    hook, a write into the step's flagged maps, or a verb answering or raising so."""

    mode = ""

    def begin_step(self, step):
        super().begin_step(step)
        if self.mode == "boom":
            raise _Boom("plugin's own BaseException")
        if self.mode == "cancelled":
            import asyncio

            raise asyncio.CancelledError()
        if self.mode == "clear_flagged":
            step.flagged["fake"].clear()

    def pop(self, cid, args):
        rows = super().pop(cid, args)
        return {"rows": rows, "obj": object()} if self.mode == "unsendable" and rows is not None else rows

    def verbs(self):
        return {"obj": lambda args: object(), "boom": lambda args: (_ for _ in ()).throw(_Boom("verb"))}


def _hostile_runtime(mode):
    class H(Hostile):
        pass

    H.mode = mode
    w = fake_worker()
    return w, WorkerRuntime(w, CFG, host=make_host(cls=H))


def test_an_answer_msgpack_cannot_carry_fails_its_request_and_never_reaches_the_engine_core():
    """vLLM's engine core encodes an RPC answer with msgpack on its output thread; an answer it cannot encode ended
    that thread and hung every request. The worker now encodes each fetch answer first: one it cannot carry is a
    failed answer naming why (the request's receipt is internal_error), and the runtime goes on."""
    w, rt = _hostile_runtime("unsendable")
    run_request(w.model_runner, "r1", "c1")
    ans = rt.call("fake.fetch", ["c1"])
    assert ans["absent"] == "failed" and ans["fault"] and "not msgpack-native" in ans["error"], ans
    run_request(w.model_runner, "r2", "c2")  # the runtime runs on
    assert rt.call("fake.stats", [])["requests"] == 1


def test_an_unwritable_handover_answer_that_msgpack_cannot_carry_fails_by_rpc_too(tmp_path):
    """The same answer on the out-of-band path: its step file cannot be written (msgpack refuses it), so it waits
    for the RPC fetch, which now refuses it too instead of sending it to the engine core."""
    from genartifact.engine.worker_ext import Handover

    class H(Hostile):
        mode = "unsendable"

        def handover(self, cid, extra):
            return self.pop(cid, [])

    w = fake_worker()
    ho = Handover(str(tmp_path))
    ho.contents = {"fake"}
    rt = WorkerRuntime(w, {**CFG, "handover": ho.config()}, host=make_host(cls=H))
    run_request(w.model_runner, "r1", "c1")
    w.model_runner.execute_model(step(finished=["r1"]))  # finished: handed over, the file fails, kept for RPC
    assert "c1" in rt.unwritten["fake"]
    ans = rt.call("fake.fetch", ["c1"])
    assert ans["absent"] == "failed" and "not msgpack-native" in ans["error"], ans
    ho.close()


@pytest.mark.parametrize("mode", ["boom", "cancelled"])
def test_a_plugins_own_base_exception_fails_its_requests_never_the_engine(mode):
    """Only KeyboardInterrupt and SystemExit (a signal; vLLM's SIGTERM) pass a worker plugin's isolation: a
    BaseException subclass of the plugin's own, or CancelledError, fails that step's requests of its content."""
    w, rt = _hostile_runtime(mode)
    run_request(w.model_runner, "r1", "c1")  # no exception reaches the engine's execute_model
    ans = rt.call("fake.fetch", ["c1"])
    assert ans["absent"] == "failed" and "begin_step" in ans["error"], ans


def test_a_capture_cannot_change_the_runtimes_flagged_requests():
    """``step.flagged`` is read-only: a capture that tries to clear it faults (its requests fail, naming the hook),
    and the runtime's own tracking, which every content shares, is intact."""
    w, rt = _hostile_runtime("clear_flagged")
    run_request(w.model_runner, "r1", "c1")
    assert rt.flagged["fake"] == {"r1": "c1"}
    ans = rt.call("fake.fetch", ["c1"])
    assert ans["absent"] == "failed" and "begin_step" in ans["error"], ans


def test_a_verb_answering_what_msgpack_cannot_carry_or_raising_its_own_base_exception_is_an_rpc_error():
    w, rt = _hostile_runtime("")
    with pytest.raises(TypeError, match="worker verb 'fake.obj' answered a value that is not msgpack-native"):
        rt.call("fake.obj", [])
    with pytest.raises(RuntimeError, match="worker verb 'fake.boom' raised _Boom"):
        rt.call("fake.boom", [])
    assert rt.call("fake.stats", [])["requests"] == 0  # the runtime answers on


def test_a_worker_plugins_own_verb_is_answered_and_checked():
    """``genartifact_worker_call`` verbs of other plugins (a probe's) go through the same check."""
    mod = types.ModuleType("fake_verb_plugin")

    @hookimpl
    def genartifact_worker_call(worker, method, args):
        if method == "probe.ok":
            return {"cpus": 2, "args": args}
        if method == "probe.obj":
            return {"x": object()}
        return None

    mod.genartifact_worker_call = genartifact_worker_call
    sys.modules[mod.__name__] = mod
    eps = {"genartifact.contents": [], "genartifact.targets": [],
           "genartifact.probes": [FakeEP("probe", mod.__name__, NS(name="probe-dist", version="1"))]}
    host = PluginHost({"probes": ["probe"]}, source=lambda g: eps[g])
    rt = WorkerRuntime(fake_worker(), {"contents": [], "probes": ["probe"], "settings": {}}, host=host)
    assert rt.call("probe.ok", [1]) == {"cpus": 2, "args": [1]}
    with pytest.raises(TypeError, match="worker verb 'probe.obj' answered a value that is not msgpack-native"):
        rt.call("probe.obj", [])
