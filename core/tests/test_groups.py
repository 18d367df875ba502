"""GRPO group dedup: prompt part + sample parts join to exactly the non-deduplicated rows; mismatching prompt
rows stay with their sample; wrong references are refused."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact import groups
from genartifact import loaders as ld

P, C, R, K, E = 12, 5, 3, 2, 16


def full_sample(prompt_rows: np.ndarray, seed: int, start: int = 0) -> fmt.ArtifactInput:
    rng = np.random.default_rng(seed)
    tok = np.concatenate([np.arange(100, 100 + P), rng.integers(0, 50, C)]).astype(np.uint32)
    comp = rng.integers(0, E, (R, C, K)).astype(np.uint8)  # rows for positions P-1 .. P+C-2
    ids = np.concatenate([prompt_rows[:, start:], comp], axis=1)
    return fmt.ArtifactInput(
        tok, P, ["moe_routes", "selected_logprobs"],
        {"moe_routes": {"token_start": start, "requested_token_start": start, "router_ids": [0, 2, 5], "expert_counts": [E] * R, "top_k": K,
                        "layout": "router_major", "source": "test"}, "selected_logprobs": {"token_start": P}},
        [fmt.TensorPart("moe_routes.expert_ids", np.ascontiguousarray(ids)),
         fmt.TensorPart("selected_logprobs.logprobs", -rng.random(C).astype(np.float32))])


class MemTarget:
    def __init__(self, objs):
        self.objs, self.reads = objs, []

    async def open(self, oid, max_bytes):
        self.reads.append(oid)
        if oid not in self.objs:
            raise FileNotFoundError(oid)
        return self.objs[oid]


def build(start=0, mismatch_sample=2, mismatch_rows=(4, 7)):
    prompt_rows = np.random.default_rng(0).integers(0, E, (R, P - 1, K)).astype(np.uint8)
    samples = []
    for k in range(4):
        pr = prompt_rows.copy()
        if k == mismatch_sample:
            for r in mismatch_rows:
                pr[1, r] = (pr[1, r] + 1) % E  # this sample's prefill routed rows 4 and 7 differently
        samples.append(full_sample(pr, seed=k, start=start))
    part = fmt.encode(groups.prompt_part(samples, "g1"))
    rec = {"object_id": "mem:g1/prompt", "sha256": part.sha256, "byte_count": part.byte_count}
    sparts = groups.sample_parts(samples, "g1", rec)
    return samples, part, sparts


@pytest.mark.parametrize("start", [0, 3])
def test_join_equals_the_full_artifact(start):
    samples, part, sparts = build(start)
    pa = fmt.decode(part.data)
    assert pa.manifest["header"]["group"] == {"id": "g1", "role": "prompt_part", "size": 4}
    assert pa.routes().shape == (P - 1 - start, R, K) and pa.token_ids.shape == (P,)
    for k, (full, sp) in enumerate(zip(samples, sparts, strict=True)):
        want = fmt.decode(fmt.encode(full).data)
        got = groups.join(pa, fmt.decode(fmt.encode(sp.input).data))
        assert got.token_start == start and np.array_equal(got.rows, want.routes())
        assert np.array_equal(ld.verl(got, padded_prompt_len=P, total_len=P + C),
                              ld.verl(want, padded_prompt_len=P, total_len=P + C))
        if k == 2:  # the differing rows (from position 4 on) stay with the sample, counted
            assert (sp.prompt_row_mismatches, sp.token_start) == (2, 4)
        else:
            assert (sp.prompt_row_mismatches, sp.token_start) == (0, P - 1)


def test_dedup_saves_bytes_and_loader_fetches_prompt_once():
    samples, part, sparts = build()
    encs = [fmt.encode(sp.input) for sp in sparts]
    objs = {"mem:g1/prompt": part.data, **{f"mem:s{k}": e.data for k, e in enumerate(encs)}}
    t = MemTarget(objs)
    recs = [{"state": "ready", "object_id": f"mem:s{k}", "sha256": e.sha256, "byte_count": e.byte_count}
            for k, e in enumerate(encs)]
    res = groups.load_group(recs, t)
    assert res.ok and t.reads.count("mem:g1/prompt") == 1
    for full, got in zip(samples, res.items, strict=True):
        assert np.array_equal(got.rows, fmt.decode(fmt.encode(full).data).routes())
    # a tampered prompt part: every sample fails with the sha256 check, none is lost silently
    objs["mem:g1/prompt"] = part.data[:-1] + bytes([part.data[-1] ^ 1])
    res = groups.load_group(recs, MemTarget(objs))
    assert [(e.index, e.check) for e in res.errors] == [(k, "sha256") for k in range(4)]


def test_refusals():
    samples, part, sparts = build()
    other = fmt.decode(fmt.encode(groups.prompt_part(samples[1:], "g2")).data)  # same rows, other digest
    with pytest.raises(groups.GroupError, match="digest"):
        groups.join(other, fmt.decode(fmt.encode(sparts[0].input).data))
    bad = list(samples)
    bad[1] = full_sample(np.zeros((R, P - 1, K), np.uint8), 9, start=2)
    with pytest.raises(groups.GroupError, match="token_start"):
        groups.prompt_part(bad, "g")
    with pytest.raises(groups.GroupError, match="not a group sample"):
        groups.join(fmt.decode(part.data), fmt.decode(part.data))
    with pytest.raises(groups.GroupError, match="sha256"):
        groups.sample_parts(samples, "g", {"object_id": "x"})
    assert asyncio.run(groups.aload_group([], MemTarget({}))).items == []


class AskingTarget(MemTarget):
    """Records the max_bytes asked for each read."""

    def __init__(self, objs):
        super().__init__(objs)
        self.asked = {}

    async def open(self, oid, max_bytes):
        self.asked[oid] = max_bytes
        return await super().open(oid, max_bytes)


@pytest.mark.parametrize("prompt_ref, message", [
    ("mem:g1/prompt", "prompt_part is str"),
    ([1, 2], "prompt_part is list"),
    ({"sha256": "0" * 64, "byte_count": 10}, "no object_id"),
    ({"object_id": "mem:g1/prompt", "sha256": "0" * 64, "byte_count": "zz"}, "byte_count 'zz'"),
    ({"object_id": "mem:g1/prompt", "sha256": 5, "byte_count": 10}, "sha256"),
])
def test_hostile_prompt_part_reference_fails_only_its_sample(prompt_ref, message):
    """A sample's header is free-form JSON: a malformed header.group.prompt_part is that item's receipt error,
    never an exception out of the whole batch."""
    samples, part, sparts = build()
    bad = sparts[1].input
    header = {**bad.header, "group": {**bad.header["group"], "prompt_part": prompt_ref}}
    encs = [fmt.encode(sp.input) for sp in sparts]
    encs[1] = fmt.encode(fmt.ArtifactInput(bad.token_ids, bad.prompt_token_count, bad.contents, bad.sections,
                                           bad.tensors, header))
    objs = {"mem:g1/prompt": part.data, **{f"mem:s{k}": e.data for k, e in enumerate(encs)}}
    recs = [{"state": "ready", "object_id": f"mem:s{k}", "sha256": e.sha256, "byte_count": e.byte_count}
            for k, e in enumerate(encs)]
    res = groups.load_group(recs, MemTarget(objs))
    assert [(e.index, e.check) for e in res.errors] == [(1, "receipt")]
    assert message in str(res.errors[0])
    assert all(res.items[k] is not None for k in (0, 2, 3))


def test_prompt_part_read_is_bounded_by_the_decode_limit():
    """A reference declaring a huge byte_count must not let the read grow past the largest valid object."""
    samples, part, sparts = build()
    bad = sparts[0].input
    ref = {**bad.header["group"]["prompt_part"], "byte_count": 2**62}
    header = {**bad.header, "group": {**bad.header["group"], "prompt_part": ref}}
    enc = fmt.encode(fmt.ArtifactInput(bad.token_ids, bad.prompt_token_count, bad.contents, bad.sections,
                                       bad.tensors, header))
    t = AskingTarget({"mem:g1/prompt": part.data, "mem:s0": enc.data})
    res = groups.load_group([{"state": "ready", "object_id": "mem:s0", "sha256": enc.sha256,
                              "byte_count": enc.byte_count}], t, max_decoded_bytes=1 << 20)
    assert [(e.index, e.check) for e in res.errors] == [(0, "byte_count")]
    assert t.asked["mem:g1/prompt"] <= fmt.encoded_size_bound(1 << 20) + 1


# ------------------------------------------------------------------ GroupCollector (generate "n" > 1)


def _collect(samples, indices, store, withdraw=(), size=None):
    """Run a collector: every index in ``withdraw`` withdraws, the others submit (in reverse order)."""
    async def go():
        c = groups.GroupCollector("g9", size or len(samples), indices, store)
        for k in withdraw:
            c.withdraw(k)
        subs = [k for k in indices if k not in withdraw]
        got = await asyncio.gather(*(c.submit(k, samples[k]) for k in reversed(subs)))
        return c, dict(zip(reversed(subs), got, strict=True))
    return asyncio.run(go())


def _store_into(objs, calls, fail=None):
    async def store(inp, leader):
        calls.append(leader)
        if fail == "raise":
            raise RuntimeError("target bug")
        if fail:
            return {"state": "failed", "error_code": fail}
        enc = fmt.encode(inp)
        objs["mem:g9/prompt"] = enc.data
        return {"state": "ready", "object_id": "mem:g9/prompt", "sha256": enc.sha256, "byte_count": enc.byte_count}
    return store


def test_collector_stores_the_prompt_part_once_and_samples_join_exactly():
    samples, _, _ = build(mismatch_sample=2)
    objs, calls = {}, []
    c, slots = _collect(samples, [0, 1, 2, 3], _store_into(objs, calls))
    assert calls == [0]  # once, by the lowest sample
    for k, slot in slots.items():
        g = slot.receipt_group
        assert g["prompt_part"]["object_id"] == "mem:g9/prompt" and g["index"] == k and g["size"] == 4
        assert g["prompt_row_mismatches"] == (2 if k == 2 else 0)
        enc = fmt.encode(slot.input)
        objs[f"mem:s{k}"] = enc.data
    recs = [{"state": "ready", "object_id": f"mem:s{k}", "sha256": hashlib.sha256(objs[f"mem:s{k}"]).hexdigest(),
             "byte_count": len(objs[f"mem:s{k}"])} for k in range(4)]
    res = groups.load_group(recs, MemTarget(objs))
    assert not res.errors
    for k in range(4):
        assert np.array_equal(res.items[k].rows, ld.Routes.of(fmt.decode(fmt.encode(samples[k]).data)).rows)


def test_collector_a_withdrawn_sample_does_not_block_or_lose_the_others():
    samples, _, _ = build()
    objs, calls = {}, []
    c, slots = _collect(samples, [0, 1, 2, 3], _store_into(objs, calls), withdraw=[0, 2])
    assert sorted(slots) == [1, 3] and calls == [1]  # first wins among the samples that finished: sample 1
    assert [slots[k].receipt_group["index"] for k in (1, 3)] == [1, 3]
    hdr = fmt.decode(fmt.encode(slots[3].input).data).manifest["header"]["group"]
    assert (hdr["index"], hdr["size"]) == (3, 4)


@pytest.mark.parametrize("fail", ["object_exists", "delivery_failed", "raise"])
def test_collector_prompt_part_not_stored_every_sample_stored_whole_and_says_so(fail):
    samples, _, _ = build()
    objs, calls = {}, []
    c, slots = _collect(samples, [0, 1, 2, 3], _store_into(objs, calls, fail))
    for k, slot in slots.items():
        g = slot.receipt_group
        assert "prompt_part" not in g and g["not_shared"].startswith("prompt_part_" if fail != "raise" else "prompt_part_internal")
        art = fmt.decode(fmt.encode(slot.input).data)  # the full, non-deduplicated rows
        assert np.array_equal(ld.Routes.of(art).rows, ld.Routes.of(fmt.decode(fmt.encode(samples[k]).data)).rows)
        assert "prompt_part" not in art.manifest["header"]["group"]
    # a whole sample loads as itself through load_group (no prompt part to fetch)
    enc = fmt.encode(slots[1].input)
    res = groups.load_group([{"state": "ready", "object_id": "mem:w1", "sha256": enc.sha256,
                              "byte_count": enc.byte_count}], MemTarget({"mem:w1": enc.data}))
    assert not res.errors and res.items[0].rows.shape[0] == len(samples[1].token_ids) - 1


def test_collector_no_routes_content_stores_whole_without_a_prompt_part():
    samples, _, _ = build()
    plain = [fmt.ArtifactInput(x.token_ids, x.prompt_token_count, ["selected_logprobs"],
                               {"selected_logprobs": x.sections["selected_logprobs"]}, [x.tensors[1]]) for x in samples]
    calls = []
    c, slots = _collect(plain, [0, 1], _store_into({}, calls), size=2)
    assert calls == [] and all(s.receipt_group["not_shared"].startswith("not_shareable") for s in slots.values())


def test_collector_all_withdrawn_stores_nothing():
    calls = []

    async def go():
        c = groups.GroupCollector("g9", 2, [0, 1], _store_into({}, calls))
        c.withdraw(0)
        c.withdraw(1)
        c.withdraw(1)  # idempotent
        return c
    asyncio.run(go())
    assert calls == []


def test_group_object_keys_and_presigned_refusal():
    from genartifact.engine.job import group_object_target, sample_spec
    from genartifact.errors import RequestSpecError

    t = {"kind": "managed_fsspec", "profile": "p", "object_key": "runs/r/00003.gart"}
    assert group_object_target(t, "s002")["object_key"] == "runs/r/00003.s002.gart"
    assert group_object_target(t, "prompt-abc")["object_key"] == "runs/r/00003.prompt-abc.gart"
    assert group_object_target({**t, "object_key": "runs/r.x/noext"}, "s000")["object_key"] == "runs/r.x/noext.s000"
    spec = {"format": "generation_artifact_v1", "delivery": {"mode": "object_store", "target": t}}
    assert sample_spec(spec, 7)["delivery"]["target"]["object_key"] == "runs/r/00003.s007.gart"
    assert spec["delivery"]["target"]["object_key"] == "runs/r/00003.gart"  # not mutated
    with pytest.raises(RequestSpecError, match="object_key"):
        group_object_target({"kind": "http_put", "url": "https://h/x?X-Amz-Signature=s"}, "s000")


def test_read_receipts_keys_group_samples(tmp_path):
    from genartifact.engine.job import read_receipts

    f = tmp_path / "r.jsonl"
    f.write_text('{"index": 0, "state": "ready"}\n{"index": 1, "sample": 0, "state": "ready"}\n'
                 '{"index": 1, "sample": 1, "state": "failed"}\n{"index": 1, "sample": 1, "state": "ready"}\n')
    got = read_receipts(f)
    assert set(got) == {0, (1, 0), (1, 1)} and got[(1, 1)]["state"] == "ready"


def test_vouchers_include_referenced_prompt_parts():
    from genartifact.journal import vouchers

    r = {"state": "ready", "object_id": "p:s0", "sha256": "a" * 64,
         "group": {"prompt_part": {"object_id": "p:pp", "sha256": "b" * 64, "byte_count": 3}}}
    v = vouchers([], [r, {**r, "state": "failed", "group": {"prompt_part": {"object_id": "p:x", "sha256": "c" * 64}}}])
    assert v == {"p:s0": {"a" * 64}, "p:pp": {"b" * 64}}


@pytest.mark.parametrize("mismatch_sample", [None, 1])
def test_route_weights_are_deduplicated_with_the_routes(mismatch_sample):
    """moe_route_weights rows are aligned 1:1 with moe_routes rows: they go to the prompt part with them, a row
    whose weights differ stays with its sample, and join returns the full weights (real readers validate)."""
    pytest.importorskip("genartifact_route_weights")
    samples, _, _ = build(mismatch_sample=-1)
    rng = np.random.default_rng(5)
    shared_w = rng.random((R, P - 1, K)).astype(np.float32)
    with_w = []
    for k, x in enumerate(samples):
        pw = shared_w.copy()
        if k == mismatch_sample:
            pw[0, 6] += 0.25  # only the weights of position 6 differ (same expert ids)
        w = np.concatenate([pw, rng.random((R, C, K)).astype(np.float32)], axis=1)
        sec = {"token_start": 0, "router_ids": [0, 2, 5], "top_k": K, "dtype": "f32", "layout": "router_major",
               "router_scale": [1.0] * R, "output_scale": [1.0] * R}
        with_w.append(fmt.ArtifactInput(x.token_ids, x.prompt_token_count, sorted([*x.contents, "moe_route_weights"]),
                                        {**x.sections, "moe_route_weights": sec},
                                        [*x.tensors, fmt.TensorPart(groups.WEIGHTS, w)]))
    part = fmt.encode(groups.prompt_part(with_w, "gw"))
    objs = {"mem:gw/p": part.data}
    rec = {"object_id": "mem:gw/p", "sha256": part.sha256, "byte_count": part.byte_count}
    recs = []
    for k, sp in enumerate(groups.sample_parts(with_w, "gw", rec)):
        assert sp.prompt_row_mismatches == (1 if k == mismatch_sample else 0)
        assert sp.token_start == (6 if k == mismatch_sample else P - 1)
        enc = fmt.encode(sp.input)  # the weights reader checks alignment with moe_routes
        objs[f"mem:w{k}"] = enc.data
        recs.append({"state": "ready", "object_id": f"mem:w{k}", "sha256": enc.sha256, "byte_count": enc.byte_count})
    res = groups.load_group(recs, MemTarget(objs))
    assert not res.errors, res.errors
    for k, x in enumerate(with_w):
        full = ld.Routes.of(fmt.decode(fmt.encode(x).data))
        assert np.array_equal(res.items[k].rows, full.rows)
        np.testing.assert_array_equal(res.items[k].weights, full.weights)
