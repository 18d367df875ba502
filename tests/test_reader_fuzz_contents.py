"""Hostile manifests of valid objects holding moe_routes, selected_logprobs, top_logprobs and moe_route_weights: section values of
the wrong type, negative/huge counts, tensor refs with mismatched shape/dtype/offsets. Whatever the mutation,
``decode`` raises only ArtifactFormatError, and an object it accepts is safe for every reader path after it
(typed views, content summaries, every loader layout): only ArtifactFormatError/LayoutError, never
TypeError/KeyError/IndexError/MemoryError. Cross-plugin, so here rather than in one plugin's tests."""

from __future__ import annotations

import os

import numpy as np
from genartifact import format as fmt
from genartifact import loaders
from genartifact.errors import ArtifactFormatError
from genartifact.testing import hostile
from genartifact_route_weights import to_bf16_bits
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HOSTILE = [None, True, False, -1, 0, 1, 2**31, 2**63, -(2**63), 1e308, 1.5, "", "x" * 40, [], {}, [0] * 9,
           [1, 0], [-1], [2**40], {"a": 1}, "u1", "u2", "u4", "f4", "router_major"]


def _valid(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    p, c, routers, k, tk = int(rng.integers(1, 6)), int(rng.integers(1, 6)), int(rng.integers(1, 4)), 2, 3
    start = int(rng.integers(0, p + 1))
    rows = p + c - 1 - start
    lps = -np.sort(rng.random((c, tk)).astype(np.float32), axis=1)
    rids = sorted(rng.choice(40, routers, replace=False).tolist())
    wdt = "bf16" if seed % 2 else "f32"
    w = rng.random((routers, rows, k)).astype(np.float32)
    w = to_bf16_bits(w) if wdt == "bf16" else w
    return fmt.encode(fmt.ArtifactInput(
        token_ids=rng.integers(0, 50000, p + c).astype(np.uint32), prompt_token_count=p,
        contents=["moe_route_weights", "moe_routes", "selected_logprobs", "top_logprobs"],
        sections={"moe_routes": {"token_start": start, "router_ids": rids,
                                 "expert_counts": [8] * routers, "top_k": k, "layout": "router_major", "source": "t"},
                  "moe_route_weights": {"token_start": start, "router_ids": rids, "top_k": k, "dtype": wdt,
                                        "layout": "router_major", "router_scale": [1.0] * routers,
                                        "output_scale": [2.5] * routers, "source": "t"},
                  "selected_logprobs": {"token_start": p}, "top_logprobs": {"token_start": p, "k": tk}},
        tensors=[fmt.TensorPart("moe_route_weights.weights", w),
                 fmt.TensorPart("moe_routes.expert_ids", rng.integers(0, 8, (routers, rows, k)).astype(np.uint8)),
                 fmt.TensorPart("selected_logprobs.logprobs", -rng.random(c).astype(np.float32)),
                 fmt.TensorPart("top_logprobs.logprobs", np.ascontiguousarray(lps)),
                 fmt.TensorPart("top_logprobs.token_ids", rng.integers(0, 50000, (c, tk)).astype(np.uint32))],
        header={"engine": {"name": "fuzz", "version": "0"}})).data


SEEDS = [_valid(s) for s in range(6)]


def _mutate(obj: bytes, data: st.DataObject) -> bytes:
    try:
        _pre, _body, m, payload = hostile.split(obj)
    except Exception:  # noqa: BLE001 - an earlier round made the manifest unparseable: keep it as is
        return obj
    where = data.draw(st.sampled_from(["section", "section_key", "tensor", "envelope"]))
    if where == "section":
        m["sections"][data.draw(st.sampled_from(sorted(m["sections"])))] = data.draw(st.sampled_from(HOSTILE))
    elif where == "section_key":
        s = m["sections"][data.draw(st.sampled_from(sorted(m["sections"])))]
        if not isinstance(s, dict):  # replaced by an earlier round
            return obj
        key = data.draw(st.sampled_from(sorted(s) + ["zz"]))
        if data.draw(st.booleans()) and key in s:
            del s[key]
        else:
            s[key] = data.draw(st.sampled_from(HOSTILE))
    elif where == "tensor":
        t = data.draw(st.sampled_from(m["tensors"]))
        if not isinstance(t, dict):
            return obj
        key = data.draw(st.sampled_from(sorted(t)))
        if key == "shape":
            v = t["shape"]
            if not isinstance(v, list) or not all(type(x) is int for x in v):
                return obj
            t["shape"] = data.draw(st.sampled_from([v[::-1], v + [1], v[:-1], [0] + v[1:], [x * 2 for x in v],
                                                    [2**40] + v[1:], [-1] + v[1:], [1.5] * len(v), []]))
        else:
            t[key] = data.draw(st.sampled_from(HOSTILE))
    else:
        key = data.draw(st.sampled_from(["prompt_token_count", "completion_token_count", "contents"]))
        near = [m[n] + d for n in ("prompt_token_count", "completion_token_count") for d in (-1, 1)
                if type(m.get(n)) is int]
        m[key] = data.draw(st.sampled_from(HOSTILE + near))
    return hostile.repack(fmt.canonical_json(m), payload)


def _after_decode(art: fmt.Artifact) -> None:
    p, t = art.prompt_token_count, len(art.token_ids)
    calls = [art.routes, lambda: art.content("moe_routes"), lambda: art.content("selected_logprobs"),
             lambda: art.content("top_logprobs"), lambda: [art.content_summary(n) for n in art.contents],
             lambda: loaders.verl(art, padded_prompt_len=p + 2, total_len=t + 5),
             lambda: loaders.verl(art, padded_prompt_len=p, total_len=t, num_layers=64),
             lambda: loaders.slime(art), lambda: loaders.nemo_rl(art), lambda: loaders.raw(art),
             lambda: loaders.packed([art, art]), lambda: loaders.top_logprobs(art),
             lambda: loaders.stitch_turns([art]), lambda: art.content("moe_route_weights"),
             lambda: loaders.route_weights(art), lambda: loaders.raw(art, weights=True).weights(),
             lambda: loaders.verl(art, padded_prompt_len=p, total_len=t, num_layers=64, weights=True),
             lambda: loaders.packed([art, art], weights=True)]
    for call in calls:
        try:
            call()
        except (ArtifactFormatError, loaders.LayoutError):
            pass


@settings(max_examples=int(os.environ.get("GENARTIFACT_FUZZ_EXAMPLES", "400")), deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, len(SEEDS) - 1), rounds=st.integers(1, 2), data=st.data())
def test_manifest_mutations_only_raise_format_errors(seed, rounds, data):
    obj = SEEDS[seed]
    for _ in range(rounds):
        obj = _mutate(obj, data)
    try:
        art = fmt.decode(obj)
    except ArtifactFormatError:
        return
    _after_decode(art)


def test_seeds_are_valid_and_fully_readable():
    for obj in SEEDS:
        art = fmt.decode(obj)
        _after_decode(art)
        ids, lps = loaders.top_logprobs(art)
        assert ids.shape == lps.shape == (art.manifest["completion_token_count"], 3)
        assert loaders.route_weights(art).shape == art.routes().shape
