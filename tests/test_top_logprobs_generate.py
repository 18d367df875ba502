"""``top_logprobs`` through `genartifact generate` on the real engine (issue 11 §3: the content works in
`generate`, not only in the Python API and `serve`): a prompts row asks for ``"logprobs": k``; the artifact's top-k
rows are checked against what greedy decoding implies and against ``selected_logprobs`` of the same artifact, and
a row asking for the content without ``logprobs`` gets a ``rejected`` receipt while the others run.

Greedy (temperature 0) makes the sampled token the rank-1 token at every position, so column 0 of the stored
top-k ids must equal the completion tokens and column 0 of the logprobs must equal ``selected_logprobs`` (both
are vLLM's values under the same ``logprobs_mode``; the engine-vs-engine equality at any temperature is
``tests/test_trainer_e2e.py::test_top_logprobs_equal_the_engines_own_output``).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact import loaders as ld

pytestmark = [pytest.mark.engine]

CONFIG = """
[plugins]
contents = ["moe_routes", "selected_logprobs", "top_logprobs"]
targets = ["managed_fsspec"]

[targets.managed_fsspec.profiles.local]
url = "./store"
allowed_prefixes = ["runs/"]
"""


def test_generate_top_logprobs_rows(genartifact_generate, qwen_model):
    prompts = [{"prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 8, "temperature": 0,
                "logprobs": 5},
               {"prompt": "Once upon a time, in a small village", "max_tokens": 6, "temperature": 0, "logprobs": 1},
               {"prompt": "Numbers such as 1, 2, 3.", "max_tokens": 4, "temperature": 0},  # content without k
               {"prompt": "Science is patient work.", "max_tokens": 5, "temperature": 0,
                "contents": ["moe_routes", "selected_logprobs"]}]
    receipts, proc = genartifact_generate(qwen_model, prompts, CONFIG, "--target", "managed_fsspec:local",
                                          "--run-id", "tl")
    receipts.sort(key=lambda r: r["index"])
    assert [r["state"] for r in receipts] == ["ready", "ready", "rejected", "ready"], receipts
    assert receipts[2]["error_code"] == "admission_rejected" and "logprobs=k" in receipts[2]["error"], receipts[2]
    assert proc.returncode != 0  # a rejected row makes the run's exit status non-zero
    cwd = genartifact_generate.cwd
    v = subprocess.run([sys.executable, "-m", "genartifact.cli", "verify", "--config", "config.toml", "--receipts",
                        "receipts.jsonl"], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert v.returncode == 1 and "3/4 receipts verified" in v.stdout and "#2: rejected" in v.stdout, v.stdout + v.stderr
    for r, k in zip(receipts[:2], (5, 1), strict=True):
        assert r["contents"] == ["moe_routes", "selected_logprobs", "top_logprobs"]
        art = fmt.decode((cwd / "store" / r["object_id"].split(":", 1)[1]).read_bytes())
        ids, lps = ld.top_logprobs(art)
        c = art.completion_token_count
        assert ids.shape == (c, k) and lps.shape == (c, k) and ids.dtype == np.uint32 and lps.dtype == np.float32
        assert np.array_equal(ids[:, 0], art.token_ids[art.prompt_token_count:])  # greedy: sampled = rank 1
        assert np.array_equal(lps[:, 0], art.selected_logprobs())
        assert np.all(np.diff(lps, axis=1) <= 0) and np.all(lps <= 0)  # ranks by descending logprob
        assert all(len(set(row)) == k for row in ids.tolist())  # k distinct tokens per position
    plain = fmt.decode((cwd / "store" / receipts[3]["object_id"].split(":", 1)[1]).read_bytes())
    assert "top_logprobs" not in plain.contents
