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
    """Model size. ``block`` is the context length in characters; ``d_model`` must be divisible by ``n_head``."""

    vocab_size: int = 97
    block: int = 64
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4

    def __post_init__(self):
        if min(self.vocab_size, self.block, self.d_model, self.n_layer, self.n_head) < 1:
            raise ValueError(f"every CharLMConfig field must be >= 1, got {self}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_head ({self.n_head})")


class _Block(nn.Module):
    def __init__(self, cfg: CharLMConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharTransformer(nn.Module):
    """Causal character LM. Input ids int64 (batch, t <= block); output logits float32 (batch, t, vocab_size).

    Weights are drawn under ``seed`` (normal, std 0.02, as GPT-2), so every rank builds the same model.

    Raises:
        ValueError: a sequence longer than ``block`` (in :meth:`forward`).
    """

    def __init__(self, cfg: CharLMConfig = CharLMConfig(), seed: int = 0):
        super().__init__()
        self.cfg = cfg
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.block, cfg.d_model)
            self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    # Residual projections scaled by 1/sqrt(2 n_layer), as GPT-2 does, to keep the residual stream's variance flat.
                    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("proj.weight", "out.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)
                elif name.endswith("bias"):
                    nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        if t > self.cfg.block:
            raise ValueError(f"sequence of {t} characters is longer than the context ({self.cfg.block})")
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in nats per character; ``ids``, ``targets`` int64 (batch, t)."""
        logits = self(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
