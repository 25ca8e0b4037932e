"""A small language model of naive Mamba blocks, and a synthetic task it can learn.

Used by examples/train_lm.py (ssmc against eager, loss curves) and examples/ddp_train.py.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from examples.naive_mamba import NaiveMamba


class NaiveMambaLM(nn.Module):
    def __init__(self, vocab=16, d_model=64, n_layers=2, d_state=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(NaiveMamba(d_model, d_state) for _ in range(n_layers))
        self.norms = nn.ModuleList(nn.LayerNorm(d_model) for _ in range(n_layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return self.head(x)


def batch(n, L, vocab=16, generator=None, device="cpu"):
    """Sequences where each token is the sum of the two before it (mod vocab): the next token
    is predictable only by remembering the past, which is what the recurrence is for."""
    g = generator
    x = torch.empty(n, L + 1, dtype=torch.long)
    x[:, :2] = torch.randint(0, vocab, (n, 2), generator=g)
    for t in range(2, L + 1):
        x[:, t] = (x[:, t - 1] + x[:, t - 2]) % vocab
    x = x.to(device)
    return x[:, :-1], x[:, 1:]
