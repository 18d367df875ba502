"""moe_routes against the kit's content conformance suite (worker capture path, rows served by a FakeEngine)."""

from __future__ import annotations

import numpy as np
from genartifact.testing import FakeEngine
from genartifact.testing.conformance import ContentConformance

ROUTERS, EXPERTS, TOP_K = 4, 8, 2  # genartifact.testing.TINY_MOE_CONFIG


def rows_for(prompt, completion):
    """Deterministic worker rows for every forwarded position (router-major [routers, positions, top_k])."""
    positions = len(prompt) + len(completion) - 1
    base = np.arange(ROUTERS * positions * TOP_K, dtype=np.uint8).reshape(ROUTERS, positions, TOP_K)
    return base % EXPERTS


class TestMoeRoutesConformance(ContentConformance):
    content = "moe_routes"
    capture_key = "genartifact_capture_id"

    def engine(self, prompt, completion):
        full = rows_for(prompt, completion)

        def fetch(capture_id, start, end):
            d = np.ascontiguousarray(full[:, start:end])
            return {"shape": list(d.shape), "dtype": d.dtype.str, "data": d.tobytes(), "missing": None}

        return FakeEngine({"moe_routes.fetch": fetch, "moe_routes.discard": lambda cid: True})

    def test_view_is_rows_routers_top_k(self):
        res = self.session()
        routes = res.artifact.content("moe_routes")
        assert routes.shape == (len(self.prompt) + len(self.completion) - 1, ROUTERS, TOP_K)
        assert np.array_equal(routes, rows_for(self.prompt, self.completion).transpose(1, 0, 2))
