"""genartifact.loaders: golden layouts on a hand-built artifact, verification checks, batches, stitching."""

from __future__ import annotations

import asyncio
import hashlib

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact import loaders as ld

# Hand-built sequence: P=3 prompt + C=2 completion tokens, routes captured from token_start=1, routers at decoder
# layers 1 and 3 (layers 0 and 2 dense), 8 experts each, top-2. Rows (token-major) = positions 1, 2, 3.
TOKENS = [11, 12, 13, 14, 15]
P, START = 3, 1
ROWS = np.array([
    [[1, 2], [3, 4]],   # position 1: router@1, router@3
    [[5, 6], [7, 0]],   # position 2
    [[2, 1], [4, 3]],   # position 3 (the last sampled token, position 4, is never fed: no row)
], np.uint8)


def make(tokens=TOKENS, p=P, start=START, rows=ROWS, router_ids=(1, 3), experts=8, logprobs=True):
    c = len(tokens) - p
    contents = ["moe_routes"] + (["selected_logprobs"] if logprobs else [])
    sections = {"moe_routes": {"token_start": start, "router_ids": list(router_ids),
                               "expert_counts": [experts] * len(router_ids), "top_k": int(rows.shape[2]),
                               "layout": "router_major", "source": "test"}}
    tensors = [fmt.TensorPart("moe_routes.expert_ids", np.ascontiguousarray(rows.transpose(1, 0, 2)))]
    if logprobs:
        sections["selected_logprobs"] = {"token_start": p}
        tensors.append(fmt.TensorPart("selected_logprobs.logprobs", -np.arange(1, c + 1, dtype=np.float32)))
    return fmt.encode(fmt.ArtifactInput(np.array(tokens, np.uint32), p, contents, sections, tensors))


def receipt(enc, oid="mem:a"):
    return {"format": fmt.FORMAT_NAME, "contents": ["moe_routes", "selected_logprobs"], "state": "ready",
            "byte_count": enc.byte_count, "sha256": enc.sha256, "object_id": oid}


class MemTarget:
    """Read-back over a dict; records concurrency and the max_bytes asked for."""

    def __init__(self, objects, delay=0.0):
        self.objects, self.delay, self.active, self.peak, self.asked = dict(objects), delay, 0, 0, []

    async def open(self, object_id, max_bytes):
        self.asked.append(max_bytes)
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            await asyncio.sleep(self.delay)
            if object_id not in self.objects:
                raise FileNotFoundError(object_id)
            data = self.objects[object_id]
            if len(data) > max_bytes:
                raise OSError("too large")
            return data
        finally:
            self.active -= 1


@pytest.fixture
def art():
    return fmt.decode(make().data)


# ------------------------------------------------------------------------------------ golden layouts


def test_verl_golden(art):
    out = ld.verl(art, padded_prompt_len=5, total_len=8)
    z = [[0, 0], [0, 0]]
    expect = np.array([[z, z, z,  # left padding (2) + position 0 (before token_start)
                        [[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 1], [4, 3]],
                        z, z]], np.int16)  # last sampled token (never fed) + right padding
    assert out.dtype == np.int16 and out.shape == (1, 8, 2, 2)
    assert np.array_equal(out, expect)


def test_verl_all_layers_and_torch(art):
    out = ld.verl(art, padded_prompt_len=3, total_len=5, num_layers=4, backend="torch")
    import torch

    assert out.dtype == torch.int16 and tuple(out.shape) == (1, 5, 4, 2)
    a = out.numpy()
    assert np.array_equal(a[0, 1:4, 1], ROWS[:, 0]) and np.array_equal(a[0, 1:4, 3], ROWS[:, 1])
    assert not a[0, :, [0, 2]].any() and not a[0, [0, 4]].any()


def test_verl_bounds(art):
    with pytest.raises(ld.LayoutError, match="padded_prompt_len"):
        ld.verl(art, padded_prompt_len=2, total_len=8)
    with pytest.raises(ld.LayoutError, match="total_len"):
        ld.verl(art, padded_prompt_len=5, total_len=6)  # needs >= 5 + C = 7
    with pytest.raises(ld.LayoutError, match="num_layers"):
        ld.verl(art, padded_prompt_len=5, total_len=7, num_layers=3)
    with pytest.raises(ld.LayoutError, match="backend"):
        ld.verl(art, padded_prompt_len=5, total_len=7, backend="jax")


def test_slime_golden(art):
    out = ld.slime(art)
    assert out.dtype == np.int32 and out.shape == (3, 2, 2)  # [T - 1 - start, L, k]
    assert np.array_equal(out, ROWS.astype(np.int32))
    full = ld.slime(fmt.decode(make(start=0, rows=np.concatenate([ROWS[:1], ROWS])).data), num_layers=4)
    assert full.shape == (len(TOKENS) - 1, 4, 2)  # [len(tokens) - 1, L, k]
    assert not full[:, [0, 2]].any()


def test_slime_rejects_all_zero_moe_layer():
    rows = ROWS.copy()
    rows[:, 1] = 0
    with pytest.raises(ld.LayoutError, match="MoE layer 3 is all zero"):
        ld.slime(fmt.decode(make(rows=rows).data))


def test_nemo_rl_golden(art):
    out = ld.nemo_rl(art)
    m = [[-1, -1], [-1, -1]]
    expect = np.array([m, [[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 1], [4, 3]]], np.int32)
    assert out.dtype == np.int32 and np.array_equal(out, expect)
    longer = ld.nemo_rl(art, length=6, num_layers=4)
    assert longer.shape == (6, 4, 2) and (longer[4:] == -1).all() and (longer[:, [0, 2]] == -1).all()
    assert np.array_equal(longer[1:4, [1, 3]], ROWS.astype(np.int32))
    with pytest.raises(ld.LayoutError, match="length"):
        ld.nemo_rl(art, length=3)


def test_raw_golden(art):
    r = ld.raw(art)
    assert (r.shape, r.dtype, r.token_start) == ((3, 2, 2), "uint8", 1)
    assert r.data == bytes([1, 2, 3, 4, 5, 6, 7, 0, 2, 1, 4, 3])
    assert np.array_equal(r.array(), ROWS)
    wide = ld.raw(fmt.decode(make(rows=ROWS.astype(np.uint16) * 100, experts=1000).data))
    assert wide.dtype == "uint16" and wide.data[:4] == (100).to_bytes(2, "little") + (200).to_bytes(2, "little")


def test_packed_golden(art):
    other = fmt.decode(make(tokens=[21, 22, 23], p=2, start=0, rows=ROWS[:2]).data)
    pk = ld.packed([art, other])
    assert pk.cu_seqlens.dtype == np.int32 and pk.cu_seqlens.tolist() == [0, 5, 8]
    assert pk.token_ids.tolist() == TOKENS + [21, 22, 23] and pk.prompt_token_counts.tolist() == [3, 2]
    m = [[-1, -1], [-1, -1]]
    expect = np.array([m, *ROWS.tolist(), m,  # seq 0: position 0 not captured, last token never fed
                       *ROWS[:2].tolist(), m], np.int32)
    assert pk.routes.dtype == np.int32 and np.array_equal(pk.routes, expect)
    with pytest.raises(ld.LayoutError, match="differ"):
        ld.packed([art, fmt.decode(make(router_ids=(1, 2)).data)])
    with pytest.raises(ld.LayoutError, match="at least one"):
        ld.packed([])


def test_layouts_need_routes():
    enc = fmt.encode(fmt.ArtifactInput(np.array([1, 2], np.uint32), 1, ["selected_logprobs"],
                                       {"selected_logprobs": {"token_start": 1}},
                                       [fmt.TensorPart("selected_logprobs.logprobs", np.array([-1.0], np.float32))]))
    with pytest.raises(ld.LayoutError, match="no moe_routes"):
        ld.slime(fmt.decode(enc.data))


# ------------------------------------------------------------------------------------ verification


def test_fetch_verifies_receipt():
    enc = make()
    t = MemTarget({"mem:a": enc.data})
    art = asyncio.run(ld.fetch(t, receipt(enc)))
    assert art.sha256 == enc.sha256 and t.asked == [enc.byte_count + 1]
    assert asyncio.run(ld.fetch(t, "mem:a")).token_ids.tolist() == TOKENS  # bare id: strict decode only


@pytest.mark.parametrize("mutate, check", [
    (lambda d: d + b"\x00", "byte_count"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "sha256"),
])
def test_fetch_names_the_failed_check(mutate, check):
    enc = make()
    t = MemTarget({"mem:a": mutate(enc.data)})
    with pytest.raises(ld.LoadError) as ei:
        asyncio.run(ld.fetch(t, receipt(enc)))
    assert ei.value.check == check and ei.value.object_id == "mem:a"


def test_fetch_decode_failure_with_matching_digest():
    bad = b"GENART\x00\x01" + b"\x00" * 20
    r = {"state": "ready", "object_id": "mem:b", "byte_count": len(bad), "sha256": hashlib.sha256(bad).hexdigest()}
    with pytest.raises(ld.LoadError) as ei:
        asyncio.run(ld.fetch(MemTarget({"mem:b": bad}), r))
    assert ei.value.check == "decode" and "major version" in str(ei.value)


@pytest.mark.parametrize("item, msg", [
    ({"state": "failed", "error_code": "timeout", "object_id": None}, "only 'ready'"),
    ({"state": "ready", "object_id": "x", "byte_count": -1, "sha256": "0" * 64}, "byte_count"),
    ({"state": "ready", "object_id": "x", "byte_count": 1, "sha256": "XYZ"}, "sha256"),
    ({"state": "ready", "byte_count": 1, "sha256": "0" * 64}, "object_id"),
    (42, "receipt dict"),
])
def test_bad_receipts(item, msg):
    with pytest.raises(ld.LoadError, match=msg) as ei:
        ld.ref_of(item)
    assert ei.value.check == "receipt"


# ------------------------------------------------------------------------------------ batches


def test_batch_keeps_order_reports_each_error_and_bounds():
    encs = [make(tokens=[11, 12, 13, 14, 15 + i]) for i in range(40)]
    objs = {f"mem:{i}": e.data for i, e in enumerate(encs)}
    objs["mem:7"] = objs["mem:7"][:-1] + b"\x00"  # corrupted in storage
    del objs["mem:9"]  # lost
    items = [receipt(e, f"mem:{i}") for i, e in enumerate(encs)]
    items[3] = {"state": "failed", "error_code": "timeout"}
    t = MemTarget(objs, delay=0.001)
    size = encs[0].byte_count
    res = ld.load_batch(items, t, layout="slime", max_concurrency=4, max_bytes_in_flight=3 * size)
    assert [(e.index, e.check) for e in res.errors] == [(3, "receipt"), (7, "sha256"), (9, "fetch")]
    assert "item 9 (mem:9): fetch: read failed (FileNotFoundError)" == str(res.errors[2])
    assert t.peak <= 3 and res.peak_bytes_in_flight <= 3 * size
    good = [i for i in range(40) if i not in (3, 7, 9)]
    assert all(res.items[i] is None for i in (3, 7, 9))
    for i in good:
        assert res.items[i].dtype == np.int32 and np.array_equal(res.items[i], ROWS.astype(np.int32))
    assert res.bytes_fetched == sum(len(objs[f"mem:{i}"]) for i in good) + len(objs["mem:7"])
    with pytest.raises(ld.LoadError, match=r"and 2 more"):
        res.raise_errors()


def test_batch_layout_kwargs_and_layout_errors():
    encs = [make(), make(tokens=[1, 2, 3, 4, 5, 6, 7], rows=np.concatenate([ROWS, ROWS[:2]]))]
    t = MemTarget({"a": encs[0].data, "b": encs[1].data})
    res = ld.load_batch([receipt(encs[0], "a"), receipt(encs[1], "b")], t, layout="verl",
                        padded_prompt_len=4, total_len=6)
    assert res.items[0].shape == (1, 6, 2, 2) and res.items[1] is None
    assert res.errors[0].check == "layout" and "total_len" in str(res.errors[0])
    with pytest.raises(ld.LayoutError, match="allowed"):
        ld.load_batch([], t, layout="megatron")


def test_batch_progress_bar(capsys):
    enc = make()
    res = ld.load_batch([receipt(enc)] * 3, MemTarget({"mem:a": enc.data}), progress=True)
    assert res.ok and len(res.items) == 3 and "3/3" in capsys.readouterr().err


def test_load_batch_refuses_running_loop():
    async def inner():
        with pytest.raises(RuntimeError, match="aload_batch"):
            ld.load_batch([], MemTarget({}))
    asyncio.run(inner())


# ------------------------------------------------------------------------------------ multi-turn


def test_stitch_turns_golden_and_validation():
    # full sequence 0..6, turn 0 = tokens[:5] (P=3), turn 1 = tokens[:7] (P=6) with start = 5 - 1 = 4
    full_rows = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2) % 8
    t0 = fmt.decode(make(tokens=[1, 2, 3, 4, 5], p=3, start=0, rows=full_rows[:4]).data)
    t1 = fmt.decode(make(tokens=[1, 2, 3, 4, 5, 6, 7], p=6, start=4, rows=full_rows[4:]).data)
    s = ld.stitch_turns([t0, t1])
    assert s.token_ids.tolist() == [1, 2, 3, 4, 5, 6, 7] and s.prompt_token_count == 3 and s.token_start == 0
    assert np.array_equal(s.rows, full_rows)
    assert np.array_equal(ld.slime(s), full_rows.astype(np.int32))
    bad_start = fmt.decode(make(tokens=[1, 2, 3, 4, 5, 6, 7], p=6, start=5, rows=full_rows[5:]).data)
    with pytest.raises(ld.LayoutError, match="turn 1: token_start 5"):
        ld.stitch_turns([t0, bad_start])
    other = fmt.decode(make(tokens=[1, 2, 9, 4, 5, 6, 7], p=6, start=4, rows=full_rows[4:]).data)
    with pytest.raises(ld.LayoutError, match="do not extend"):
        ld.stitch_turns([t0, other])


# ------------------------------------------------------------------------------------ decode: parallel digest


def big_artifact() -> bytes:
    rng = np.random.default_rng(3)
    rows = rng.integers(0, 8, (2, 600_000, 2)).astype(np.uint8)  # incompressible enough to exceed 1 MiB stored
    enc = fmt.encode(fmt.ArtifactInput(
        np.arange(600_001, dtype=np.uint32), 600_000, ["moe_routes"],
        {"moe_routes": {"token_start": 0, "router_ids": [0, 1], "expert_counts": [8, 8], "top_k": 2,
                        "layout": "router_major", "source": "test"}}, [fmt.TensorPart("moe_routes.expert_ids", rows)]))
    assert enc.byte_count >= 1 << 20
    return enc.data


@pytest.fixture
def parallel_hash(monkeypatch):
    monkeypatch.setattr(fmt, "PARALLEL_HASH_BYTES", 1 << 20)  # on any machine, whatever its core count


def test_large_objects_hashed_in_a_helper_thread_match_hashlib(parallel_hash):
    data = big_artifact()
    art = fmt.decode(data)
    assert art.sha256 == hashlib.sha256(data).hexdigest() and fmt._HASH_POOL is not None
    bad = data[:-1] + bytes([data[-1] ^ 1])  # a different object: a different digest (or a format error)
    try:
        assert fmt.decode(bad).sha256 != art.sha256
    except fmt.ArtifactFormatError:
        pass


def test_forked_child_gets_a_fresh_hash_pool(parallel_hash):
    import os

    data = big_artifact()
    fmt.decode(data)  # the parent's pool has threads now
    pid = os.fork()
    if pid == 0:  # child: the inherited pool has no threads; decode must not hang
        code = 0 if fmt._HASH_POOL is None and fmt.decode(data).sha256 == hashlib.sha256(data).hexdigest() else 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_batch_layout_argument_errors_raise_before_any_fetch():
    enc = make()
    t = MemTarget({"mem:a": enc.data})
    with pytest.raises(ld.LayoutError, match="padded_prompt_len"):
        ld.load_batch([receipt(enc)] * 2, t, layout="verl")
    with pytest.raises(ld.LayoutError, match=r"unexpected keyword argument 'lenght'.*'length'"):
        ld.load_batch([receipt(enc)], t, layout="nemo_rl", lenght=9)
    assert t.asked == []


def test_batch_callable_layout_failure_fails_only_that_item():
    encs = [make(), make(tokens=[11, 12, 13, 14, 16])]
    t = MemTarget({"a": encs[0].data, "b": encs[1].data})

    def picky(art):
        if art.token_ids[-1] == 16:
            raise KeyError("boom")
        return art.token_ids

    res = ld.load_batch([receipt(encs[0], "a"), receipt(encs[1], "b")], t, layout=picky)
    assert res.items[0] is not None and res.items[1] is None
    assert [(e.index, e.check) for e in res.errors] == [(1, "layout")]
    assert "layout function raised KeyError" in str(res.errors[0])


@pytest.mark.parametrize("kw", [{"max_decoded_bytes": 0}, {"max_decoded_bytes": -1}, {"max_decoded_bytes": "1"},
                                {"max_concurrency": "4"}, {"max_bytes_in_flight": 1.5}, {"max_decodes": True}])
def test_batch_bounds_are_checked_up_front(kw):
    enc = make()
    t = MemTarget({"mem:a": enc.data})
    with pytest.raises(ValueError, match=next(iter(kw))):
        ld.load_batch([receipt(enc)], t, **kw)
    assert t.asked == []
    if "max_decoded_bytes" in kw:
        with pytest.raises(ValueError, match="max_decoded_bytes"):
            ld.fetch_sync(t, receipt(enc), **kw)


def test_layout_arguments_are_layout_errors_not_allocations_or_numpy_errors(art):
    with pytest.raises(ld.LayoutError, match="num_layers"):
        ld.verl(art, padded_prompt_len=3, total_len=5, num_layers=2**40)  # was a 16 TiB allocation attempt
    with pytest.raises(ld.LayoutError, match="num_layers"):
        ld.packed([art], num_layers=2**40)
    for fill in ("x", 2**40, 1.5):
        with pytest.raises(ld.LayoutError, match="fill"):
            ld.packed([art], fill=fill)  # were ValueError / OverflowError from numpy
    with pytest.raises(ld.LayoutError, match="got NoneType"):
        ld.stitch_turns([art, None])  # was AttributeError
    assert ld.verl(art, padded_prompt_len=3, total_len=5, num_layers=np.int64(4)).shape[2] == 4
