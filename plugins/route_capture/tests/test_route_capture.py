"""moe_routes plugin: router layouts per family, the worker recorder's position attribution, entry point."""

from __future__ import annotations

import importlib.metadata as md

import numpy as np
import pytest
from genartifact.errors import AdmissionError
from genartifact_route_capture.layout import resolve_layout
from genartifact_route_capture.recorder import RouteRecorder


def test_entry_point_declared():
    eps = {ep.name: ep for ep in md.entry_points(group="genartifact.contents")}
    assert eps["moe_routes"].value == "genartifact_route_capture"
    assert eps["moe_routes"].dist.name == "genartifact-route-capture"


@pytest.mark.parametrize(
    "cfg, ids, experts, k",
    [
        ({"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts": 128, "num_experts_per_tok": 8,
          "decoder_sparse_step": 2, "mlp_only_layers": []}, (1, 3, 5), 128, 8),
        ({"model_type": "qwen2_moe", "num_hidden_layers": 4, "num_experts": 60, "num_experts_per_tok": 4,
          "decoder_sparse_step": 1, "mlp_only_layers": [0, 2]}, (1, 3), 60, 4),
        ({"model_type": "deepseek_v3", "num_hidden_layers": 6, "n_routed_experts": 256, "num_experts_per_tok": 8,
          "first_k_dense_replace": 1, "moe_layer_freq": 2}, (2, 4), 256, 8),
        ({"model_type": "deepseek_v3", "num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8,
          "first_k_dense_replace": 3}, tuple(range(3, 61)), 256, 8),
        ({"model_type": "glm4_moe", "num_hidden_layers": 5, "n_routed_experts": 160, "num_experts_per_tok": 8,
          "first_k_dense_replace": 2, "moe_layer_freq": 2}, (2, 3, 4), 160, 8),
        ({"model_type": "mixtral", "num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2},
         (0, 1, 2), 8, 2),
        ({"model_type": "gpt_oss", "num_hidden_layers": 2, "num_local_experts": 32, "num_experts_per_tok": 4},
         (0, 1), 32, 4),
        ({"model_type": "llama4", "text_config": {"model_type": "llama4_text", "num_hidden_layers": 4,
          "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}}, (1, 3), 16, 1),
    ],
    ids=["qwen3-step2", "qwen2-mlp-only", "deepseek-freq2", "deepseek-v3", "glm-ignores-freq", "mixtral", "gpt-oss",
         "llama4-nested"],
)
def test_router_layouts(cfg, ids, experts, k):
    lay = resolve_layout(cfg)
    assert (lay.router_ids, lay.num_experts, lay.top_k) == (ids, experts, k)


def test_itemsize_follows_vllm_convention():
    base = {"model_type": "mixtral", "num_hidden_layers": 1, "num_experts_per_tok": 2}
    assert resolve_layout({**base, "num_local_experts": 256}).itemsize == 1
    assert resolve_layout({**base, "num_local_experts": 257}).itemsize == 2


def test_conflicting_nested_config():
    with pytest.raises(AdmissionError, match="conflicting values in text_config"):
        resolve_layout({"model_type": "mixtral", "num_hidden_layers": 2,
                        "text_config": {"num_hidden_layers": 3, "num_local_experts": 4, "num_experts_per_tok": 2}})


def make_recorder():
    return RouteRecorder(router_ids=(1, 3), top_k=2, dtype=np.dtype("u1"), max_positions=100)


def step(rec, segs, layer_rows):
    rec.begin_step(segs)
    for lid, rows in layer_rows.items():
        rec.on_layer(lid, np.asarray(rows, np.uint8))
    rec.end_step()


def rows_for(base, n):
    return [[base + i, base + i + 1] for i in range(n)]


def test_recorder_chunked_prefill_batching_and_recompute():
    rec = make_recorder()
    # step 1: A prefill chunk positions 0..2, B (not captured) 2 tokens, C prefill 0..1
    step(rec, [("A", 0, 3), (None, 0, 2), ("C", 0, 2)], {1: rows_for(0, 7), 3: rows_for(50, 7) + [[9, 9]]})
    # step 2: A rest of prefill 3..4 ; C decode at 2
    step(rec, [("C", 2, 1), ("A", 3, 2)], {1: rows_for(10, 3), 3: rows_for(60, 3)})
    # step 3: A preempted and recomputed from 0 (overwrites same positions), decode position 5
    step(rec, [("A", 0, 6)], {1: rows_for(20, 6), 3: rows_for(70, 6)})
    assert rec.recomputed_positions == 5  # A's positions 0..4 written twice
    a = rec.fetch("A", 0, 6)
    arr = np.frombuffer(a["data"], np.uint8).reshape(a["shape"])
    assert a["missing"] is None and arr.shape == (2, 6, 2)
    assert arr[0].tolist() == rows_for(20, 6) and arr[1].tolist() == rows_for(70, 6)
    c = rec.fetch("C", 0, 3)
    carr = np.frombuffer(c["data"], np.uint8).reshape(c["shape"])
    assert carr[0].tolist() == rows_for(5, 2) + rows_for(10, 1)  # rows 5,6 of step 1 then row 0 of step 2
    assert rec.fetch("A", 0, 6) is None  # popped


def test_recorder_decode_steps_scalar_path_counts_recompute_and_grows():
    rec = make_recorder()
    step(rec, [("A", 0, 2)], {1: rows_for(0, 2), 3: rows_for(30, 2)})
    for pos in range(2, 70):  # single-token decode steps past the initial capacity (64 positions)
        step(rec, [("A", pos, 1)], {1: [[pos, pos + 1]], 3: [[pos + 1, pos]]})
    assert rec.recomputed_positions == 0
    step(rec, [("A", 69, 1)], {1: [[7, 8]], 3: [[8, 7]]})  # the same decode position again (recompute)
    assert rec.recomputed_positions == 1
    a = rec.fetch("A", 0, 70)
    arr = np.frombuffer(a["data"], np.uint8).reshape(a["shape"])
    assert a["missing"] is None and arr.shape == (2, 70, 2)
    assert arr[0, 2:69].tolist() == [[p, p + 1] for p in range(2, 69)] and arr[:, 69].tolist() == [[7, 8], [8, 7]]


@pytest.mark.parametrize(("dtype", "k"), [("u1", 3), ("u1", 8), ("<u2", 8), ("<u2", 1), ("<f4", 2)])
@pytest.mark.parametrize("seed", range(6))
def test_recorder_matches_a_reference_over_random_steps(seed, dtype, k):
    """Random steps (prefill chunks, decode rows right after a request's last one, recomputes of earlier
    positions, gaps, positions past ``max_positions``, unflagged requests, fetches and discards mid-run) against a
    plain reference (position -> latest row): every fetch's rows, missing range, the recompute count and the
    retained bytes agree, whichever path (the decode tail or the buffer) held the rows, for every kind of row the
    fetch's word-wise copy takes (3 bytes, one and two ``uint64``, one ``uint16``, float rows)."""
    rng = np.random.default_rng(seed)
    routers, max_positions = (0, 2, 5), 90
    rec = RouteRecorder(router_ids=routers, top_k=k, dtype=np.dtype(dtype), max_positions=max_positions)
    ref: dict[str, dict[int, list[list[int]]]] = {}  # cid -> position -> [routers][top_k]
    recomputed = 0
    nxt: dict[str, int] = {}
    for _ in range(160):
        segs, cids = [], [f"c{i}" for i in rng.choice(6, size=int(rng.integers(1, 5)), replace=False)]
        for cid in cids:
            at = nxt.get(cid, 0)
            r = rng.random()
            if r < 0.6:
                start, n = at, 1  # the next decode row
            elif r < 0.75:
                start, n = at, int(rng.integers(2, 9))  # a prefill chunk
            elif r < 0.9:
                start = int(rng.integers(0, at + 1))  # a recompute from an earlier position
                n = int(rng.integers(1, 6))
            else:
                start, n = at + int(rng.integers(1, 4)), 1  # a gap (positions never computed)
            segs.append((cid, start, n))
            nxt[cid] = max(at, start + n)
        if rng.random() < 0.3:
            segs.insert(int(rng.integers(0, len(segs) + 1)), (None, 0, int(rng.integers(1, 4))))  # not flagged
        total = sum(n for _, _, n in segs)
        layers = {lid: rng.integers(0, 256, (total + int(rng.integers(0, 3)), k), dtype=np.int64) for lid in routers}
        rec.begin_step(segs)
        for lid in rng.permutation(routers):
            rec.on_layer(int(lid), layers[int(lid)])
        rec.end_step()
        off = 0
        for cid, start, n in segs:
            if cid is not None:
                rows = ref.setdefault(cid, {})
                for j in range(n):
                    if start + j < max_positions:
                        recomputed += (start + j) in rows
                        rows[start + j] = [layers[lid][off + j].tolist() for lid in routers]
            off += n
        assert rec.recomputed_positions == recomputed
        assert rec.retained_bytes() >= sum(len(v) for v in ref.values()) * len(routers) * k
        if rng.random() < 0.15 and ref:
            cid = str(rng.choice(sorted(ref)))
            if rng.random() < 0.3:
                assert rec.discard(cid)
                ref.pop(cid)
                nxt.pop(cid, None)
                continue
            start, end = int(rng.integers(0, 10)), int(rng.integers(0, max_positions + 20))
            got = rec.fetch(cid, start, end)
            rows = ref.pop(cid)
            nxt.pop(cid, None)
            end = min(end, max_positions)
            start = min(start, end)
            arr = np.frombuffer(got["data"], np.dtype(dtype)).reshape(got["shape"])
            assert arr.shape == (len(routers), end - start, k) and got["dtype"] == np.dtype(dtype).str
            holes = [p for p in range(start, end) if p not in rows]
            assert got["missing"] == ([holes[0], len(holes)] if holes else None)
            for p in range(start, end):
                want = rows.get(p, [[0] * k for _ in routers])
                assert arr[:, p - start].tolist() == want, (seed, cid, p)


def test_recorder_reports_missing_positions_and_honours_start():
    rec = make_recorder()
    step(rec, [("A", 4, 2)], {1: rows_for(0, 2), 3: rows_for(0, 2)})  # positions 0..3 never computed (cached)
    a = rec.fetch("A", 0, 6)
    assert a["missing"] == [0, 4]
    step(rec, [("B", 4, 2)], {1: rows_for(0, 2), 3: rows_for(0, 2)})
    assert rec.fetch("B", 4, 6)["missing"] is None


def test_recorder_missing_layer_leaves_positions_unfilled():
    rec = make_recorder()
    step(rec, [("A", 0, 2)], {1: rows_for(0, 2)})  # router 3 never called back
    assert rec.fetch("A", 0, 2)["missing"] == [0, 2]


def test_recorder_ignores_padding_rows_and_unflagged_steps():
    rec = make_recorder()
    step(rec, [(None, 0, 4)], {1: rows_for(0, 4), 3: rows_for(0, 4)})
    assert rec.reqs == {} and rec.steps == 0
    step(rec, [("A", 0, 2)], {1: rows_for(0, 2) + [[7, 7]] * 6, 3: rows_for(1, 2) + [[7, 7]] * 6})
    assert rec.fetch("A", 0, 2)["missing"] is None


def test_replay_check_receipts_line_nested_too_deeply_is_listed_not_raised(tmp_path):
    """A receipts line of JSON nested past the recursion limit is that line's error (was RecursionError out of
    the whole command, exit 3); the other lines are still read."""
    from genartifact_route_capture.replay_check import _load_inputs

    p = tmp_path / "r.jsonl"
    p.write_text("[" * 100_000 + "]" * 100_000 + '\n{"state": "failed", "error_code": "timeout"}\n')
    out = _load_inputs([str(p)], None)
    assert [lab for lab, _ in out] == [f"{p}:1", f"{p}:2"]
    assert out[0][1] == "receipt is not JSON: nested too deeply"


@pytest.mark.parametrize("dtype, tdtype, values", [
    ("u1", "int64", [0, 7, 255]),  # vLLM's int64/int32 topk_ids into the u8 layout
    ("<u2", "int32", [0, 256, 65535]),  # more than 256 experts: u16 layout
    ("<f4", "float32", [0.0, 0.25, 1.5]),  # a recorder of router weights (genartifact-route-weights)
])
def test_recorder_torch_layers_stacked_at_step_end_with_padding(dtype, tdtype, values):
    """The worker path: each layer's torch ``topk_ids`` kept by reference until the step's end, then stacked and
    converted to the compact dtype at once; rows past the step's tokens (padding) dropped, in any layer."""
    import torch

    rec = RouteRecorder(router_ids=(0, 2, 5), top_k=3, dtype=np.dtype(dtype), max_positions=100)
    rec.begin_step([("A", 0, 2), (None, 0, 1), ("B", 7, 1)])
    assert rec.recording
    layers = {}
    for lid in (5, 0, 2):  # any call order
        t = torch.tensor([[values[(lid + r + j) % 3] for j in range(3)] for r in range(6)], dtype=getattr(torch, tdtype))
        layers[lid] = t[: 4 + (lid == 2) * 2]  # 4 tokens in the step; layer 2 carries two padding rows
        rec.on_layer(lid, layers[lid])
    rec.on_layer(9, torch.zeros((4, 3), dtype=getattr(torch, tdtype)))  # not a router of this layout: ignored
    rec.end_step()
    assert not rec.recording
    a = rec.fetch("A", 0, 2)
    arr = np.frombuffer(a["data"], np.dtype(dtype)).reshape(a["shape"])
    assert a["missing"] is None and arr.shape == (3, 2, 3)
    for i, lid in enumerate((0, 2, 5)):
        assert arr[i].tolist() == layers[lid][:2].tolist()
    b = rec.fetch("B", 7, 8)
    barr = np.frombuffer(b["data"], np.dtype(dtype)).reshape(b["shape"])
    assert [barr[i, 0].tolist() for i in range(3)] == [layers[lid][3].tolist() for lid in (0, 2, 5)]


def test_recorder_torch_missing_layer_leaves_positions_unfilled():
    import torch

    rec = make_recorder()
    rec.begin_step([("A", 0, 2)])
    rec.on_layer(1, torch.ones((2, 2), dtype=torch.int64))
    rec.end_step()  # router 3 never called back: nothing stacked, the positions stay unfilled
    assert rec.fetch("A", 0, 2)["missing"] == [0, 2] and rec.steps == 0


def test_admission_layout_follows_the_config_and_its_contents():
    """Admission resolves the config it is given each time (``resolve_layout``, no cache): a config changed in place,
    or another config, gives its own layout (and a bad one fails admission, every time)."""
    import genartifact_route_capture as rc

    cfg = {"model_type": "mixtral", "num_hidden_layers": 3, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert rc.layout_for(cfg).top_k == 2
    cfg["num_experts_per_tok"] = 4
    assert rc.layout_for(cfg).top_k == 4  # changed in place: resolved again
    cfg["num_experts_per_tok"] = 4.0  # equal to 4, but not an integer: refused
    with pytest.raises(AdmissionError, match="num_experts_per_tok"):
        rc.layout_for(cfg)
    cfg["num_experts_per_tok"] = 4
    other = {**cfg, "num_hidden_layers": 2}
    assert rc.layout_for(other).router_ids == (0, 1)
    bad = {**cfg, "num_experts_per_tok": 9}
    for _ in range(2):
        with pytest.raises(AdmissionError, match="exceeds expert count"):
            rc.layout_for(bad)


def test_router_calls_after_a_step_closed_are_ignored_until_its_deferred_end_step():
    """Between a step's end (its output went back: ``WorkerStep.closed``) and its deferred ``end_step``, router
    calls come from a run outside the step (a data-parallel dummy batch, a profile run): they must not replace the
    step's kept ``topk_ids``, which ``end_step`` then records at the step's positions."""
    from types import SimpleNamespace as NS

    import torch
    from genartifact.engine.worker_ext import WorkerStep
    from genartifact_route_capture.recorder import RouteRecorder
    from genartifact_route_capture.worker import RouteCapture

    cap = object.__new__(RouteCapture)  # (no vLLM model: the recorder and the runner's batch by hand)
    cap.recorder = RouteRecorder(router_ids=[0, 1], top_k=2, dtype=np.dtype("<u1"), max_positions=64)
    ib = NS(num_reqs=1, req_ids=["a"], num_computed_tokens_cpu=np.array([3]))
    cap.worker = NS(model_runner=NS(input_batch=ib))
    cap.step, cap.step_ready = None, False
    step = WorkerStep(NS(num_scheduled_tokens={"a": 1}), {"moe_routes": {"a": "ca"}}, 1)
    cap.begin_step(step)
    cap.capture(0, torch.tensor([[1, 2]]))
    cap.capture(1, torch.tensor([[3, 4]]))
    step.closed = True
    cap.capture(0, torch.tensor([[7, 7]]))  # a dummy run before the deferred end_step
    cap.end_step(step)
    out = cap.pop("ca", [3, 4])
    assert np.frombuffer(out["data"], np.uint8).reshape(out["shape"]).tolist() == [[[1, 2]], [[3, 4]]]
    assert out["missing"] is None


def test_the_router_callback_only_keeps_rows_and_a_recorder_fault_comes_out_of_end_step():
    """The router callback runs inside vLLM's forward: it only keeps the layer's rows (nothing there can fail, and
    nothing of the recorder runs on the engine's critical path). The recorder works in ``end_step``, where a fault
    raises to the runtime, which fails the step's flagged requests of this content (pinned for any ``end_step`` by
    ``tests/test_worker_runtime.py::test_a_failing_deferred_end_step_fails_its_requests_never_the_workers_loop``);
    the next step records again."""
    from types import SimpleNamespace as NS

    import pytest
    import torch
    from genartifact.engine.worker_ext import WorkerStep
    from genartifact_route_capture.recorder import RouteRecorder
    from genartifact_route_capture.worker import RouteCapture

    cap = object.__new__(RouteCapture)
    cap.recorder = RouteRecorder(router_ids=[0, 1], top_k=2, dtype=np.dtype("<u1"), max_positions=64)
    calls = []
    real = cap.recorder.on_layer

    def broken(layer_id, rows):
        calls.append(layer_id)
        raise ValueError("recorder broke")

    cap.recorder.on_layer = broken
    ib = NS(num_reqs=1, req_ids=["a"], num_computed_tokens_cpu=np.array([3]))
    cap.worker = NS(model_runner=NS(input_batch=ib))
    cap.step, cap._kept = None, []
    step = WorkerStep(NS(num_scheduled_tokens={"a": 1}), {"moe_routes": {"a": "ca"}}, 1)
    cap.begin_step(step)
    assert cap.capture(0, torch.tensor([[1, 2]])) is None
    assert cap.capture(1, torch.tensor([[3, 4]])) is None
    assert calls == [] and not step.faults  # nothing of the recorder ran inside the forward
    step.closed = True
    with pytest.raises(ValueError, match="recorder broke"):
        cap.end_step(step)
    assert cap.step is None and cap._kept == []  # nothing of the failed step is kept for the next one
    cap.recorder.on_layer = real
    ib.num_computed_tokens_cpu = np.array([4])
    step2 = WorkerStep(NS(num_scheduled_tokens={"a": 1}), {"moe_routes": {"a": "ca"}}, 2)
    cap.begin_step(step2)
    cap.capture(0, torch.tensor([[5, 6]]))
    cap.capture(1, torch.tensor([[7, 0]]))
    step2.closed = True
    cap.end_step(step2)
    out = cap.pop("ca", [4, 5])
    assert np.frombuffer(out["data"], np.uint8).reshape(out["shape"]).tolist() == [[[5, 6]], [[7, 0]]]
