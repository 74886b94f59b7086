"""Real update trajectories: the bytes a trainer sends, step after step.

A delta codec is only as good as the data it is measured on, and the
statistics of an RL update (how many elements change between two sends,
and by how many low bits) come from the optimizer, not from a pattern. So
the trajectories here come from training: a small transformer (a stack of
``nn.TransformerEncoderLayer``) is trained by AdamW (betas 0.9/0.95, the
usual RL/LLM setting) on random data, and each step yields what a trainer
would stage: the fp32 master itself, or its bf16 cast (what an LLM-RL
trainer sends to bf16 inference workers; the master stays fp32, so a small
learning rate changes only the elements whose master crossed a bf16
rounding boundary). ``'random'`` yields fresh random bytes each step: the
incompressible case.

:func:`update_trajectory` is shared by ``benchmarks/delta_codec.py`` and the
bench's delta runs; it is deterministic for a given seed.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["TRAJECTORIES", "Trajectory", "transformer", "update_trajectory"]


class Trajectory:
    """One kind of update: what is sent (``wire``: ``'bf16'`` cast of an fp32
    master, ``'fp32'``, or ``'random'`` bytes) and the learning rate."""

    def __init__(self, name: str, wire: str, lr: float) -> None:
        if wire not in ("bf16", "fp32", "random"):
            raise ValueError(f"wire must be 'bf16', 'fp32' or 'random', got {wire!r}")
        self.name, self.wire, self.lr = name, wire, lr

    @property
    def element_size(self) -> int:
        """Bytes per element of the sent bytes."""
        return 2 if self.wire == "bf16" else 4

    def __repr__(self) -> str:
        return f"Trajectory({self.name!r}, {self.wire!r}, {self.lr:g})"


#: The cases the delta codec is measured on.
TRAJECTORIES: dict[str, Trajectory] = {
    t.name: t
    for t in (
        Trajectory("bf16-lr1e-6", "bf16", 1e-6),
        Trajectory("bf16-lr3e-6", "bf16", 3e-6),
        Trajectory("bf16-lr1e-5", "bf16", 1e-5),
        Trajectory("fp32-lr3e-4", "fp32", 3e-4),
        Trajectory("random", "random", 0.0),
    )
}


def transformer(nbytes: int, d_model: int = 512, seed: int = 0) -> nn.Module:
    """A stack of ``nn.TransformerEncoderLayer`` (``d_model``, 8 heads, a
    feed-forward 4x as wide) holding about ``nbytes`` of fp32 parameters
    (at least one layer)."""
    per_layer = 4 * (12 * d_model * d_model + 13 * d_model)
    layers = max(1, round(nbytes / per_layer))
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(d_model, 8, 4 * d_model, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)


def _flat(model: nn.Module, wire: str) -> torch.Tensor:
    """The parameters' bytes in order, as the trainer would stage them."""
    params = [p.detach().reshape(-1) for p in model.parameters()]
    flat = torch.cat(params)
    if wire == "bf16":
        flat = flat.to(torch.bfloat16)
    return flat.view(torch.uint8)


def update_trajectory(
    kind: Trajectory,
    nbytes: int = 32 << 20,
    steps: int = 8,
    *,
    warmup: int = 2,
    d_model: int = 512,
    batch: int = 4,
    seq: int = 32,
    seed: int = 0,
) -> Iterator[torch.Tensor]:
    """Yield ``steps + 1`` flat ``uint8`` tensors: the bytes sent before the
    first measured step, then after each of ``steps`` optimizer steps (the
    first ``warmup`` steps, whose Adam moments are still filling, are taken
    but not yielded). Each yielded tensor is new; compare consecutive ones.

    Training runs on torch's own threads (this is the trainer's work, not
    weightsync's). Blocks while it trains.
    """
    if kind.wire == "random":
        gen = torch.Generator().manual_seed(seed)
        model = transformer(nbytes, d_model, seed)
        size = sum(p.numel() for p in model.parameters()) * 4
        for _ in range(steps + 1):
            yield torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
        return
    model = transformer(nbytes, d_model, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=kind.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed + 1)
    loss_fn = nn.MSELoss()
    for step in range(warmup + steps + 1):
        if step >= warmup:
            yield _flat(model, kind.wire)
        if step == warmup + steps:
            return
        x = torch.randn(batch, seq, d_model, generator=gen)
        target = torch.randn(batch, seq, d_model, generator=gen)
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), target).backward()
        opt.step()
