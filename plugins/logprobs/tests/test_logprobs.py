"""selected_logprobs plugin: lookup by token id, logprobs=0 request, bounds, entry point."""

from __future__ import annotations

import importlib.metadata as md
from dataclasses import dataclass

import numpy as np
import pytest
from genartifact.errors import AdmissionError, CaptureError
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo
from genartifact_logprobs import SelectedLogprobs, genartifact_content_producer
from genartifact_logprobs.answer import read_worker_answer, worker_answer


@dataclass
class Logprob:  # the shape of vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None


def admitted(max_tokens=4, sampling=None):
    p = SelectedLogprobs()
    p.admit(AdmissionContext(3, max_tokens, 0, ModelInfo("m", {}), sampling or {}))
    return p


def test_entry_point_and_hook():
    eps = {ep.name: ep for ep in md.entry_points(group="genartifact.contents")}
    assert eps["selected_logprobs"].dist.name == "genartifact-logprobs"
    assert isinstance(genartifact_content_producer(name="selected_logprobs", model=None), SelectedLogprobs)
    assert genartifact_content_producer(name="moe_routes", model=None) is None


def test_requests_logprobs_zero_only_when_user_did_not():
    p = admitted()
    params = {}
    p.sampling_overrides(params)
    assert params == {"logprobs": 0, "flat_logprobs": True}
    params = {"logprobs": 5}
    p.sampling_overrides(params)
    assert params == {"logprobs": 5}


def test_lookup_by_token_id_with_vllm_logprob_objects():
    p = admitted()
    # sampled token 7 is not first in the dict, as when it is not rank 1
    p.on_delta(Delta([1, 2, 3], [7, 8], [{4: Logprob(-0.1, 1), 7: Logprob(-2.5, 3)}, {8: Logprob(float("-inf"), 9)}]))
    section, parts = p.finalize(FinalContext(3, 2))
    assert section == {"token_start": 3}
    assert parts[0].array.dtype == np.float32
    assert parts[0].array.tolist() == [-2.5, float("-inf")]


def test_bounds():
    p = admitted(max_tokens=1)
    with pytest.raises(CaptureError, match="admitted 1"):
        p.on_delta(Delta([1], [7, 8], [{7: -1.0}, {8: -1.0}]))
    with pytest.raises(CaptureError, match="2 tokens"):
        admitted().on_delta(Delta([1], [7, 8], [{7: -1.0}]))
    with pytest.raises(CaptureError, match="None logprob entries"):
        admitted().on_delta(Delta([1], [7], None))
    with pytest.raises(AdmissionError, match="logprobs must be None or an integer"):
        admitted(sampling={"logprobs": -1})


def test_finalize_checks_alignment_and_release_clears():
    p = admitted()
    p.on_delta(Delta([1], [7], [{7: -1.0}]))
    with pytest.raises(CaptureError, match="1 values for 2 completion tokens"):
        p.finalize(FinalContext(3, 2))
    p.release()
    assert p.retained_bytes() == 0


@pytest.mark.parametrize("vocab", [512, 151_936])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_flagged_rows_log_softmax_is_bitwise_the_whole_batch_one(vocab, dtype):
    """The worker normalises only the flagged rows; vLLM's sampler (``raw_logprobs``) normalises the whole batch.
    Every value must be bit-for-bit the same, for any subset of rows and any torch thread count: the stored
    ``selected_logprobs`` equal the engine's own logprobs exactly (docs/contents.md)."""
    import torch
    from genartifact_logprobs.worker import flagged_log_softmax

    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn((37, vocab), generator=g) * 4).to(getattr(torch, dtype))
    threads = torch.get_num_threads()
    try:
        for n_threads in sorted({1, max(1, threads)}):
            torch.set_num_threads(n_threads)
            whole = logits.log_softmax(dim=-1, dtype=torch.float32)
            for rows in ([0], [36], [1, 5, 6, 30], list(range(0, 37, 2)), list(range(37))):
                idx = torch.tensor(rows, dtype=torch.long)
                got = flagged_log_softmax(logits, idx, rows == list(range(37)))
                assert got.dtype == torch.float32 and tuple(got.shape) == (len(rows), vocab)
                assert torch.equal(got, whole.index_select(0, idx)), (n_threads, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("sampled_dtype", ["int32", "int64"])
def test_selected_values_read_the_sampled_tokens_logprobs(sampled_dtype):
    """The worker's read of each flagged row's sampled token and its logprob (numpy views of host tensors) gives
    exactly what torch's gather gives, for every row or a subset, with the sampler's int32/int64 ids; a negative id
    raises instead of reading the row from its end."""
    import torch
    from genartifact_logprobs.worker import flagged_log_softmax, selected_values

    g = torch.Generator().manual_seed(7)
    logits = torch.randn((9, 512), generator=g) * 3
    sampled = torch.randint(0, 512, (9, 1), generator=g).to(getattr(torch, sampled_dtype))
    for rows in (list(range(9)), [0, 4, 8], [5]):
        all_rows = rows == list(range(9))
        idx = torch.tensor(rows, dtype=torch.long)
        lp = flagged_log_softmax(logits, idx, all_rows)
        toks, vals = selected_values(lp, sampled, None if all_rows else idx, all_rows)
        want = sampled.index_select(0, idx)[:, 0].long()
        assert toks == want.tolist() and all(type(t) is int for t in toks)
        assert vals == lp.gather(1, want[:, None])[:, 0].tolist() and all(type(v) is float for v in vals)
    bad = sampled.clone()
    bad[3, 0] = -1
    with pytest.raises(IndexError, match="-1"):
        selected_values(flagged_log_softmax(logits, None, True), bad, None, True)


def test_sample_rows_from_the_runner_arrays_equal_the_per_request_rule():
    """The flagged rows holding a real sample, read from vLLM 0.32's per-step runner arrays
    (``optimistic_seq_lens_cpu``, ``discard_request_mask``), are the rows the per-request rule gives (computed +
    scheduled tokens reach the request's token count), over random batches of decode rows, partial and final
    prefill chunks and unflagged requests; a runner without those arrays uses the rule."""
    import types

    import torch
    from genartifact_logprobs.worker import LogprobCapture

    rng = np.random.default_rng(3)
    for trial in range(200):
        n = int(rng.integers(1, 12))
        rids = [f"r{trial}.{i}" for i in range(n)]
        computed = rng.integers(0, 300, n).astype(np.int32)
        sched = rng.integers(1, 70, n)
        # a request's token count: the step's end (decode, last prefill chunk) or beyond it (partial prefill)
        num_tokens = computed + sched + np.where(rng.random(n) < 0.3, rng.integers(1, 50, n), 0)
        ends = torch.zeros(16, dtype=torch.int32)
        ends[:n] = torch.from_numpy(computed + sched.astype(np.int32))
        mask = np.zeros(16, bool)
        mask[:n] = ends[:n].numpy() < num_tokens  # as GPUModelRunner._prepare_inputs sets it
        mr = types.SimpleNamespace(
            sampler=types.SimpleNamespace(forward=lambda *a, **k: None),
            input_batch=types.SimpleNamespace(num_reqs=n, req_ids=list(rids), num_computed_tokens_cpu=computed),
            requests={r: types.SimpleNamespace(num_tokens=int(t)) for r, t in zip(rids, num_tokens, strict=True)},
            optimistic_seq_lens_cpu=ends, discard_request_mask=types.SimpleNamespace(np=mask))
        cap = LogprobCapture(types.SimpleNamespace(model_runner=mr))
        assert cap._runner_arrays
        flagged = {r: f"c{r}" for r in rids if rng.random() < 0.7}
        cap.step = types.SimpleNamespace(
            scheduler_output=types.SimpleNamespace(num_scheduled_tokens=dict(zip(rids, sched.tolist(), strict=True))),
            flagged={"selected_logprobs": flagged})
        n_rows = n if trial % 5 else max(1, n - 2)  # fewer logits rows than requests: only those rows
        fast = cap._rows(n_rows)
        cap._runner_arrays = False
        assert fast == cap._rows(n_rows), trial
        assert all(type(e) is int for _, _, e in fast)
    del mr.optimistic_seq_lens_cpu
    assert not LogprobCapture(types.SimpleNamespace(model_runner=mr))._runner_arrays


def test_the_sampled_rows_are_read_and_stored_at_end_step_off_the_critical_path():
    """The sampler wrapper computes the flagged rows' log-softmax before sampling (the sampler may change the logits
    in place) and keeps the step's sampled ids by reference; ``end_step`` (deferred by the worker runtime until the
    step's output went back to the engine) reads and stores them: nothing is stored before it, exactly the
    log-softmax of the sampled token after it, and a token id outside the vocabulary raises there (the runtime
    fails the step's flagged requests instead of the engine's step)."""
    import types

    import torch
    from genartifact_logprobs.worker import LogprobCapture

    logits = torch.randn(3, 11)
    raw = logits.clone()
    sampled = torch.tensor([[4], [0], [10]])

    def forward(lg, meta):
        lg.mul_(0.5)  # a sampler that changes the logits in place (temperature): the logprobs are the raw ones
        return types.SimpleNamespace(sampled_token_ids=sampled)

    ends = torch.tensor([5, 9, 2, 0], dtype=torch.int32)
    mr = types.SimpleNamespace(
        sampler=types.SimpleNamespace(forward=forward),
        input_batch=types.SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c"], num_computed_tokens_cpu=np.zeros(3)),
        requests={}, optimistic_seq_lens_cpu=ends,
        discard_request_mask=types.SimpleNamespace(np=np.zeros(4, bool)))
    cap = LogprobCapture(types.SimpleNamespace(model_runner=mr))
    from genartifact.engine.worker_ext import WorkerStep

    step = WorkerStep(None, {"selected_logprobs": {"a": "ca", "c": "cc"}}, 1)
    cap.begin_step(step)
    mr.sampler.forward(logits, None)
    assert cap.store == {}  # read at end_step, not in the sampler's call
    step.closed = True  # (the runtime: the step's output went back, its end_step not yet run)
    kept = cap._sampled
    mr.sampler.forward(torch.randn(3, 11), None)  # a dummy run's sampler in between: ignored
    assert cap._sampled is kept
    sampled[0, 0] = 7  # (the sampled ids are read then: what the step's output holds at its end)
    cap.end_step(step)
    lp = raw.log_softmax(-1)
    assert sorted(cap.store) == ["ca", "cc"]
    for cid, row, pos, tok in (("ca", 0, 5, 7), ("cc", 2, 2, 10)):
        p, t, v = (a.tolist() for a in read_worker_answer(cap.pop(cid, [])))
        assert (p, t, v) == ([pos], [tok], [float(lp[row, tok])])  # (float32 both: equal bit for bit)
    step.closed = False
    cap.begin_step(step)
    mr.sampler.forward(raw.clone(), None)
    sampled[2, 0] = -3
    with pytest.raises(IndexError, match="-3"):
        cap.end_step(step)
    assert cap.step is None and cap._sampled is None  # nothing of the failed step is kept for the next one


def worker_sourced(answer):
    """A worker-sourced producer (the engine runs the worker capture, raw_logprobs) whose fetch gets ``answer``."""
    import asyncio
    import types

    model = ModelInfo("m", {}, engine_options={"worker_captures": ["selected_logprobs"], "logprobs_mode": "raw_logprobs"})
    p = SelectedLogprobs(model)
    p.admit(AdmissionContext(3, 4, 0, model, {}))
    params = {}
    p.sampling_overrides(params)
    assert p.worker_source and "genartifact_logprobs_id" in params["extra_args"]

    async def worker_call(method, *args):
        return [{"found": answer, "dp_rank": 0}]

    engine = types.SimpleNamespace(handover=None, data_parallel_size=1, worker_call=worker_call)
    tokens = np.frombuffer(answer["token_ids"], "<u4").tolist()
    asyncio.run(p.collect(FinalContext(3, len(tokens), engine, tuple(tokens))))
    return p


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.fault("encoder", "non-finite worker-captured logprob")
def test_worker_sourced_values_checked_at_collect(bad):
    """The worker's values are checked once at collect: finite or -inf pass; NaN or +inf fails the capture naming
    the value and its token."""
    ok = worker_sourced(worker_answer([3, 4, 5], [7, 8, 9], [-1.5, float("-inf"), -0.25]))
    section, parts = ok.finalize(FinalContext(3, 3))
    assert parts[0].array.tolist() == [-1.5, float("-inf"), -0.25]
    with pytest.raises(CaptureError, match=f"logprob {bad} for token 8; allowed finite or -inf"):
        worker_sourced(worker_answer([3, 4, 5], [7, 8, 9], [-1.0, bad, -2.0]))
    with pytest.raises(CaptureError, match=r"holds \[3, 3, 2\] positions"):
        worker_sourced({**worker_answer([3, 4, 5], [7, 8, 9], [-1.0, -2.0, 0.0]), "logprobs": bytes(8)})


def test_a_fault_in_the_sampler_wrapper_fails_the_step_not_the_sampler():
    """The wrapper's own work runs under ``WorkerStep.guard``: when it raises (here: the row walk), vLLM's sampler
    still runs exactly once and its output goes back unchanged, the step records the fault for this content (the
    runtime fails its flagged requests of the step), and nothing of the step is kept."""
    import types

    import torch
    from genartifact.engine.worker_ext import WorkerStep
    from genartifact_logprobs.worker import LogprobCapture

    calls = []
    out = types.SimpleNamespace(sampled_token_ids=torch.tensor([[1]]))

    def forward(lg, meta):
        calls.append(meta)
        return out

    mr = types.SimpleNamespace(sampler=types.SimpleNamespace(forward=forward),
                               input_batch=types.SimpleNamespace(num_reqs=1, req_ids=["a"]), requests={})
    cap = LogprobCapture(types.SimpleNamespace(model_runner=mr))

    def broken(n_rows):
        raise RuntimeError("row walk broke")

    cap._rows = broken
    step = WorkerStep(None, {"selected_logprobs": {"a": "ca"}}, 1)
    cap.begin_step(step)
    assert mr.sampler.forward(torch.randn(1, 5), "meta") is out and calls == ["meta"]
    assert "RuntimeError: row walk broke" in step.faults["selected_logprobs"] and cap._sampled is None
    cap.end_step(step)
    assert cap.store == {}


@pytest.mark.parametrize("seed", range(8))
def test_samples_answer_matches_a_position_keyed_reference(seed):
    """A request's samples (decode positions growing, now and then a preempted request's positions sampled
    again from an earlier one) give the answer a ``position -> latest (token, logprob)`` map gives: positions
    ascending, each once, its last sample; logprobs as float32, bit for bit."""
    from genartifact_logprobs.worker import Samples

    rng = np.random.default_rng(seed)
    s, ref, pos = Samples(), {}, int(rng.integers(1, 50))
    for _ in range(int(rng.integers(0, 300))):
        if rng.random() < 0.05:
            pos = int(rng.integers(0, pos + 1))  # recomputed from an earlier position
        tok, val = int(rng.integers(0, 2**32)), float(-rng.exponential() if rng.random() < 0.95 else -np.inf)
        s.add(pos, tok, val)
        ref[pos] = (tok, float(np.float32(val)))
        pos += 1
    p, t, v = (a.tolist() for a in read_worker_answer(s.answer()))
    keys = sorted(ref)
    assert (p, t, v) == (keys, [ref[k][0] for k in keys], [ref[k][1] for k in keys])
    assert len(s) >= len(keys)


def test_samples_refuse_what_the_answer_cannot_hold():
    from genartifact_logprobs.worker import Samples

    s = Samples()
    s.add(3, 9, -0.5)
    for bad in ((-1, 3, 0.0), (2**32, 3, 0.0), (4, -2, 0.0), (4, 2**32, 0.0)):
        with pytest.raises(OverflowError):
            s.add(*bad)
    with pytest.raises(TypeError):
        s.add(4, 5, "x")
    assert len(s) == 1 and s.ordered  # nothing of a refused sample is kept
    assert [a.tolist() for a in read_worker_answer(s.answer())] == [[3], [9], [-0.5]]


@pytest.mark.fault("worker", "a sampled token id the logprobs answer cannot hold")
def test_a_sample_out_of_bounds_fails_only_its_own_request():
    """``end_step`` meets a sample it cannot store (a token id above 32 bits): that request's answer says so and
    its collect fails naming the sample and the allowed range (``capture_invalid``); the other request of the same
    step keeps its samples."""
    import types

    import torch
    from genartifact.engine.worker_ext import WorkerStep
    from genartifact_logprobs.worker import LogprobCapture

    mr = types.SimpleNamespace(sampler=types.SimpleNamespace(forward=lambda lg, meta: None),
                               input_batch=types.SimpleNamespace(num_reqs=2, req_ids=["a", "b"]), requests={})
    cap = LogprobCapture(types.SimpleNamespace(model_runner=mr))
    step = WorkerStep(None, {"selected_logprobs": {"a": "ca", "b": "cb"}}, 1)
    cap.begin_step(step)
    lp = torch.log_softmax(torch.randn(2, 5), -1)
    cap._sampled = ([(0, "ca", 4), (1, "cb", 4)], lp, torch.tensor([[1], [2]]), None, True)
    import genartifact_logprobs.worker as lw

    real = lw.selected_values
    lw.selected_values = lambda *a: ([2**32 + 1, 2], real(*a)[1])
    try:
        cap.end_step(step)
    finally:
        lw.selected_values = real
    assert read_worker_answer(cap.pop("cb", []))[1].tolist() == [2]
    bad = cap.pop("ca", [])
    with pytest.raises(CaptureError, match=r"position 4 could not be stored .*allowed: positions and token ids "
                                           r"0\.\.4294967295"):
        read_worker_answer(bad)
