"""Shared fixtures: the real default target is loaded once per test session."""
from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a param id
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


@pytest.fixture(scope="session")
def eagle_dir(target_paths, tmp_path_factory):
    """The shipped EAGLE head, or an untrained one built from the target (same widths and
    ids: drafts poorly, which lossless tests do not mind)."""
    import json
    import shutil
    from pathlib import Path

    from draft_service.weights import default_eagle_dir

    shipped = Path(default_eagle_dir())
    if (shipped / "config.json").is_file():
        return shipped
    from tools.distill.eagle_head import EagleTrainHead

    out = tmp_path_factory.mktemp("eagle-head")
    head = EagleTrainHead.untrained(target_paths.root, 4096)
    hf = json.loads((target_paths.root / "config.json").read_text())
    head.export(out, hf, {"format": "tandem-eagle/1", "untrained": True})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(target_paths.root / f, out / f)
    return out


@pytest.fixture(scope="session")
def grammar_compiler(tokenizer):
    from tandem.grammar.compiler import GrammarCompiler

    return GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


@pytest.fixture(scope="session")
def gemma_paths():
    """The offline Gemma 3 270M checkpoint (a second family and tokenizer)."""
    from tandem.models import ModelPaths, fetch_model

    return ModelPaths(fetch_model("gemma3-270m"))


@pytest.fixture(scope="session")
def gemma_model(gemma_paths):
    """Loaded once for every module that runs it (cross-tokenizer drafts, layer skip, the
    checkpoint's own checks): nothing mutates a loaded model."""
    from tandem.engine.llama import LlamaModel

    return LlamaModel.load(gemma_paths)


@pytest.fixture(scope="session")
def gemma_tokenizer(gemma_paths):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma_paths.root))
