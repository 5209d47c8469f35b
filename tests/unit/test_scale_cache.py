"""int8 group scales are computed once per weight and read back, bit for bit, by later loads."""
import pytest
import torch

from tandem.engine import quant
from tandem.engine.quant import Int8Weight
from tandem.engine.scale_cache import ScaleCache

pytestmark = pytest.mark.unit


def _on_a_grid(seed: int) -> torch.Tensor:
    """A weight as a 4-bit checkpoint dequantizes to (16 levels per group of 32): exact."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (24, 64), generator=g).float()
    return codes * 0.01 - 0.05


def _counted(monkeypatch) -> list:
    calls, real = [], quant.group_scales
    monkeypatch.setattr(quant, "group_scales", lambda *a: calls.append(1) or real(*a))
    return calls


def _same(a: Int8Weight, b: Int8Weight) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("q", "scale", "zero")) \
        and a.exact == b.exact


def test_a_second_quantize_reads_the_scales_bit_for_bit(tmp_path, monkeypatch):
    w = _on_a_grid(0)
    plain = Int8Weight.quantize(w)
    calls = _counted(monkeypatch)
    first = Int8Weight.quantize(w, ScaleCache(tmp_path))
    second = Int8Weight.quantize(w.clone(), ScaleCache(tmp_path))
    assert len(calls) == 1 and plain.exact
    assert _same(plain, first) and _same(plain, second)


def test_another_weight_or_a_torn_file_is_computed(tmp_path, monkeypatch):
    cache = ScaleCache(tmp_path)
    Int8Weight.quantize(_on_a_grid(0), cache)
    calls = _counted(monkeypatch)
    other = _on_a_grid(1)
    assert _same(Int8Weight.quantize(other, cache), Int8Weight.quantize(other))
    assert len(calls) == 2  # the cached call and the plain one
    for f in tmp_path.glob("*.safetensors"):
        f.write_bytes(b"torn")
    assert _same(Int8Weight.quantize(other, cache), Int8Weight.quantize(other))
    assert len(calls) == 4


def test_zero_turns_it_off_and_a_path_moves_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_SCALE_CACHE", "0")
    assert ScaleCache.default() is None
    monkeypatch.setenv("TANDEM_SCALE_CACHE", str(tmp_path / "s"))
    assert ScaleCache.default().root == tmp_path / "s"
