"""top_logprobs against the kit's content conformance suite (k = 2; engine logprobs fed through the deltas)."""

from __future__ import annotations

from genartifact.testing.conformance import ContentConformance


def top2(position, token):
    """vLLM's per-position dict for k = 2 when the sampled token is itself the most likely: exactly k entries."""
    return {int(token): -0.1, int(token) + 1: -2.0 - position}


class TestTopLogprobsConformance(ContentConformance):
    content = "top_logprobs"
    sampling = {"temperature": 1.0, "logprobs": 2}
    logprobs = staticmethod(top2)

    def test_top_k_rows(self):
        res = self.session()
        ids, lps = res.artifact.content("top_logprobs")
        assert ids.shape == (len(self.completion), 2) and lps.shape == (len(self.completion), 2)
        assert ids[:, 0].tolist() == list(self.completion)
