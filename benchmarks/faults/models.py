"""The three model families of the fault benchmark, their data and the fault knobs.

Every family is small (a few seconds per 300-step run on two CPU cores), seeded, and
built from named blocks (``blocks.3.fc1``) so that module names in a report mean
something. The data are synthetic but learnable: a fixed random teacher network (MLP),
class templates plus noise (CNN), and a fixed random token teacher (transformer).

Fault knobs, all inert by default (a clean run is an ordinary training run):

- every compute leaf (:class:`FLinear`, :class:`FConv2d`, :class:`FBatchNorm2d`,
  :class:`FLayerNorm`) has an ``output_fault`` attribute: a function applied to the
  module's output *inside its own forward*, so the observer sees the faulty tensor as
  that module's output (NaN injection, one channel growing);
- :class:`Scale` is the residual-branch scale of each block (a leaf module);
- each block has ``skip_norms`` (names of its normalizations to skip, as if removed) and
  ``grad_gain`` (applied by :class:`GradGain` to the output of the branch's last leaf
  before the residual add: identity in the forward pass, gradient times the gain in the
  backward pass, so that leaf's output gradient changes and its activation does not).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

__all__ = [
    "FAMILIES",
    "Block",
    "CnnBlock",
    "DataSource",
    "Family",
    "Faultable",
    "GradGain",
    "MlpBlock",
    "Scale",
    "TransformerBlock",
]

OutputFault = Callable[[Tensor], Tensor]


class GradGain(torch.autograd.Function):
    """Identity in the forward pass; multiplies the gradient by ``gain`` in the backward."""

    @staticmethod
    def forward(ctx: Any, *args: Any) -> Any:
        x, gain = args
        ctx.gain = gain
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> Any:
        return grad_outputs[0] * ctx.gain, None


def _gain(x: Tensor, gain: float) -> Tensor:
    if gain == 1.0:
        return x
    out = GradGain.apply(x, gain)
    assert isinstance(out, Tensor)
    return out


class Faultable(nn.Module):
    """Mixin of the compute leaves: the output passes through ``output_fault`` when set.

    The fault runs inside the module's own forward, so hooks on the module (the
    observer's) see the faulty tensor as the module's output.
    """

    output_fault: OutputFault | None = None

    def forward(self, input: Tensor) -> Tensor:
        out: Tensor = super().forward(input)
        return out if self.output_fault is None else self.output_fault(out)


class FLinear(Faultable, nn.Linear):
    """``nn.Linear`` with an ``output_fault``."""


class FConv2d(Faultable, nn.Conv2d):
    """``nn.Conv2d`` with an ``output_fault``."""


class FBatchNorm2d(Faultable, nn.BatchNorm2d):
    """``nn.BatchNorm2d`` with an ``output_fault``."""


class FLayerNorm(Faultable, nn.LayerNorm):
    """``nn.LayerNorm`` with an ``output_fault``."""


class Scale(nn.Module):
    """Multiplies by a fixed factor: the scale of a residual branch (1.0 when healthy)."""

    factor: float

    def __init__(self, factor: float = 1.0) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: Tensor) -> Tensor:
        return x * self.factor


class Block(nn.Module):
    """Shared fault knobs of the blocks: ``skip_norms`` and ``grad_gain``."""

    skip_norms: set[str]
    grad_gain: float

    def __init__(self) -> None:
        super().__init__()
        self.skip_norms: set[str] = set()
        self.grad_gain = 1.0

    def norm(self, name: str, x: Tensor) -> Tensor:
        return x if name in self.skip_norms else getattr(self, name)(x)


# ----------------------------------------------------------------------------- MLP


class MlpBlock(Block):
    """Pre-norm residual block: ``x + scale(fc2(act(fc1(norm(x)))))``."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = FLayerNorm(width)
        self.fc1 = FLinear(width, hidden)
        self.act = nn.ReLU()
        self.fc2 = FLinear(hidden, width)
        self.scale = Scale()

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc2(self.act(self.fc1(self.norm("norm1", x))))
        return x + self.scale(_gain(h, self.grad_gain))


class ResidualMlp(nn.Module):
    """``stem`` -> ``blocks.0`` .. ``blocks.5`` -> ``head_norm`` -> ``head``."""

    def __init__(self, inputs: int = 16, width: int = 32, depth: int = 6, classes: int = 8):
        super().__init__()
        self.stem = FLinear(inputs, width)
        self.blocks = nn.ModuleList(MlpBlock(width, 2 * width) for _ in range(depth))
        self.head_norm = FLayerNorm(width)
        self.head = FLinear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.head_norm(h))


class TeacherData:
    """Gaussian inputs labelled by a fixed random two-layer tanh teacher (argmax)."""

    def __init__(self, seed: int, inputs: int = 16, classes: int = 8, batch: int = 64) -> None:
        self.generator = torch.Generator().manual_seed(1_000 + seed)
        self.w1 = torch.randn(inputs, 32, generator=self.generator) / math.sqrt(inputs)
        self.w2 = torch.randn(32, classes, generator=self.generator) / math.sqrt(32)
        self.inputs, self.batch = inputs, batch

    def next(self) -> tuple[Tensor, Tensor]:
        x = torch.randn(self.batch, self.inputs, generator=self.generator)
        y = (torch.tanh(x @ self.w1) @ self.w2).argmax(dim=1)
        return x, y


# ----------------------------------------------------------------------------- CNN


class CnnBlock(Block):
    """Residual block: ``x + scale(bn2(conv2(act(bn1(conv1(x))))))``."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = FConv2d(channels, channels, 3, padding=1)
        self.bn1 = FBatchNorm2d(channels)
        self.act = nn.ReLU()
        self.conv2 = FConv2d(channels, channels, 3, padding=1)
        self.bn2 = FBatchNorm2d(channels)
        self.scale = Scale()

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.norm("bn1", self.conv1(x)))
        h = self.norm("bn2", self.conv2(h))
        return x + self.scale(_gain(h, self.grad_gain))


class ResidualCnn(nn.Module):
    """``stem`` -> ``blocks.0`` .. ``blocks.3`` -> global mean -> ``head``."""

    def __init__(self, channels: int = 12, depth: int = 4, classes: int = 6) -> None:
        super().__init__()
        self.stem = FConv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(CnnBlock(channels) for _ in range(depth))
        self.head = FLinear(channels, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=(2, 3)))


class TemplateData:
    """8x8 RGB images: one fixed smooth random template per class, plus noise."""

    def __init__(self, seed: int, classes: int = 6, batch: int = 32) -> None:
        self.generator = torch.Generator().manual_seed(2_000 + seed)
        coarse = torch.randn(classes, 3, 4, 4, generator=self.generator)
        self.templates = F.interpolate(coarse, size=(8, 8), mode="bilinear", align_corners=False)
        self.classes, self.batch = classes, batch

    def next(self) -> tuple[Tensor, Tensor]:
        y = torch.randint(0, self.classes, (self.batch,), generator=self.generator)
        noise = torch.randn(self.batch, 3, 8, 8, generator=self.generator)
        return 0.6 * self.templates[y] + noise, y


# ----------------------------------------------------------------------------- transformer


class Attention(nn.Module):
    """Multi-head self-attention with named projections ``qkv`` and ``proj``."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = FLinear(width, 3 * width)
        self.proj = FLinear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        shape = (batch, length, self.heads, width // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        weights = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(shape[-1]), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(batch, length, width)
        return self.proj(out)


class TransformerBlock(Block):
    """Pre-norm encoder block with layer scales ``attn_scale`` and ``mlp_scale``.

    ``grad_gain`` applies to the attention branch (the output of ``attn.proj``).
    """

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = FLayerNorm(width)
        self.attn = Attention(width, heads)
        self.attn_scale = Scale()
        self.norm2 = FLayerNorm(width)
        self.fc1 = FLinear(width, 2 * width)
        self.act = nn.ReLU()
        self.fc2 = FLinear(2 * width, width)
        self.mlp_scale = Scale()

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn_scale(_gain(self.attn(self.norm("norm1", x)), self.grad_gain))
        return x + self.mlp_scale(self.fc2(self.act(self.fc1(self.norm("norm2", x)))))


class TinyEncoder(nn.Module):
    """``embed`` + ``pos`` -> ``blocks.0`` .. ``blocks.3`` -> mean -> ``head_norm`` -> ``head``."""

    def __init__(
        self,
        vocab: int = 12,
        length: int = 12,
        width: int = 32,
        heads: int = 2,
        depth: int = 4,
        classes: int = 4,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(length, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(depth))
        self.head_norm = FLayerNorm(width)
        self.head = FLinear(width, classes)

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.head_norm(h.mean(dim=1)))


class TokenData:
    """Random token sequences labelled by a fixed random teacher over token counts and
    the first token (argmax), so both mixing and position matter."""

    def __init__(
        self, seed: int, vocab: int = 12, length: int = 12, classes: int = 4, batch: int = 32
    ) -> None:
        self.generator = torch.Generator().manual_seed(3_000 + seed)
        self.count_weights = torch.randn(vocab, classes, generator=self.generator)
        self.first_weights = torch.randn(vocab, classes, generator=self.generator)
        self.vocab, self.length, self.batch = vocab, length, batch

    def next(self) -> tuple[Tensor, Tensor]:
        tokens = torch.randint(0, self.vocab, (self.batch, self.length), generator=self.generator)
        counts = F.one_hot(tokens, self.vocab).float().mean(dim=1)
        logits = 4.0 * counts @ self.count_weights + self.first_weights[tokens[:, 0]]
        return tokens, logits.argmax(dim=1)


# ----------------------------------------------------------------------------- families


class DataSource(Protocol):
    """What a family's data source provides: ``next() -> (inputs, labels)``."""

    def next(self) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True, slots=True)
class Family:
    """A model family: how to build its model, data and optimizer.

    Attributes:
        name: ``mlp``, ``cnn`` or ``transformer``.
        build: returns a fresh model (call after seeding torch).
        data: returns a seeded data source with ``next() -> (inputs, labels)``.
        optimizer: returns the optimizer of a model.
        description: one line for the table legend.
    """

    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int], DataSource]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    description: str


FAMILIES: dict[str, Family] = {
    "mlp": Family(
        name="mlp",
        build=ResidualMlp,
        data=TeacherData,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        description="residual MLP, 6 pre-LayerNorm blocks, width 32; SGD(0.05, momentum 0.9); "
        "random tanh teacher, batch 64",
    ),
    "cnn": Family(
        name="cnn",
        build=ResidualCnn,
        data=TemplateData,
        optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
        description="residual CNN, 4 conv-BatchNorm blocks, 12 channels, 8x8 inputs; "
        "SGD(0.05, momentum 0.9); class templates + noise, batch 32",
    ),
    "transformer": Family(
        name="transformer",
        build=TinyEncoder,
        data=TokenData,
        optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3),
        description="encoder, 4 pre-LayerNorm blocks, width 32, 2 heads, 12 tokens; "
        "AdamW(2e-3); random token teacher, batch 32",
    ),
}
