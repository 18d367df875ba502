"""GRPO group dedup: prompt part + sample parts join to exactly the non-deduplicated rows; mismatching prompt
rows stay with their sample; wrong references are refused."""

from __future__ import annotations

import asyncio

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
        {"moe_routes": {"token_start": start, "router_ids": [0, 2, 5], "expert_counts": [E] * R, "top_k": K,
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
