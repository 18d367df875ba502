"""moe_route_weights against the kit's content conformance suite (worker rows served by a FakeEngine)."""

from __future__ import annotations

import numpy as np
from genartifact.testing import FakeEngine, make_host, model_info
from genartifact.testing.conformance import ContentConformance
from genartifact_route_weights import CAPTURE_KEY

ROUTERS, EXPERTS, TOP_K = 4, 8, 2  # genartifact.testing.TINY_MOE_CONFIG


def weights_for(prompt, completion):
    """Deterministic router weights for every forwarded position (router-major [routers, positions, top_k]),
    each row a normalised top-2 pair as Qwen3-MoE's norm_topk_prob router returns."""
    positions = len(prompt) + len(completion) - 1
    a = (np.arange(ROUTERS * positions, dtype=np.float32).reshape(ROUTERS, positions) % 7 + 1) / 8
    return np.stack([a, 1 - a], -1).astype(np.float32)


def fake_engine(full):
    def fetch(capture_id, start, end):
        d = np.ascontiguousarray(full[:, start:end])
        return {"shape": list(d.shape), "dtype": d.dtype.str, "data": d.tobytes(), "missing": None,
                "router_scale": [1.0] * ROUTERS, "output_scale": [2.5] * ROUTERS}

    return FakeEngine({"moe_route_weights.fetch": fetch, "moe_route_weights.discard": lambda cid: True})


class TestMoeRouteWeightsConformance(ContentConformance):
    content = "moe_route_weights"
    capture_key = CAPTURE_KEY

    def model(self):
        return model_info(worker_captures=["moe_routes", "moe_route_weights", "selected_logprobs"])

    def engine(self, prompt, completion):
        return fake_engine(weights_for(prompt, completion))

    def test_view_is_rows_routers_top_k_f32(self):
        res = self.ready_session()
        w = res.artifact.content("moe_route_weights")
        assert w.shape == (len(self.prompt) + len(self.completion) - 1, ROUTERS, TOP_K) and w.dtype == np.float32
        assert np.array_equal(w, weights_for(self.prompt, self.completion).transpose(1, 0, 2))
        sec = res.artifact.manifest["sections"]["moe_route_weights"]
        assert sec["dtype"] == "f32" and sec["output_scale"] == [2.5] * ROUTERS


class TestMoeRouteWeightsBf16Conformance(TestMoeRouteWeightsConformance):
    """The same suite with ``[contents.moe_route_weights] dtype = "bf16"``."""

    def make_host(self):
        return make_host(contents=[self.content], content_settings={self.content: {"dtype": "bf16"}})

    def test_view_is_rows_routers_top_k_f32(self):
        res = self.ready_session()
        art = res.artifact
        assert art.tensors["moe_route_weights.weights"].dtype == np.uint16
        w = art.content("moe_route_weights")
        want = weights_for(self.prompt, self.completion).transpose(1, 0, 2)
        assert w.dtype == np.float32 and np.abs(w - want).max() <= 2.0**-9  # half a bf16 ulp below 1.0
        assert art.manifest["sections"]["moe_route_weights"]["dtype"] == "bf16"
