"""The int8 kernel's wide tiles (AVX-512, several rows: 16 channels by up to 12 rows) give a
row the same bits as the one-row path, whatever the row count and channel count (issue 49)."""
import shutil

import pytest
import torch

from tandem.engine.quant import Int8Weight

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")]


@pytest.mark.parametrize("out_features", [96, 100, 8, 24, 960])  # even and odd block counts
def test_every_row_count_gives_the_bits_of_the_row_alone(out_features):
    torch.manual_seed(out_features)
    q = Int8Weight.quantize(torch.randn(out_features, 576))
    x = torch.randn(64, 576)
    alone = torch.cat([q.linear(x[i:i + 1]) for i in range(64)])
    for rows in (2, 3, 4, 11, 12, 13, 16, 25, 33, 64):
        assert torch.equal(q.linear(x[:rows]), alone[:rows]), rows
