"""A small character-level transformer language model (decoder-only, GPT-style), in one readable file.

The layout follows GPT-2 (Radford et al. 2019) as nanoGPT writes it: token + learned position embeddings,
pre-LayerNorm blocks of causal self-attention and a 4x MLP, a final LayerNorm and a linear head. It is
small on purpose (about 0.1 M parameters by default) so that data-parallel runs on CPU ranks take
seconds, while its gradients have the shapes that matter to compressors: embedding and weight matrices
(which PowerSGD compresses) beside biases and LayerNorm vectors (which it sends whole).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["CharLMConfig", "CharTransformer"]


@dataclasses.dataclass(frozen=True)
class CharLMConfig:
    """Model size, named as the planner's :class:`~commlab.parallel.planner.ModelConfig` names it.

    Attributes:
        vocab: characters in the vocabulary. seq: the context length in characters. layers: transformer
        blocks. hidden: the model width, divisible by ``heads``. heads: attention heads. ffn: the MLP's inner
        width (None: ``4 * hidden``, as GPT-2).
    """

    vocab: int = 97
    seq: int = 64
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    ffn: int | None = None

    def __post_init__(self):
        if self.ffn is None:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        if min(self.vocab, self.seq, self.layers, self.hidden, self.heads, self.ffn) < 1:
            raise ValueError(f"every CharLMConfig field must be >= 1, got {self}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")


class _Block(nn.Module):
    def __init__(self, cfg: CharLMConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.fc = nn.Linear(cfg.hidden, cfg.ffn)
        self.out = nn.Linear(cfg.ffn, cfg.hidden)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Causal character LM. Input ids int64 (batch, t <= seq); output logits float32 (batch, t, vocab).

    Weights are drawn under ``seed`` (normal, std 0.02, as GPT-2), so every rank builds the same model.

    Raises:
        ValueError: a sequence longer than ``seq`` (in :meth:`forward`).
    """

    def __init__(self, cfg: CharLMConfig = CharLMConfig(), seed: int = 0):
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.tok = nn.Embedding(cfg.vocab, cfg.hidden)
            self.pos = nn.Embedding(cfg.seq, cfg.hidden)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.layers))
            self.ln_f = nn.LayerNorm(cfg.hidden)
            self.head = nn.Linear(cfg.hidden, cfg.vocab)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    # Residual projections scaled by 1/sqrt(2 layers), as GPT-2 does, to keep the residual
                    # stream's variance flat.
                    std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.cfg.seq:
            raise ValueError(f"sequence of {t} characters is longer than the context ({self.cfg.seq})")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in nats per character; ``ids``, ``targets`` int64 (batch, t)."""
        logits = self(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
