"""The template's own suite: the kit's content conformance plus what is specific to timestamps."""

from __future__ import annotations

import numpy as np
import pytest
from genartifact.errors import ArtifactFormatError, CaptureError
from genartifact.testing import deltas, make_host, run_session
from genartifact.testing.conformance import ContentConformance


class TestTokenTimestampsConformance(ContentConformance):
    content = "token_timestamps"


def test_one_timestamp_per_token_from_arrival_ns():
    ds = deltas([1, 2], [5, 6, 7], start_ns=10**15, step_ns=2_000_000)
    res = run_session(make_host(contents=["token_timestamps"]), ["token_timestamps"], [1, 2], [5, 6, 7], deltas_=ds)
    ns = res.artifact.content("token_timestamps")
    assert ns.dtype == np.int64 and ns.shape == (3,)
    assert np.diff(ns).tolist() == [2_000_000, 2_000_000]
    assert res.artifact.summary()["token_timestamps"]["count"] == 3


def test_asks_for_per_step_deltas():
    res = run_session(make_host(contents=["token_timestamps"]), ["token_timestamps"], [1], [2])
    assert res.session.per_step_deltas is True


def test_missing_arrival_time_is_a_capture_error():
    from genartifact_token_timestamps import TokenTimestamps
    from genartifact.types import AdmissionContext, Delta, ModelInfo

    p = TokenTimestamps()
    p.admit(AdmissionContext(1, 2, 0, ModelInfo("m", {}), {}))
    with pytest.raises(CaptureError, match="arrival_ns"):
        p.on_delta(Delta([1], [2]))


def test_reader_rejects_decreasing_times():
    from genartifact_token_timestamps import READER, TENSOR

    m = {"completion_token_count": 2}
    sec = {"clock": "monotonic_ns", "origin": "admission"}
    READER.validate(m, sec, {TENSOR: np.array([1, 2], "<i8")})
    with pytest.raises(ArtifactFormatError, match="non-decreasing"):
        READER.validate(m, sec, {TENSOR: np.array([3, 2], "<i8")})
