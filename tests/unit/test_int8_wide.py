"""The int8 kernel's narrow tiles (one block by up to 5 rows) and wide ones (AVX-512: 16 channels
by up to 12 rows) give a row the same bits as the one-row path, whatever the row count and
channel count (issue 49)."""
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
    for rows in (2, 3, 4, 5, 6, 11, 12, 13, 16, 25, 33, 64):  # narrow (<= 5), wide
        assert torch.equal(q.linear(x[:rows]), alone[:rows]), rows
