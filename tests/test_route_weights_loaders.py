"""Loaders with router weights (moe_route_weights) on hand-built artifacts: golden verl / raw / packed /
route_weights layouts, output_scale applied, bf16 widened, multi-turn stitching, and the errors."""

from __future__ import annotations

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact import loaders as ld
from genartifact_route_weights import to_bf16_bits

# P=3 prompt + C=2 completion tokens, rows from token_start=1 (positions 1, 2, 3), routers at decoder layers 1 and 3
TOKENS = [11, 12, 13, 14, 15]
P, START = 3, 1
ROWS = np.array([[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 1], [4, 3]]], np.uint8)  # [rows, routers, k]
W = np.array([[[0.75, 0.25], [0.5, 0.5]], [[0.625, 0.375], [0.875, 0.125]], [[1.0, 0.0], [0.5625, 0.4375]]],
             np.float32)  # exactly representable in bf16


def make(tokens=TOKENS, start=START, rows=ROWS, w=W, dtype="f32", scale=(1.0, 1.0), weights=True, p=P):
    sections = {"moe_routes": {"token_start": start, "router_ids": [1, 3], "expert_counts": [8, 8], "top_k": 2,
                               "layout": "router_major", "source": "test"}}
    parts = [fmt.TensorPart("moe_routes.expert_ids", np.ascontiguousarray(rows.transpose(1, 0, 2)))]
    contents = ["moe_routes"]
    if weights:
        contents.append("moe_route_weights")
        stored = np.ascontiguousarray(w.transpose(1, 0, 2))
        sections["moe_route_weights"] = {"token_start": start, "router_ids": [1, 3], "top_k": 2, "dtype": dtype,
                                         "layout": "router_major", "router_scale": [1.0, 1.0],
                                         "output_scale": list(scale)}
        parts.append(fmt.TensorPart("moe_route_weights.weights", to_bf16_bits(stored) if dtype == "bf16" else stored))
    return fmt.decode(fmt.encode(fmt.ArtifactInput(np.array(tokens, np.uint32), p, contents, sections, parts)).data)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_layouts_carry_weights_aligned_with_routes(dtype):
    art = make(dtype=dtype, scale=(2.0, 1.0))
    want = W * np.array([2.0, 1.0], np.float32)[None, :, None]  # output_scale per router applied
    assert np.array_equal(ld.route_weights(art), want)
    assert np.array_equal(ld.Routes.of(art).weights, want)
    # verl: left-padded, rows from padded_prompt_len - P + token_start, zeros elsewhere, same places as routes
    r, w = ld.verl(art, padded_prompt_len=5, total_len=9, weights=True)
    assert r.shape == w.shape == (1, 9, 2, 2) and w.dtype == np.float32
    assert np.array_equal(w[0, 3:6], want) and not w[0, :3].any() and not w[0, 6:].any()
    assert np.array_equal(r[0, 3:6], ROWS.astype(np.int16))
    assert np.array_equal(ld.verl(art, padded_prompt_len=5, total_len=9), r)  # weights=False: routes only
    # all decoder layers: dense layers 0 and 2 hold 0.0
    _, w4 = ld.verl(art, padded_prompt_len=3, total_len=5, num_layers=4, weights=True)
    assert np.array_equal(w4[0, 1:4, [1, 3]], want.transpose(1, 0, 2)) and not w4[0, :, [0, 2]].any()
    # raw: float32 bytes of the same shape as the route bytes
    raw = ld.raw(art, weights=True)
    assert raw.weights().shape == raw.array().shape == (3, 2, 2) and np.array_equal(raw.weights(), want)
    with pytest.raises(ld.LayoutError, match="weights=True"):
        ld.raw(art).weights()
    # packed: one row per token, fill rows (before token_start, the last token) weight 0.0
    pk = ld.packed([art, art], weights=True)
    assert pk.weights.shape == pk.routes.shape == (10, 2, 2)
    for o in (0, 5):
        assert not pk.weights[o].any() and not pk.weights[o + 4].any() and (pk.routes[o] == -1).all()
        assert np.array_equal(pk.weights[o + 1 : o + 4], want)
    assert ld.packed([art]).weights is None
    tw = ld.route_weights(art, backend="torch")
    assert tuple(tw.shape) == (3, 2, 2)


def test_weights_errors_name_the_item():
    plain = make(weights=False)
    assert ld.Routes.of(plain).weights is None
    for call in (lambda: ld.route_weights(plain), lambda: ld.verl(plain, padded_prompt_len=3, total_len=5, weights=True),
                 lambda: ld.raw(plain, weights=True)):
        with pytest.raises(ld.LayoutError, match="no moe_route_weights"):
            call()
    with pytest.raises(ld.LayoutError, match="item 1: weights=True"):
        ld.packed([make(), plain], weights=True)


def test_stitched_turns_join_weights():
    # turn 0: tokens 11..15, rows of positions 1..3; turn 1 extends it (start = 5 - 1 = 4): positions 4..5
    t0 = make()
    rows1 = np.array([[[3, 1], [2, 5]], [[0, 7], [6, 1]]], np.uint8)
    w1 = np.array([[[0.5, 0.5], [0.75, 0.25]], [[0.875, 0.125], [0.5, 0.5]]], np.float32)
    t1 = make(tokens=[*TOKENS, 16, 17], start=4, rows=rows1, w=w1, p=6)
    s = ld.stitch_turns([t0, t1])
    assert np.array_equal(s.weights, np.concatenate([W, w1])) and s.weights.shape[:2] == s.rows.shape[:2]
    assert ld.stitch_turns([t0, make(tokens=[*TOKENS, 16, 17], start=4, rows=rows1, weights=False, p=6)]).weights is None
