"""The EAGLE head's learning curve: one point per training run, kept across --resume."""
import json

import pytest

from tools.distill.learning_curve import CARD, DEFAULT_HEAD, curve_point, extend, main

pytestmark = pytest.mark.unit


def test_a_run_adds_its_point_after_the_resumed_ones():
    stats = {"steps": 10, "top1_step1": 0.4, "top1_step2": 0.3, "train_wall_s": 60.0,
             "heldout_chat": {"top1_step1": 0.33}}
    point = curve_point(stats, batch_tokens=4096, data_positions=1000)
    assert point["train_positions"] == 40960 and point["heldout_chat_top1"] == 0.33
    assert extend(None, point) == [point]
    assert extend({"learning_curve": [{"train_positions": 1}]}, point)[1] == point
    assert "heldout_chat_top1" not in curve_point({"steps": 1}, 8, 8)
    # The point names the prompt set its validation split came from.
    assert point["prompt_mix"] == "chat"
    assert curve_point(stats, 4096, 1000, prompt_mix="self")["prompt_mix"] == "self"


def test_the_shipped_head_plots_its_curve(tmp_path, capsys):
    points = json.loads((DEFAULT_HEAD / CARD).read_text())["learning_curve"]
    assert [p["train_positions"] for p in points] == sorted(p["train_positions"] for p in points)
    out = tmp_path / "curve.png"
    assert main([str(DEFAULT_HEAD), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    assert len(capsys.readouterr().out.splitlines()) == len(points) + 1


def test_a_directory_without_a_card_is_refused(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path)])


def test_an_eagle3_head_shares_the_plot_with_the_shipped_head(tmp_path, capsys):
    head3 = tmp_path / "head3"
    head3.mkdir()
    curve = [{"train_positions": 1_740_800, "prompt_mix": "self", "top1_step1": 0.475,
              "top1_step2": 0.395, "heldout_chat_top1": 0.346}]
    (head3 / "tandem_eagle3.json").write_text(json.dumps(
        {"format": "tandem-eagle3/1", "target": {"name": "t"}, "learning_curve": curve}))
    out = tmp_path / "both.png"
    assert main([str(DEFAULT_HEAD), str(head3), "--out", str(out)]) == 0
    assert out.stat().st_size > 1000
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()[:-1]]
    shipped = json.loads((DEFAULT_HEAD / CARD).read_text())["learning_curve"]
    assert len(lines) == len(shipped) + 1 and lines[-1]["head"] == str(head3)
    (head3 / "tandem_eagle3.json").write_text(json.dumps({"format": "tandem-eagle3/1"}))
    with pytest.raises(SystemExit):  # a card without a curve
        main([str(head3), "--out", str(out)])
