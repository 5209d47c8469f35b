"""`tandem models inspect` on a malformed checkpoint (issue 47): one line on stderr, exit
status 2, no traceback, whatever the file holds."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from tools.cli import main

pytestmark = pytest.mark.unit
CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "tie_word_embeddings": True}


def _whole(tmp_path) -> bytes:
    save_file({"model.embed_tokens.weight": torch.zeros(32, 8),
               "model.norm.weight": torch.ones(8)}, tmp_path / "whole.safetensors")
    return (tmp_path / "whole.safetensors").read_bytes()


def _checkpoint(root, weights=None, config=None):
    root.mkdir()
    (root / "config.json").write_text(json.dumps(CONFIG) if config is None else config)
    if weights == "dir":
        (root / "model.safetensors").mkdir()
    elif weights is not None:
        (root / "model.safetensors").write_bytes(weights)
    return root


def _file(path):
    path.write_bytes(b"x")
    return path


CASES = {
    "empty weights": lambda t: _checkpoint(t / "c", b""),
    "random weights": lambda t: _checkpoint(t / "c", os.urandom(4096)),
    "header cut": lambda t: _checkpoint(t / "c", _whole(t)[:40]),
    "data cut": lambda t: _checkpoint(t / "c", _whole(t)[:-100]),
    "weights a directory": lambda t: _checkpoint(t / "c", "dir"),
    "config a list": lambda t: _checkpoint(t / "c", _whole(t), "[1, 2]"),
    "config random bytes": lambda t: _checkpoint(t / "c", _whole(t), "\x00\x93garbage"),
    "config wrong types": lambda t: _checkpoint(
        t / "c", _whole(t), json.dumps({**CONFIG, "num_hidden_layers": "x"})),
    "a file, not a directory": lambda t: _file(t / "f.safetensors"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_checkpoint_is_one_line_and_exit_2(case, tmp_path, capsys):
    path = CASES[case](tmp_path)
    assert main(["models", "inspect", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"tandem models inspect: {path}: cannot read the checkpoint: ")
