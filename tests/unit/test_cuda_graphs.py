"""CUDA graphs for decode (tandem/engine/cuda_graphs.py): the bucketing and padding on the CPU,
the padded forward (what a graph records) against the runner's own, and, on a GPU, captured
graphs replaying the eager logits."""
import pytest
import torch

from tandem.engine.cuda_graphs import (
    GraphDecoder,
    GraphKey,
    bucket_for,
    check_mode,
    derive_layout,
    kv_bucket,
    pad_decode,
)
from tandem.engine.model_runner import ModelRunner, SeqChunk
from tools.gpu_check.models import tiny_family

pytestmark = pytest.mark.unit


def test_buckets():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 16, 17, 64)] == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_for(65) is None and bucket_for(3, (8, 2)) == 8
    with pytest.raises(ValueError):
        bucket_for(0)
    assert [kv_bucket(n, 16) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, 128]


def test_modes():
    assert not check_mode("auto", "cuda") and not check_mode("off", "cpu")
    assert check_mode("on", "cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        check_mode("on", "cpu")
    with pytest.raises(ValueError, match="must be one of"):
        check_mode("yes", "cuda")


def test_pad_decode_layout():
    with pytest.raises(ValueError, match="does not fit"):  # 6 keys, a table of 4 slots
        pad_decode([SeqChunk([7], 5, [3])], 4, GraphKey(4, 8), 0)
    chunks = [SeqChunk([7], 5, [3, 2]), SeqChunk([9], 0, [1])]
    with pytest.raises(ValueError, match="does not fit"):  # 6 keys, a bucket of 4
        pad_decode(chunks, 4, GraphKey(4, 4), 0)
    p = pad_decode(chunks, 4, GraphKey(4, 8), scratch_block=0)
    assert p.token_ids == [7, 9, 0, 0] and p.positions == [5, 0, 0, 0] and p.rows == 2
    assert p.seq_lens == [6, 1, 1, 1]
    assert p.tables == [[3, 2], [1, 0], [0, 0], [0, 0]]
    kv_slots, mask, slot_mapping = derive_layout(torch.tensor(p.tables),
                                                 torch.tensor(p.seq_lens), 4)
    assert kv_slots[0].tolist() == [12, 13, 14, 15, 8, 9, 10, 11]
    assert slot_mapping.tolist() == [9, 4, 0, 0] and kv_slots[2].tolist() == [0, 1, 2, 3] * 2
    assert mask[0].tolist() == [True] * 6 + [False] * 2 and mask[3].tolist() == [True] + [
        False] * 7
    with pytest.raises(ValueError, match="decode chunks"):
        pad_decode([SeqChunk([1, 2], 0, [1])], 4, GraphKey(4, 8), 0)


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral-window"])
def test_padded_decode_matches_the_runner(family):
    """Decode steps of a ragged batch through the padded layout (eager on the CPU) give the
    runner's logits, and leave the KV cache as the runner would."""
    model = tiny_family(family)
    plain, padded = ModelRunner(model, 40, 4), ModelRunner(model, 40, 4)
    graphs = GraphDecoder(padded, scratch_block=39, capture=False)
    prompts = [list(range(3, 3 + n)) for n in (9, 2, 14)]
    tables = [list(range(i * 12, i * 12 + 12)) for i in range(3)]
    seqs = [list(p) for p in prompts]
    for runner in (plain, padded):
        runner.forward([SeqChunk(p, 0, t) for p, t in zip(prompts, tables)])
    for step in range(6):
        rows = [0, 2] if step % 2 else [0, 1, 2]  # batches of 3 and 2 (buckets 4 and 2)
        chunks = [SeqChunk([seqs[i][-1] + 1], len(seqs[i]), tables[i]) for i in rows]
        want, got = plain.forward(chunks), graphs.forward(chunks)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for i in rows:
            seqs[i].append(seqs[i][-1] + 1)
    assert graphs.fallbacks == 0 and {k.batch for k in graphs.slots} == {2, 4}
    assert graphs.forward([SeqChunk([1, 2], 30, tables[0], 2)]).shape[0] == 2  # eager
    assert graphs.fallbacks == 1


def test_capture_refuses_the_cpu():
    runner = ModelRunner(tiny_family("llama"), 8, 4)
    with pytest.raises(ValueError, match="need a CUDA device"):
        GraphDecoder(runner, 7, capture=True)
    with pytest.raises(ValueError, match="scratch block"):
        GraphDecoder(runner, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_replay_the_eager_logits():
    model = tiny_family("llama", device="cuda")
    eager, graphed = ModelRunner(model, 40, 16), ModelRunner(model, 40, 16)
    graphs = GraphDecoder(graphed, scratch_block=39)
    for runner in (eager, graphed):
        runner.forward([SeqChunk(list(range(1, 20)), 0, [0, 1])])
    for pos in range(19, 27):
        chunk = [SeqChunk([pos % 90 + 1], pos, [0, 1])]
        torch.testing.assert_close(graphs.forward(chunk), eager.forward(chunk),
                                   atol=1e-4, rtol=1e-4)
    assert graphs.replays == 8 and graphs.slots[GraphKey(1, 32)].graph is not None


def test_kept_features_and_hidden_states_match_the_runner():
    """A runner that keeps features (the verifier's, for EAGLE) gets them from the padded
    step too, and with_hidden returns the rows' hidden states."""
    model = tiny_family("llama3-rope")
    plain, padded = ModelRunner(model, 12, 4, True), ModelRunner(model, 12, 4, True)
    graphs = GraphDecoder(padded, scratch_block=11, capture=False)
    tables = [[0, 1, 2], [3, 4, 5]]
    for runner in (plain, padded):
        runner.forward([SeqChunk([4, 5, 6, 7, 8], 0, tables[0]), SeqChunk([9, 3], 0, tables[1])])
    chunks = [SeqChunk([11], 5, tables[0]), SeqChunk([12], 2, tables[1])]
    (want, want_h), (got, got_h) = plain.forward(chunks, True), graphs.forward(chunks, True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_h, want_h, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(padded.features_at(tables[0], 0, 6),
                               plain.features_at(tables[0], 0, 6), atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("seeded", [False, True])
def test_the_executor_with_graphs_gives_plain_text(seeded):
    """Decode steps through the verifier's Executor with a GraphDecoder (as --cuda-graphs on
    serves them): the same text as without, with and without Medusa trees in between."""
    from tandem.sampling_params import SamplingParams
    from tools.gpu_check.heads import medusa_heads
    from tools.gpu_check.spec_loop import generate

    model = tiny_family("gemma2")
    sampling = SamplingParams(0.8, seed=5) if seeded else SamplingParams(temperature=0.0)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = generate(ModelRunner(model, 9, 8), prompt, 20, sampling).tokens
    assert generate(ModelRunner(model, 9, 8), prompt, 20, sampling, graphs=True).tokens == want
    medusa = medusa_heads(model)
    assert generate(ModelRunner(model, 9, 8), prompt, 20, sampling, medusa=medusa,
                    graphs=True).tokens == want


def test_the_verifier_flag():
    from verify_service.config import VerifierConfig

    assert VerifierConfig().cuda_graphs == "auto"
    with pytest.raises(ValueError, match="needs a CUDA device"):
        VerifierConfig(cuda_graphs="on", device="cpu")
    with pytest.raises(ValueError, match="must be one of"):
        VerifierConfig(cuda_graphs="maybe")
    from tandem.engine.cuda_graphs import graph_decoder

    runner = ModelRunner(tiny_family("llama"), 8, 4)
    assert graph_decoder("auto", runner) is None and graph_decoder("off", runner) is None
    with pytest.raises(ValueError, match="needs a CUDA device"):
        graph_decoder("on", runner)


def test_auto_reads_a_gpu_check_result(tmp_path):
    import json

    from tandem.engine.graph_modes import measured_gain

    path = tmp_path / "gpu-check.json"
    path.write_text(json.dumps({"device_name": "NVIDIA H100 80GB HBM3", "recommendations": {
        "cuda_graphs_auto_should_enable": True}}))
    assert measured_gain(str(path), "NVIDIA H100 80GB HBM3") is True
    assert measured_gain(str(path), "NVIDIA L4") is None and measured_gain("", "x") is None
    assert check_mode("auto", "cuda", True) and not check_mode("auto", "cuda", None)
    assert not check_mode("auto", "cpu", True) and not check_mode("auto", "cuda", False)
    with pytest.raises(ValueError, match="cannot read"):
        measured_gain(str(tmp_path / "missing.json"), "x")
