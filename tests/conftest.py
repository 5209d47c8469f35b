"""Shared fixtures: the real default target is loaded once per test session."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def target_paths():
    from tandem.models import ModelPaths, fetch_default_target

    return ModelPaths(fetch_default_target())


@pytest.fixture(scope="session")
def target_model(target_paths):
    from tandem.engine.llama import LlamaModel

    return LlamaModel.load(target_paths)


@pytest.fixture(scope="session")
def hf_target(target_paths):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_paths.root), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def tokenizer(target_paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_paths.root))
