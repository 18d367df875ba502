"""selected_logprobs reader: one max reduction decides; NaN or +inf anywhere is refused naming its index;
finite values (positive ones too) and -inf pass."""

from __future__ import annotations

import numpy as np
import pytest
from genartifact.errors import ArtifactFormatError
from genartifact_logprobs import READER


def check(lp):
    lp = np.asarray(lp, np.float32)
    READER.validate({"prompt_token_count": 3, "completion_token_count": lp.size}, {"token_start": 3},
                    {"selected_logprobs.logprobs": lp})


def test_finite_and_negative_inf_pass():
    check([-0.5, -np.inf, 0.0, 3.5, -1e30])
    check([])


@pytest.mark.parametrize("bad, at", [(np.nan, 0), (np.inf, 3), (np.nan, 4)])
def test_nan_and_positive_inf_named_by_index(bad, at):
    lp = [-1.0, -np.inf, -2.0, -3.0, -4.0]
    lp[at] = bad
    with pytest.raises(ArtifactFormatError, match=rf"selected_logprobs\[{at}\] is (nan|inf)"):
        check(lp)
