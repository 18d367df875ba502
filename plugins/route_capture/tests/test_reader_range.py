"""moe_routes reader range check: the single-max fast path (equal expert counts), the per-router path, and the
dtype-capacity skip each refuse (or accept) exactly what the per-router definition does."""

from __future__ import annotations

import numpy as np
import pytest
from genartifact.errors import ArtifactFormatError
from genartifact_route_capture import READER


def check(ids: np.ndarray, counts: list[int]) -> None:
    r, rows, k = ids.shape
    manifest = {"prompt_token_count": rows + 1, "completion_token_count": 0}
    section = {"token_start": 0, "router_ids": list(range(0, 2 * r, 2)), "expert_counts": counts, "top_k": k,
               "layout": "router_major"}
    READER.validate(manifest, section, {"moe_routes.expert_ids": ids})


@pytest.mark.parametrize("counts", [[16, 16, 16], [16, 32, 16]], ids=["equal", "mixed"])
def test_an_id_out_of_range_names_its_router(counts):
    ids = np.random.default_rng(0).integers(0, 16, (3, 50, 2)).astype(np.uint8)
    check(ids, counts)
    ids[2, 49, 1] = 16  # router index 2 = decoder layer 4
    with pytest.raises(ArtifactFormatError, match="expert id 16 out of range for router 4 with 16 experts"):
        check(ids, counts)
    ids[2, 49, 1] = 15
    ids[1, 0, 0] = 31
    if counts[1] == 32:
        check(ids, counts)  # valid for the 32-expert router
    else:
        with pytest.raises(ArtifactFormatError, match="router 2 with 16 experts"):
            check(ids, counts)


def test_full_dtype_range_needs_no_pass():
    check(np.full((2, 4, 2), 255, np.uint8), [256, 256])
    check(np.full((2, 4, 2), 65535, np.uint16), [65536, 65536])
    with pytest.raises(ArtifactFormatError, match="expert id 65535 out of range for router 2 with 300"):
        check(np.full((2, 4, 2), 65535, np.uint16), [65536, 300])
