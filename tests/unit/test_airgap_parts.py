"""The air-gapped trainer's pieces: parts and manifests (a corrupt or missing part is refused
with a clear message), the stand-alone script's imports, and its head computing what the
served EagleHead computes once exported."""
from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
import torch

from kernels.paged_attention import build_attention_metadata
from tandem.engine.eagle import EagleHead
from tandem.models import ModelError, ModelPaths
from tools.distill import airgap_parts as parts
from tools.distill import airgap_train as script
from tools.distill.airgap import SCRIPTS, BundleConfig, unbundle

pytestmark = pytest.mark.unit


def _packed(tmp_path: Path, part_bytes: int = 1000) -> tuple[Path, dict, bytes]:
    src = tmp_path / "src"
    src.mkdir()
    big = bytes(range(256)) * 13  # 3328 bytes: 4 parts
    (src / "big.bin").write_bytes(big)
    (src / "small.json").write_text('{"a": 1}')
    manifest = parts.pack([src / "big.bin", src / "small.json"], tmp_path / "packed",
                           part_bytes)
    return tmp_path / "packed", manifest, big


def test_pack_splits_and_unpack_reassembles(tmp_path):
    packed, manifest, big = _packed(tmp_path)
    sizes = {p.name: p.stat().st_size for p in packed.iterdir()}
    assert max(v for k, v in sizes.items() if k != parts.MANIFEST) <= 1000
    assert [p["size"] for p in manifest["files"][0]["parts"]] == [1000, 1000, 1000, 328]
    assert "parts" not in manifest["files"][1]  # small files travel whole
    names = parts.unpack(packed, tmp_path / "out", log=lambda m: None)
    assert names == ["big.bin", "small.json"]
    assert (tmp_path / "out" / "big.bin").read_bytes() == big
    # A rerun keeps a file that is already whole and right.
    before = (tmp_path / "out" / "big.bin").stat().st_mtime_ns
    parts.unpack(packed, tmp_path / "out", log=lambda m: None)
    assert (tmp_path / "out" / "big.bin").stat().st_mtime_ns == before


def test_a_corrupt_part_is_refused_with_a_clear_message(tmp_path):
    packed, _, _ = _packed(tmp_path)
    part = packed / "big.bin.part002"
    data = bytearray(part.read_bytes())
    data[7] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(parts.BundleError, match=r"big\.bin\.part002: corrupt .*sha256.*"
                       r"copy this file again"):
        parts.unpack(packed, tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out" / "big.bin").exists()  # nothing half-written is left
    assert not list((tmp_path / "out").glob("*.tmp"))


def test_a_missing_or_truncated_part_is_refused(tmp_path):
    packed, _, _ = _packed(tmp_path)
    (packed / "big.bin.part003").write_bytes(b"short")
    with pytest.raises(parts.BundleError, match="part003: corrupt"):
        parts.unpack(packed, tmp_path / "a", log=lambda m: None)
    (packed / "big.bin.part003").unlink()
    with pytest.raises(parts.BundleError, match="part003: missing"):
        parts.unpack(packed, tmp_path / "b", log=lambda m: None)
    with pytest.raises(parts.BundleError, match="cannot read"):
        parts.unpack(tmp_path / "nowhere", tmp_path / "c", log=lambda m: None)


def _forged(packed: Path, entry: dict) -> None:
    """The manifest as a hostile returned directory could write it, with a matching hash."""
    manifest = json.loads((packed / parts.MANIFEST).read_text())
    manifest["files"].append(entry)
    (packed / parts.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../escaped.bin", "/tmp/tandem-escaped.bin", "a/../../x",
                                  "..", "sub/inner.bin", "c:\\x.bin", "", 7])
def test_a_name_that_leaves_the_folder_is_refused_and_nothing_is_written(tmp_path, name):
    packed, _, _ = _packed(tmp_path)
    payload = b"owned"
    (packed / "payload").write_bytes(payload)
    import hashlib
    sha = hashlib.sha256(payload).hexdigest()
    _forged(packed, {"name": name, "size": len(payload), "sha256": sha,
                     "parts": [{"name": "payload", "size": len(payload), "sha256": sha}]})
    out = tmp_path / "deep" / "out"
    with pytest.raises(parts.BundleError, match="not a plain file name"):
        parts.unpack(packed, out, log=lambda m: None)
    assert not out.exists()  # refused before anything was written
    assert not (tmp_path / "deep" / "escaped.bin").exists()
    assert not Path("/tmp/tandem-escaped.bin").exists()


def test_a_part_named_outside_the_returned_folder_is_refused(tmp_path):
    packed, _, _ = _packed(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the manifest")
    import hashlib
    sha = hashlib.sha256(secret.read_bytes()).hexdigest()
    _forged(packed, {"name": "copy.txt", "size": secret.stat().st_size, "sha256": sha,
                     "parts": [{"name": "../secret.txt", "size": secret.stat().st_size,
                                "sha256": sha}]})
    with pytest.raises(parts.BundleError, match="part '../secret.txt' is not a plain"):
        parts.unpack(packed, tmp_path / "out", log=lambda m: None)
    assert not (tmp_path / "out" / "copy.txt").exists()


@pytest.mark.parametrize("manifest", [[], {"files": "x"}, {"files": [3]},
                                      {"files": [{"name": "a.bin"}]},
                                      {"files": [{"name": "a", "size": 1, "sha256": "0",
                                                  "parts": "abc"}]}])
def test_a_malformed_manifest_is_a_clear_bundle_error(tmp_path, manifest):
    (tmp_path / parts.MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(parts.BundleError):
        parts.unpack(tmp_path, tmp_path / "out", log=lambda m: None)


def test_unbundle_refuses_a_corrupt_return_through_the_cli(tmp_path, capsys):
    from tools.cli import main

    packed, _, _ = _packed(tmp_path)
    (packed / "big.bin.part000").write_bytes(b"x" * 1000)
    with pytest.raises(ModelError, match="part000: corrupt"):
        unbundle(packed, tmp_path / "head", log=lambda m: None)
    rc = main(["distill", "unbundle", "--head-dir", str(packed), "--out", str(tmp_path / "h2")])
    assert rc == 2 and "part000: corrupt" in capsys.readouterr().err


def test_the_script_imports_only_torch_transformers_safetensors_and_the_stdlib():
    siblings = {p.stem for p in SCRIPTS}
    assert siblings == {"airgap_train", "airgap_parts", "airgap_data", "airgap_head",
                        "airgap_head3", "airgap_fit", "airgap_prompts", "airgap_speculators"}
    tops = set()
    for path in SCRIPTS:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                tops.add((node.module or "").split(".")[0])
    assert tops - set(sys.stdlib_module_names) - siblings == {"torch", "transformers",
                                                               "safetensors"}


def test_configs_refuse_oversized_parts():
    with pytest.raises(ValueError, match="part-mib"):
        BundleConfig(Path("b"), part_mib=65)
    with pytest.raises(ValueError, match="part-mib"):
        script.Config("cpu", 1.0, Path("o"), Path("b"), part_mib=17)
    with pytest.raises(ValueError, match="device"):
        script.Config("tpu", 1.0, Path("o"), Path("b"))


HF = {"model_type": "llama", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
      "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
      "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 128,
      "tie_word_embeddings": True}


def test_the_scripts_head_exports_what_the_served_head_computes(tmp_path):
    from tandem.engine.checkpoint import LlamaConfig
    from tandem.engine.rope import rope_inv_freq
    from tools.distill.airgap import geometry

    cfg = LlamaConfig.from_hf(HF)
    torch.manual_seed(0)
    vocab = list(range(0, 300, 3))
    head = script.Head(geometry(cfg), torch.randn(100, 64) * 0.5, vocab, rope_inv_freq(cfg))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head.export(tmp_path, HF, {"format": "tandem-eagle/1"})
    served = EagleHead.load(ModelPaths(tmp_path))
    assert json.loads((tmp_path / "draft_vocab.json").read_text())["target_ids"] == vocab
    head = head.half().float()  # the export is fp16
    t = 20
    ids, feats = torch.tensor([vocab[:t]]), torch.randn(1, t, 64)
    with torch.no_grad():
        want, _ = head(ids, feats, torch.arange(t))
    kv = [(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16))]
    meta = build_attention_metadata([t], [t], [[0, 1]], 16)
    logits, got = served.forward(ids[0], feats[0], torch.arange(t), meta, kv, torch.arange(t))
    torch.testing.assert_close(got, want[0], atol=2e-3, rtol=2e-3)
    want_logits = want[0] @ head.embed.T
    torch.testing.assert_close(logits[:, vocab], want_logits, atol=2e-2, rtol=2e-3)


def test_script_help(capsys):
    with pytest.raises(SystemExit) as exc:
        script.parse(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--minutes" in out and "--device" in out and "--part-mib" in out


def test_script_refuses_a_directory_that_is_no_bundle(tmp_path, capsys):
    assert script.main(["--bundle", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "is not a bundle" in capsys.readouterr().err
