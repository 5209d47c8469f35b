"""EAGLE-3's head: one decoder layer over [embedding ; hidden], drafting from three target
layers (SafeAILab EAGLE's `cnets.py` for EAGLE-3, the model vLLM's `llama_eagle3` and SGLang
serve).

The target's EAGLE-3 feature of position t is three of its residual streams there,
concatenated ([t, 3 x hidden]: low, middle, high layers; the verifier's
`--eagle-feature-layers`). Entry t of a session reads token t and a hidden-wide vector for
position t - 1: `fc` (3 x hidden -> hidden) of the target's feature when it is known, else the
head's own output of entry t - 1, fed back *without* fc. The layer normalises the embedding
(`input_layernorm`) and that vector (`hidden_norm`) separately, attends from their
concatenation (q/k/v read 2 x hidden), adds the attention to the un-normed vector (the
residual), then runs the usual post-attention norm and MLP. Its output, normed by `norm`, goes
through the head's own LM head over a *draft vocabulary*: draft row i is target token
i + d2t[i]; tokens outside it get q = 0 (verification stays lossless).

**Layer ids.** A head's config may name the target layers it was trained on
(`eagle_aux_hidden_state_layer_ids`, also under `eagle_config`). Runtimes read them two ways;
Tandem reads id i as the *output* of target layer i, i.e. the residual stream entering layer
i + 1 (SGLang's reading, and the one SpecForge trains with: HF hidden_states[i + 1]). Without
ids the head reads the streams entering layers 2, N/2 and N - 3 (N target layers; the default
of EAGLE, vLLM and SGLang), which is ids (1, N/2 - 1, N - 4) in this reading.
"""
from __future__ import annotations

import torch

from kernels.paged_attention import AttentionMetadata
from tandem.engine.checkpoint import LlamaConfig
from tandem.engine.llama import LlamaModel
from tandem.models import ModelError

FEATURE_LAYER_CHOICES = "final, eagle3 or three comma-separated layer ids"


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's default layers as ids (outputs of layers 1, N/2 - 1, N - 4)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def capture_layers(layer_ids, num_layers: int) -> tuple[int, ...]:
    """LlamaModel.forward's feature_layers (the streams entering those layers) of layer ids
    (outputs of those layers), checked against a target of num_layers layers."""
    ids = tuple(int(i) for i in layer_ids)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if len(ids) != 3 or bad:
        raise ModelError(f"EAGLE-3 reads three target layers, ids in [0, {num_layers - 1}] "
                         f"(each the output of that layer), got {list(ids)}")
    return tuple(i + 1 for i in ids)


def parse_feature_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """The verifier's --eagle-feature-layers: "final" (the final normed hidden state,
    EAGLE-1/2 and Tandem's heads: ()), "eagle3" (EAGLE-3's default layers) or "i,j,k" (layer
    ids as a head's config names them) -> LlamaModel.forward's feature_layers."""
    spec = spec.strip()
    if spec == "final":
        return ()
    if spec == "eagle3":
        if num_layers < 5:
            raise ModelError(f"--eagle-feature-layers eagle3 needs a target of >= 5 layers "
                             f"(this one has {num_layers}): name three layer ids")
        return capture_layers(default_layer_ids(num_layers), num_layers)
    try:
        ids = [int(p) for p in spec.split(",")]
    except ValueError:
        raise ModelError(f"--eagle-feature-layers must be {FEATURE_LAYER_CHOICES}, "
                         f"got {spec!r}") from None
    try:
        return capture_layers(ids, num_layers)
    except ModelError as exc:
        raise ModelError(f"--eagle-feature-layers {spec}: {exc}") from None


class Eagle3Head:
    """The head's weights and its functional forward over a paged KV cache (the EagleHead
    interface the EagleProposer drives)."""

    reads_target_head = False  # a target feature is not an input of this head's LM head

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], d2t: torch.Tensor,
                 dtype=torch.float32, device="cpu"):
        """cfg: the head's, vocab_size the target's; weights in Tandem's names (`layers.0.*`,
        `embed_tokens.weight` over the target's vocabulary, `lm_head.weight` over the draft
        vocabulary), plus `fc.weight`, `fc.bias` (optional), `hidden_norm.weight`."""
        self.model = m = LlamaModel(cfg, weights, dtype, device=device)
        hidden = cfg.hidden_size
        self.feature_size = 3 * hidden

        def w(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = weights[name]
            if tuple(t.shape) != shape:
                raise ModelError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
            return t.to(device=m.device, dtype=m.dtype).contiguous()

        self.fc = w("fc.weight", (hidden, 3 * hidden))
        self.fc_bias = w("fc.bias", (hidden,)) if "fc.bias" in weights else None
        self.hidden_norm = w("hidden_norm.weight", (hidden,))
        m.vocab_map = (torch.arange(len(d2t)) + d2t).to(m.device)  # draft row -> target id
        self.card: dict = {}
        self.layer_ids: tuple[int, ...] | None = None  # the config's, if it names them
        # vLLM's and speculators' variant: the residual is the normed hidden input, not it
        self.norm_before_residual = False

    @property
    def cfg(self) -> LlamaConfig:
        return self.model.cfg  # vocab_size is the target's

    def project(self, features: torch.Tensor) -> torch.Tensor:  # [n, 3 hidden] -> [n, hidden]
        """The target's features as the layer's hidden input (fc)."""
        m = self.model
        return m.linear(features.to(m.dtype), self.fc, self.fc_bias)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:  # [rows, hidden] -> [rows, vocab]
        """Logits over the target's ids (-inf outside the draft vocabulary) of outputs h."""
        m = self.model
        return m.logits(m._rms_norm(h.to(m.dtype), m.final_norm))

    def forward(
        self,
        input_ids: torch.Tensor,  # [n] int64 target ids: token t of each entry
        hidden: torch.Tensor,  # [n, hidden] position t - 1's: fc(feature) or the head's output
        positions: torch.Tensor,  # [n] int64
        meta: AttentionMetadata,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],  # one (key, value) pair
        logits_indices: torch.Tensor,  # [m] int64 rows whose logits are returned
    ) -> tuple[torch.Tensor, torch.Tensor]:  # logits [m, vocab] float32, outputs [n, hidden]
        m = self.model
        layer, h = m.layers[0], hidden.to(m.dtype)
        normed = m._rms_norm(h, self.hidden_norm)
        x = torch.cat([m._rms_norm(m.embed[input_ids], layer.input_norm), normed],
                      -1)  # [n, 2 * hidden]
        cos, sin = m.rope_at(positions)
        (k_cache, v_cache), = kv_cache
        residual = normed if self.norm_before_residual else h
        out = m.decoder_layer(residual, layer, cos, sin, meta, k_cache, v_cache, x=x)
        return self.draft_logits(out[logits_indices]), out
