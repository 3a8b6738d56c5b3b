"""A tiny FSDP2 model for the offload tests: uneven shards on 2 ranks and tied embeddings.

``embed`` (11 x 8) and each ``lin1`` (7 x 8) split 6/5 and 4/3 rows over 2 ranks; ``extra``
(1 x 8) leaves rank 1 an empty shard; the output head shares ``embed.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, DIM, HIDDEN = 11, 8, 7


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, HIDDEN)
        self.lin2 = nn.Linear(HIDDEN, DIM)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.lin2(torch.tanh(self.lin1(h)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.extra = nn.Parameter(torch.randn(1, DIM))
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.extra
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h) * self.scale)


def build(seed: int, shard: bool) -> TinyLM:
    torch.manual_seed(seed)
    model = TinyLM()
    if shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return model


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, VOCAB, (3, 5), generator=g)
    y = torch.randint(0, VOCAB, (3, 5), generator=g)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
