"""top_logprobs producer and reader without an engine (the real-engine equality test is in
tests/test_trainer_e2e.py)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from genartifact import format as fmt
from genartifact.errors import AdmissionError, ArtifactFormatError, CaptureError
from genartifact.types import AdmissionContext, Delta, FinalContext, ModelInfo
from genartifact_top_logprobs import TopLogprobs, validate

MODEL = ModelInfo("m", {})


def producer(k=2, max_tokens=4):
    p = TopLogprobs(MODEL)
    assert p.admit(AdmissionContext(3, max_tokens, 0, MODEL, {"logprobs": k})) == 8 * k * max_tokens + 128
    params = {"logprobs": k}
    p.sampling_overrides(params)
    assert params["logprobs"] == k
    return p


def test_rank_order_and_sampled_token_outside_top_k():
    p = producer(k=2)
    # vLLM order: sampled first, then top-k by rank; token 7 sampled at rank 3 (outside top-2) -> 3 entries
    p.on_delta(Delta([1, 2, 3], [7, 5], [{7: -3.0, 4: -0.5, 9: -1.0}, {5: -0.7, 6: -0.2}]))
    sec, tensors = p.finalize(FinalContext(3, 2))
    t = {x.name: x.array for x in tensors}
    assert sec == {"token_start": 3, "k": 2}
    assert t["top_logprobs.token_ids"].tolist() == [[4, 9], [6, 5]]
    assert np.array_equal(t["top_logprobs.logprobs"], np.array([[-0.5, -1.0], [-0.2, -0.7]], np.float32))
    assert p.retained_bytes() == 32
    p.release()
    assert p.retained_bytes() == 0


@pytest.mark.parametrize("k", [None, 0, 21, True])
def test_admission_needs_k(k):
    with pytest.raises(AdmissionError, match="logprobs=k"):
        TopLogprobs(MODEL).admit(AdmissionContext(3, 4, 0, MODEL, {"logprobs": k}))


def test_capture_errors():
    p = producer(k=2, max_tokens=1)
    with pytest.raises(CaptureError, match="entries"):
        p.on_delta(Delta([1], [7], [{7: -1.0}]))
    with pytest.raises(CaptureError, match="None logprob entries"):
        p.on_delta(Delta([1], [7], None))
    with pytest.raises(CaptureError, match="NaN|nan"):
        p.on_delta(Delta([1], [7], [{7: float("nan"), 8: -1.0}]))
    p = producer(k=1, max_tokens=1)
    p.on_delta(Delta([1], [7], [{7: -1.0}]))
    with pytest.raises(CaptureError, match="admitted"):
        p.on_delta(Delta([1], [8], [{8: -1.0}]))
    with pytest.raises(CaptureError, match="rows"):
        p.finalize(FinalContext(1, 2))
    assert asyncio.run(p.collect(FinalContext(1, 1))) is None


def encoded(ids, lps, p=2):
    c, k = ids.shape
    return fmt.decode(fmt.encode(fmt.ArtifactInput(
        np.arange(p + c, dtype=np.uint32), p, ["top_logprobs"], {"top_logprobs": {"token_start": p, "k": k}},
        [fmt.TensorPart("top_logprobs.token_ids", ids), fmt.TensorPart("top_logprobs.logprobs", lps)])).data)


def test_reader_validation():
    ids = np.array([[4, 9], [6, 5]], np.uint32)
    lps = np.array([[-0.5, -1.0], [-0.2, -np.inf]], np.float32)
    art = encoded(ids, lps)
    sec = art.manifest["sections"]["top_logprobs"]
    own = {k: v for k, v in art.tensors.items() if k.startswith("top_logprobs.")}
    validate(art.manifest, sec, own)  # -inf allowed
    with pytest.raises(ArtifactFormatError, match="descending"):
        validate(art.manifest, sec, {**own, "top_logprobs.logprobs": lps[:, ::-1].copy()})
    with pytest.raises(ArtifactFormatError, match="NaN"):
        validate(art.manifest, sec, {**own, "top_logprobs.logprobs": np.where(lps == -0.5, np.nan, lps).astype(np.float32)})
    with pytest.raises(ArtifactFormatError, match=r"\[2, 2\]"):
        validate(art.manifest, sec, {**own, "top_logprobs.token_ids": ids[:1]})
    with pytest.raises(ArtifactFormatError, match="k"):
        validate(art.manifest, {"token_start": 2, "k": 30}, own)
    with pytest.raises(ArtifactFormatError, match="section"):
        validate(art.manifest, {"token_start": 1, "k": 2}, own)
