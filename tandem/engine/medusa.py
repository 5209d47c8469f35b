"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state, head i
guessing the token i + 1 places past the one the LM head predicts. They run inside the verifier
(they read its hidden states; no network hop) and propose a token *tree*: `choices`
(`medusa_choices` in the Medusa repo and rtp-llm) lists the paths of ranks kept, e.g. (0,),
(1,), (0, 0): head 1's top-2 and, under the first, head 2's top-1.

Each head is `num_layers` residual blocks x + SiLU(W x + b) followed by the target's own LM
head restricted to `vocab_ids` (frozen and shared, so a head is hidden^2 weights: trainable on
a CPU). Saved as `medusa.json` + `medusa.safetensors` in `<checkpoint>/medusa/`; heads for the
shipped target travel with the package (tandem/engine/medusa_heads/<checkpoint name>/).
"""
from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.engine.medusa_published import is_published_medusa, read_published
from tandem.models import ModelError, ModelPaths
from tandem.spec import DraftToken

MEDUSA_DIR = "medusa"
SHIPPED_DIR = Path(__file__).resolve().parent / "medusa_heads"
DEFAULT_TREE_SIZE = 32  # nodes of a published checkpoint's tree (none ships one)


def _check_choices(choices: tuple[tuple[int, ...], ...], num_heads: int) -> None:
    seen = set()
    for path in choices:
        if not path or len(path) > num_heads or any(r < 0 for r in path):
            raise ValueError(f"medusa choice {path} must be 1..{num_heads} ranks >= 0")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"medusa choice {path} comes before its parent {path[:-1]}")
        if path in seen:
            raise ValueError(f"medusa choice {path} repeats")
        seen.add(path)


@dataclass(frozen=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_ids: tuple[int, ...]  # target ids the heads can name (rows of the LM head)
    choices: tuple[tuple[int, ...], ...]  # the tree: paths of ranks, parents before children
    # Held-out rate at which head i's rank-r token was the target's token: [heads][ranks].
    accuracy: tuple[tuple[float, ...], ...] = ()

    def __post_init__(self):
        if self.num_heads < 1 or self.num_layers < 0 or self.hidden_size < 1:
            raise ValueError(f"invalid Medusa shape: {self.num_heads} heads, "
                             f"{self.num_layers} layers, hidden {self.hidden_size}")
        if not self.vocab_ids or len(set(self.vocab_ids)) != len(self.vocab_ids):
            raise ValueError("Medusa vocab_ids must be non-empty and without duplicates")
        _check_choices(self.choices, self.num_heads)

    @property
    def reach(self) -> tuple[float, ...]:
        """Per node of the tree, the estimated chance greedy verification reaches it (the
        product of its ranks' accuracies)."""
        out = []
        for path in self.choices:
            r = 1.0
            for depth, rank in enumerate(path):
                if not self.accuracy:  # unmeasured heads: a modest guess, halving per level
                    r *= 0.5 / (rank + 1)
                    continue
                row = self.accuracy[depth]
                r *= row[rank] if rank < len(row) else 0.0
            out.append(r)
        return tuple(out)

    @property
    def chain(self) -> tuple[tuple[int, ...], ...]:
        """The top-1 chain, one node per head: the tree of a chain-shaped session."""
        return tuple((0,) * d for d in range(1, self.num_heads + 1))

    @property
    def chain_reach(self) -> tuple[float, ...]:
        return replace(self, choices=self.chain).reach

    def to_json(self, **extra) -> str:
        return json.dumps({"format": "tandem-medusa/1", "medusa_num_heads": self.num_heads,
                           "medusa_num_layers": self.num_layers,
                           "hidden_size": self.hidden_size,
                           "medusa_choices": [list(c) for c in self.choices],
                           "accuracy": [list(a) for a in self.accuracy], **extra,
                           "vocab_ids": list(self.vocab_ids)}) + "\n"

    @classmethod
    def from_json(cls, data: dict) -> MedusaConfig:
        return cls(int(data["medusa_num_heads"]), int(data["medusa_num_layers"]),
                   int(data["hidden_size"]), tuple(int(t) for t in data["vocab_ids"]),
                   tuple(tuple(int(r) for r in c) for c in data["medusa_choices"]),
                   tuple(tuple(float(a) for a in row) for row in data.get("accuracy", ())))


def tree_from_accuracy(accuracy, size: int) -> tuple[tuple[int, ...], ...]:
    """The `size` paths of highest estimated reach (the product of the ranks' accuracies along
    the path, heads taken as independent, as the Medusa repo builds its trees), in order of
    reach: parents first, and every prefix is the best tree of its size."""
    heap = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(heap)
    out: list[tuple[int, ...]] = []
    while heap and len(out) < size:
        neg, path = heapq.heappop(heap)
        out.append(path)
        if len(path) < len(accuracy):
            for r in range(len(accuracy[len(path)])):
                heapq.heappush(heap, (neg * accuracy[len(path)][r], (*path, r)))
    return tuple(out)


def expected_accepted(accuracy, choices) -> float:
    """Expected drafts accepted per round under greedy, by the same independence estimate."""
    cfg = MedusaConfig(len(accuracy), 0, 1, (0,), tuple(choices), tuple(accuracy))
    return sum(cfg.reach)


class MedusaHeads(torch.nn.Module):
    """The trainable part: per head, num_layers residual SiLU blocks. `lm_rows` [V_d, hidden]
    are the target's LM-head rows of cfg.vocab_ids (frozen), or [heads, V_d, hidden] for heads
    published with an LM head each (tandem.engine.medusa_published)."""

    def __init__(self, cfg: MedusaConfig, lm_rows: torch.Tensor):
        super().__init__()
        self.cfg = cfg
        n, L, h = cfg.num_heads, cfg.num_layers, cfg.hidden_size
        # Zero-initialised: an untrained head repeats the LM head's guess (Medusa's init).
        self.weight = torch.nn.Parameter(torch.zeros(n, L, h, h))
        self.bias = torch.nn.Parameter(torch.zeros(n, L, h))
        self.register_buffer("lm_rows", lm_rows.float().contiguous(), persistent=False)
        self.register_buffer("vocab", torch.tensor(cfg.vocab_ids, dtype=torch.int64),
                             persistent=False)

    def hidden(self, h: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """[N, hidden] -> [heads, N, hidden], for the first `heads` heads (default all)."""
        n = self.cfg.num_heads if heads is None else heads
        x = h.float()[None].expand(n, -1, -1)
        for layer in range(self.cfg.num_layers):
            x = x + F.silu(torch.baddbmm(self.bias[:n, layer, None], x,
                                         self.weight[:n, layer].transpose(1, 2)))
        return x

    def forward(self, h: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """[N, hidden] -> [heads, N, V_d] logits over the heads' vocabulary."""
        x = self.hidden(h, heads)
        if self.lm_rows.dim() == 3:  # a published layout: each head its own LM head
            return torch.bmm(x, self.lm_rows[:x.shape[0]].transpose(1, 2))
        return x @ self.lm_rows.T

    def propose(self, h: torch.Tensor, nodes: int | None = None, chain: bool = False
                ) -> tuple[list[DraftToken], tuple[int, ...]]:
        """The tree (its first `nodes` nodes; default all) for the position after the one `h`
        [hidden] predicts: its tokens (one-hot q: deterministic candidates) and each node's
        parent index (-1 = the tree's root, the token the target itself emits). Only the
        heads those nodes reach are run. chain: the heads' top-1 tokens only (a chain)."""
        return self.propose_batch(h[None], [(nodes, chain)])[0]

    @torch.inference_mode()
    def propose_batch(self, h: torch.Tensor, asks: list[tuple[int | None, bool]]
                      ) -> list[tuple[list[DraftToken], tuple[int, ...]]]:
        """propose() for several sessions at once, one heads pass over all of them (the
        heads' weights are read once per step, not once per session): h [sessions, hidden],
        asks[i] = (nodes, chain) of session i."""
        sets = [(self.cfg.chain if chain else self.cfg.choices)[:nodes] for nodes, chain in asks]
        depth = max(len(p) for choices in sets for p in choices)
        k = 1 + max(r for choices in sets for p in choices for r in p)
        idx = self.forward(h, depth).topk(k, dim=-1).indices  # [heads, sessions, k]
        top = self.vocab[idx].tolist()
        out = []
        for i, choices in enumerate(sets):
            index = {path: j for j, path in enumerate(choices)}
            tokens = [DraftToken(top[len(p) - 1][i][p[-1]]) for p in choices]
            out.append((tokens, tuple(index[p[:-1]] if len(p) > 1 else -1 for p in choices)))
        return out

    def save(self, out_dir: Path, **extra) -> None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({"weight": self.weight.detach().contiguous(),
                   "bias": self.bias.detach().contiguous()}, str(out_dir / "medusa.safetensors"))
        (out_dir / "medusa.json").write_text(self.cfg.to_json(**extra))

    @classmethod
    def load(cls, path: Path, lm_head: torch.Tensor, choices=None) -> MedusaHeads:
        """Heads from `path` (a medusa directory) over the target's `lm_head` [vocab, hidden];
        `choices` overrides the saved tree."""
        path = Path(path)
        try:
            data = json.loads((path / "medusa.json").read_text())
            if choices is not None:
                data["medusa_choices"] = choices
            cfg = MedusaConfig.from_json(data)
            tensors = load_file(str(path / "medusa.safetensors"))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(f"cannot read Medusa heads from {path}: {exc}") from exc
        if lm_head.shape[1] != cfg.hidden_size or max(cfg.vocab_ids) >= lm_head.shape[0]:
            raise ModelError(f"Medusa heads in {path} do not fit this target's LM head "
                             f"{tuple(lm_head.shape)}")
        heads = cls(cfg, lm_head[torch.tensor(cfg.vocab_ids)])
        heads.load_state_dict(tensors, strict=True)
        return heads.eval()


def load_for(model, paths: ModelPaths, choice: str) -> MedusaHeads | None:
    """The heads `choice` names (see resolve_medusa) over `model`'s LM head, or None."""
    path = resolve_medusa(choice, paths)
    if path is None:
        return None
    if is_published_medusa(path):  # FasterDecoding, rtp-llm or vLLM layouts
        return load_published(path, model.cfg.hidden_size, model.cfg.vocab_size).to(
            model.device)
    # The heads run inside the verifier's step, on the target's hidden states: same device.
    return MedusaHeads.load(path, _float_lm_head(model, paths)).to(model.device)


def load_published(root: Path, hidden_size: int, vocab_size: int,
                   tree_size: int = DEFAULT_TREE_SIZE) -> MedusaHeads:
    """Heads in any of the published layouts at `root` (tandem.engine.medusa_published), for
    a target of this width and vocabulary; each keeps its own LM head."""
    got = read_published(root, hidden_size, vocab_size)
    guess = [[0.5 / (r + 1) for r in range(4)] for _ in range(got.heads)]
    cfg = MedusaConfig(got.heads, got.layers, hidden_size, tuple(range(vocab_size)),
                       tree_from_accuracy(guess, tree_size))
    out = MedusaHeads(cfg, got.lm_heads)  # per-head LM heads [heads, vocab, hidden]
    with torch.no_grad():
        if got.layers:
            out.weight.copy_(got.weight)
            out.bias.copy_(got.bias)
    return out.eval()


def _float_lm_head(model, paths: ModelPaths) -> torch.Tensor:  # [vocab, hidden]
    """The target's whole LM head as floats: the model's own (a tied one's embedding: int8
    keeps a float twin), else read from the checkpoint (an int8 head, or a tensor-parallel
    rank's vocabulary shard)."""
    tied = model.cfg.tie_word_embeddings
    head = model.embed if tied else model.lm_head
    if isinstance(head, torch.Tensor) and head.shape[0] == model.cfg.vocab_size:
        return head
    from safetensors import safe_open

    suffix = "embed_tokens.weight" if tied else "lm_head.weight"
    for file in paths.safetensors():
        with safe_open(str(file), framework="pt") as f:
            names = [n for n in f.keys() if n.endswith(suffix)]  # noqa: SIM118
            if names:
                return f.get_tensor(names[0]).to(model.dtype)
    raise ModelError(f"the checkpoint has no {suffix}")


def find_medusa(paths: ModelPaths) -> Path | None:
    """Heads saved with the checkpoint, else those shipped for it, else None."""
    for candidate in (paths.root / MEDUSA_DIR, SHIPPED_DIR / paths.root.name):
        if (candidate / "medusa.json").is_file():
            return candidate
    return None


def resolve_medusa(choice: str, paths: ModelPaths) -> Path | None:
    """`choice` is "auto" (heads found with the model, None without), "off" or a directory."""
    if choice == "off":
        return None
    return find_medusa(paths) if choice == "auto" else Path(choice)
