"""`generate` with ``"n": K`` (GRPO groups, issue 11 §4) on the real vLLM-CPU engine and the real fsspec store:
each sample's joined rows equal the same sample run as a non-grouped request with the same seed; the group
stores fewer bytes; verify / reconcile / --resume handle the prompt part."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact import groups
from genartifact import loaders as ld

N, SEED, MAX_TOKENS = 4, 11, 12
# a long, non-repetitive prompt (hundreds of tokens): its route rows dominate each sample, as in GRPO
PROMPT = " ".join(str(i * 7919 % 10007) for i in range(160))


def _cfg(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[plugins]\ncontents = ["moe_routes", "selected_logprobs"]\ntargets = ["managed_fsspec"]\n'
                   f'[targets.managed_fsspec.profiles.local]\nurl = "{tmp_path}/store"\nallowed_prefixes = ["runs/"]\n'
                   f'[journal]\npath = "{tmp_path}/journal.jsonl"\n')
    return cfg


def _generate(model, cfg, prompts, out, *extra):
    # per-request seeds need chunked prefill off on vLLM-CPU 0.32 (vllm_adapter.prepare refuses them otherwise)
    return subprocess.run([sys.executable, "-m", "genartifact.cli", "generate", "--model", str(model), "--config",
                           str(cfg), "--prompts", str(prompts), "--out", str(out), "--run-id", "grp",
                           "--no-enable-chunked-prefill", *extra],
                          capture_output=True, text=True, cwd=cfg.parent, timeout=500)


def _receipts(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def _target(tmp_path):
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles

    return ManagedFsspecTarget(parse_profiles({"profiles": {"local": {"url": f"file://{tmp_path}/store",
                                                                      "allowed_prefixes": ["runs/"]}}}))


@pytest.mark.engine
def test_group_rows_equal_ungrouped_same_seed_and_store_less(qwen_model, tmp_path):
    cfg = _cfg(tmp_path)
    prompts = tmp_path / "p.jsonl"
    rows = [{"prompt": PROMPT, "n": N, "seed": SEED, "max_tokens": MAX_TOKENS}]
    rows += [{"prompt": PROMPT, "seed": SEED + k, "max_tokens": MAX_TOKENS} for k in range(N)]  # vLLM's n>1 rule
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "receipts.jsonl"
    r = _generate(qwen_model, cfg, prompts, out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"{2 * N}/{2 * N} artifacts ready" in r.stdout
    recs = _receipts(out)
    grouped = sorted((x for x in recs if x["index"] == 0), key=lambda x: x["sample"])
    plain = sorted((x for x in recs if x["index"] > 0), key=lambda x: x["index"])
    assert [x["sample"] for x in grouped] == list(range(N)) and all(x["state"] == "ready" for x in recs)
    gid = grouped[0]["group"]["id"]
    pp = grouped[0]["group"]["prompt_part"]
    for k, x in enumerate(grouped):
        g = x["group"]
        assert (g["id"], g["index"], g["size"]) == (gid, k, N) and g["prompt_part"] == pp
        assert x["object_id"] == f"local:runs/grp/00000.s{k:03d}.gart"  # row key + sample index
        assert g["prompt_row_mismatches"] == 0 and g["route_token_start"] == x["prompt_tokens"] - 1
    assert pp["object_id"] == f"local:runs/grp/00000.prompt-{gid}.gart"
    store = tmp_path / "store"
    assert (store / "runs/grp" / f"00000.prompt-{gid}.gart").stat().st_size == pp["byte_count"]

    target = _target(tmp_path)
    joined = groups.load_group(grouped, target)
    assert not joined.errors, joined.errors
    ref = ld.load_batch(plain, target, layout="artifact")
    assert not ref.errors, ref.errors
    completions = set()
    for k in range(N):
        a, b = joined.items[k], ld.Routes.of(ref.items[k])
        # the same sample (seed + k) run alone: identical tokens and identical routes for every position
        assert np.array_equal(a.token_ids, b.token_ids), k
        assert a.token_start == b.token_start and a.router_ids == b.router_ids
        assert np.array_equal(a.rows, b.rows), k
        completions.add(tuple(a.token_ids[a.prompt_token_count:]))
        # every other content of the sample part is the non-grouped artifact's
        sa = fmt.decode((store / f"runs/grp/00000.s{k:03d}.gart").read_bytes())
        np.testing.assert_array_equal(sa.selected_logprobs(), ref.items[k].selected_logprobs())
    assert len(completions) > 1  # the seeds differ: real samples, not one sample four times
    grouped_bytes = pp["byte_count"] + sum(x["byte_count"] for x in grouped)
    plain_bytes = sum(x["byte_count"] for x in plain)
    assert grouped_bytes < plain_bytes, (grouped_bytes, plain_bytes)

    # verify checks each sample, its prompt part and the join; reconcile vouches for the prompt part
    v = subprocess.run([sys.executable, "-m", "genartifact.cli", "verify", "--config", str(cfg), "--receipts",
                        str(out)], capture_output=True, text=True, cwd=tmp_path)
    assert v.returncode == 0 and f"{2 * N}/{2 * N} receipts verified" in v.stdout, v.stdout + v.stderr
    rc = subprocess.run([sys.executable, "-m", "genartifact.cli", "reconcile", "--config", str(cfg), "--receipts",
                         str(out), "--older-than", "0", "--json"], capture_output=True, text=True, cwd=tmp_path)
    assert rc.returncode == 0, rc.stderr
    assert not [d for d in json.loads(rc.stdout)["deliveries"] if d["status"] == "orphan"]
    insp = subprocess.run([sys.executable, "-m", "genartifact.cli", "inspect", "--config", str(cfg),
                           "managed_fsspec:" + grouped[1]["object_id"]], capture_output=True, text=True, cwd=tmp_path)
    assert insp.returncode == 0, insp.stderr
    assert f"group: {gid} sample 1 of {N}; prompt part {pp['object_id']}" in insp.stdout, insp.stdout

    # --resume: a sample whose receipt is lost (and whose object is gone) runs again as a new group attempt
    # (its own prompt part); the others are left alone
    (store / "runs/grp/00000.s002.gart").unlink()
    out.write_text("".join(json.dumps(x) + "\n" for x in recs if not (x["index"] == 0 and x["sample"] == 2)))
    r2 = _generate(qwen_model, cfg, prompts, out, "--resume")
    assert r2.returncode == 0, r2.stderr[-3000:]
    after = _receipts(out)
    new = [x for x in after[len(recs) - 1:]]
    assert [(x["index"], x["sample"], x["state"]) for x in new] == [(0, 2, "ready")]
    g2 = new[0]["group"]
    assert g2["id"] != gid and g2["size"] == N and g2["prompt_part"]["object_id"] != pp["object_id"]
    again = groups.load_group([x for x in after if x["index"] == 0], target)
    assert not again.errors and np.array_equal(again.items[-1].rows, joined.items[2].rows)


# ------------------------------------------------------------ faults, on the shared engine (no seeds: chunked prefill)


def _row(n=3):
    return {"prompt": PROMPT, "n": n, "max_tokens": 6}


def _spec(key):
    return {"format": "generation_artifact_v1", "contents": ["moe_routes", "selected_logprobs"], "codec": "zstd",
            "delivery": {"mode": "object_store", "target": {"kind": "managed_fsspec", "profile": "t",
                                                            "object_key": key}}}


def _settings(root):
    return {"managed_fsspec": {"profiles": {"t": {"url": f"file://{root}", "allowed_prefixes": ["runs/"]}}}}


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="session")
async def test_prompt_part_not_stored_every_sample_stored_whole(engine, tmp_path, monkeypatch):
    from genartifact.engine.job import run_group
    from genartifact.session import ArtifactSession, failed_receipt

    async def refused(self, inp, target_spec):
        return failed_receipt(self.request, "object_exists")

    monkeypatch.setattr(ArtifactSession, "deliver_extra", refused)
    seen = []
    recs = await run_group(engine, 5, _row(), _spec("runs/g/00005.gart"), _settings(tmp_path), None, 6, [0, 1, 2],
                           on_receipt=seen.append)
    assert sorted(seen, key=lambda r: r["sample"]) == recs  # each emitted as it ended
    assert [(r["index"], r["sample"], r["state"]) for r in recs] == [(5, k, "ready") for k in range(3)]
    for r in recs:  # no sample references a prompt part that is not stored; each holds its full rows
        assert "prompt_part" not in r["group"] and r["group"]["not_shared"] == "prompt_part_object_exists"
        art = fmt.decode((tmp_path / r["object_id"].split(":", 1)[1]).read_bytes())
        assert art.routes().shape[0] == art.token_ids.shape[0] - 1
    assert not list((tmp_path / "runs/g").glob("*prompt*"))


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="session")
async def test_one_sample_failing_keeps_the_others(engine, tmp_path, monkeypatch):
    from genartifact.engine.job import run_group

    real = type(engine).execute
    calls = {"n": 0}

    def flaky(self, prep, stream=True, request_id=None):
        calls["n"] += 1
        if calls["n"] == 2:  # the second sample's request breaks before it reaches the engine
            raise RuntimeError("engine bug")
        return real(self, prep, stream, request_id)

    monkeypatch.setattr(type(engine), "execute", flaky)
    recs = await asyncio.wait_for(run_group(engine, 1, _row(), _spec("runs/f/00001.gart"), _settings(tmp_path), None,
                                            6, [0, 1, 2]), 120)
    assert [r["state"] for r in recs] == ["ready", "failed", "ready"]
    assert recs[1]["error_code"] == "engine_failed" and recs[1]["group"]["index"] == 1
    assert "RuntimeError" in recs[1]["error"]
    pp = recs[0]["group"]["prompt_part"]
    assert recs[2]["group"]["prompt_part"] == pp
    res = await groups.aload_group([recs[0], recs[2]], _target_t(tmp_path))
    assert not res.errors


@pytest.mark.engine
@pytest.mark.asyncio(loop_scope="session")
async def test_group_admission_counts_every_sample_before_any_runs(engine, tmp_path, monkeypatch):
    from genartifact.engine.job import run_group

    monkeypatch.setenv("GENARTIFACT_MAX_DECODED_BYTES", "9000")  # too small for one sample's worst case
    recs = await run_group(engine, 2, _row(4), _spec("runs/a/00002.gart"), _settings(tmp_path), None, 6, [0, 1, 2, 3])
    assert [(r["sample"], r["state"], r["error_code"]) for r in recs] == [(k, "rejected", "admission_rejected")
                                                                          for k in range(4)]
    assert not (tmp_path / "runs").exists()


def _target_t(root):
    from genartifact_fsspec_target import ManagedFsspecTarget, parse_profiles

    return ManagedFsspecTarget(parse_profiles({"profiles": {"t": {"url": f"file://{root}", "allowed_prefixes": ["runs/"]}}}))
