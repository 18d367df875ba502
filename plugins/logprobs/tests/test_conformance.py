"""selected_logprobs against the kit's content conformance suite: worker source (values fetched from a
FakeEngine worker) and engine source (vLLM-reported logprobs in the deltas; asks for ``logprobs=0``)."""

from __future__ import annotations

import numpy as np
import pytest
from genartifact.testing import FakeEngine
from genartifact.testing.conformance import ContentConformance
from genartifact_logprobs.answer import worker_answer


def values(completion):
    return [-0.25 * (i + 1) for i in range(len(completion))]


class TestWorkerSourceConformance(ContentConformance):
    content = "selected_logprobs"
    capture_key = "genartifact_logprobs_id"

    def engine(self, prompt, completion):
        def fetch(capture_id):
            p = len(prompt)
            return worker_answer(list(range(p, p + len(completion))), list(completion), values(completion))

        return FakeEngine({"selected_logprobs.fetch": fetch, "selected_logprobs.discard": lambda cid: True})

    def test_values_round_trip(self):
        res = self.session()
        assert np.allclose(res.artifact.content("selected_logprobs"), values(self.completion))


class TestEngineSourceConformance(ContentConformance):
    content = "selected_logprobs"
    logprobs = (-0.5, -1.5, float("-inf"), -0.1)
    changes_sampling = True  # asks vLLM for logprobs=0 (the sampled token only)

    @pytest.fixture(autouse=True)
    def _engine_source(self, monkeypatch):
        monkeypatch.setenv("GENARTIFACT_LOGPROBS_SOURCE", "engine")

    def test_asks_for_the_sampled_token_only(self):
        res = self.session()
        assert res.sampling["logprobs"] == 0
        assert res.artifact.content("selected_logprobs").tolist() == list(self.logprobs[:3])
