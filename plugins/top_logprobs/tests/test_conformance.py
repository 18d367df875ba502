"""top_logprobs against the kit's content conformance suite (vLLM-shaped logprobs=k entries fed through deltas)."""

from __future__ import annotations

import numpy as np
from genartifact.testing import make_host, model_info, run_session
from genartifact.testing.conformance import ContentConformance

K = 3


def entries(i: int, tok: int) -> dict[int, float]:
    """vLLM's per-position mapping for logprobs=K: the sampled token first, then the top K by rank (the sampled
    token is outside the top K at odd positions, so those carry K + 1 entries)."""
    top = {100 + j: -0.1 * (j + 1) - i for j in range(K)}
    return {int(tok): -5.0 - i, **top} if i % 2 else {int(tok): -0.1 - i, **{t: v - 0.05 for t, v in top.items()
                                                                            if t != 100 + K - 1}}


class TestTopLogprobsConformance(ContentConformance):
    content = "top_logprobs"
    changes_sampling = True  # needs the request's logprobs=k (refused at admission without it)
    sampling = {"temperature": 1.0, "logprobs": K}
    logprobs = staticmethod(entries)

    def session(self, prompt=None, completion=None):
        p, c = list(prompt or self.prompt), list(completion or self.completion)
        return run_session(make_host(contents=[self.content]), [self.content], p, c, model=model_info(),
                           sampling={"temperature": 1.0, "logprobs": K}, logprobs=entries, per_step=self.per_step)

    def test_rank_order(self):
        res = self.session()
        ids, lps = res.artifact.content("top_logprobs")
        assert ids.shape == lps.shape == (len(self.completion), K)
        assert (np.diff(lps, axis=1) <= 0).all()
        assert ids[1].tolist() == [100, 101, 102]  # sampled token (rank > K) dropped
        assert int(self.completion[0]) in ids[0].tolist()  # sampled token inside the top K kept in rank order

    def test_retained_never_exceeds_admitted(self):
        # the kit's version admits with {"temperature": 1.0}; this content needs logprobs=k, otherwise the same
        from genartifact.session import ArtifactSession
        from genartifact.spec import parse_request
        from genartifact.testing import deltas

        spec = {"format": "generation_artifact_v1", "contents": [self.content], "codec": "zstd",
                "delivery": {"mode": "object_store", "target": {"kind": "memory", "object_key": "k"}}}
        s = ArtifactSession.for_request(self.make_host(), parse_request(spec), self.model(), {"memory": {}})
        params = {"temperature": 1.0, "logprobs": K}
        s.admit(len(self.prompt), len(self.completion), sampling=params)
        s.sampling_overrides(params)
        for d in deltas(self.prompt, self.completion, per_step=True, logprobs=entries):
            s.record(d)
            for p in s._producers:
                assert 0 < p.retained_bytes() <= p.admitted
        s.release()
