"""The model families of the real-model fault benchmark: upstream models, random init.

Every model comes from an upstream package, built from a config with random weights
(nothing is downloaded): GPT-2 from ``transformers``, ResNet from ``torchvision``, a
Vision Transformer from ``timm``. A family fixes the model, its data, its optimizer, its
loss and its training loop:

========================  ==========  ==========================================================
family                    loop        model, data, optimizer
========================  ==========  ==========================================================
``gpt2``                  plain       GPT-2, 4 layers, width 64, 4 heads, vocab 128, 32 tokens;
                                      Markov language, batch 16; AdamW(1e-3, wd 0.01), clip 1.0
``gpt2_trainer``          trainer     the same GPT-2 and language through ``transformers.Trainer``
                                      (AdamW 1e-3, wd 0.01, 50 warm-up steps, cosine, clip 1.0)
``resnet``                plain       torchvision ResNet(BasicBlock, [1, 1, 1, 1]), 10 classes,
                                      16x16 templates, batch 16; SGD(0.05, momentum 0.9, wd 5e-4)
``vit``                   accelerate  timm VisionTransformer(32x32, patch 4, width 64, depth 4,
                                      4 heads), 10 classes, batch 16; AdamW(1e-3, wd 0.05), clip 1.0
========================  ==========  ==========================================================

The plain and accelerate loops skip the optimizer step when the gradient norm is not
finite (a common guard); the Trainer has no such guard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .data import (
    Batch,
    ImageDataset,
    ImageStream,
    MarkovLanguage,
    TemplateImages,
    TokenDataset,
    TokenStream,
)

__all__ = ["FAMILIES", "Family", "Loop", "Stream"]

Loop = Literal["plain", "trainer", "accelerate"]

#: Seed of the fixed probe batch of every family (never a training batch).
PROBE_BATCH_SEED = 99_999

VOCAB = 128
TOKENS = 32
TOKEN_BATCH = 16
RESNET_SIZE = 16
RESNET_BATCH = 16
VIT_SIZE = 32
VIT_BATCH = 16
#: Examples of the fixed training sets (Trainer, accelerate): several epochs per run.
DATASET_SIZE = 4_096

LANGUAGE = MarkovLanguage(vocab=VOCAB)
RESNET_TASK = TemplateImages(size=RESNET_SIZE)
VIT_TASK = TemplateImages(size=VIT_SIZE)


class Stream(Protocol):
    """What a plain loop reads: ``next() -> Batch``."""

    def next(self) -> Batch: ...


def build_gpt2() -> nn.Module:
    """``GPT2LMHeadModel`` with 4 layers, width 64, 4 heads, 64 positions, vocab 128.

    Everything else is GPT-2's default configuration (dropout 0.1 on embeddings, residual
    branches and attention; GELU (``gelu_new``); SDPA attention; tied embeddings).
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=4,
        n_embd=64,
        n_head=4,
        n_positions=64,
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


def build_resnet() -> nn.Module:
    """torchvision ``ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)`` (a halved ResNet-18)."""
    from torchvision.models.resnet import BasicBlock, ResNet

    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)


def build_vit() -> nn.Module:
    """timm ``VisionTransformer``: 32x32 images, patch 4 (64 tokens + class token), width 64,
    depth 4, 4 heads, 10 classes; timm's defaults otherwise (no dropout, GELU, fused
    attention)."""
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(
        img_size=VIT_SIZE, patch_size=4, embed_dim=64, depth=4, num_heads=4, num_classes=10
    )


def language_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Next-token cross-entropy as GPT-2 computes it from ``labels`` (nats per token)."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"]).loss


def image_loss(model: nn.Module, batch: Batch) -> Tensor:
    """Cross-entropy of the class logits (nats per image)."""
    return F.cross_entropy(model(batch["pixels"]), batch["labels"])


def _adamw(lr: float, weight_decay: float) -> Callable[[nn.Module], torch.optim.Optimizer]:
    def make(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)

    return make


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)


def _token_probe() -> Batch:
    tokens = LANGUAGE.sample(TOKEN_BATCH, TOKENS, torch.Generator().manual_seed(PROBE_BATCH_SEED))
    return {"input_ids": tokens, "labels": tokens}


def _image_probe(task: TemplateImages, batch: int) -> Callable[[], Batch]:
    def make() -> Batch:
        return task.sample(batch, torch.Generator().manual_seed(PROBE_BATCH_SEED))

    return make


@dataclass(frozen=True, slots=True)
class Family:
    """A model family: model, data, optimizer, loss and loop of its runs.

    Attributes:
        name: ``gpt2``, ``gpt2_trainer``, ``resnet`` or ``vit``.
        loop: ``plain`` (a hand-written loop), ``trainer`` (``transformers.Trainer``) or
            ``accelerate`` (``Accelerator(cpu=True)``).
        description: one line for the legend.
        build_model: a fresh randomly initialised model (seed torch first).
        make_optimizer: the optimizer of a model (plain and accelerate loops; the Trainer
            builds its own from ``learning_rate`` and ``weight_decay``).
        loss: the training loss of a batch (a scalar tensor).
        probe_batch: the fixed probe batch of the ground-truth probe.
        blocks: names of the model's repeated blocks (the model-wide probe of optimizer
            faults counts how many of them an update changes).
        stream: the training stream of a run seed (plain loops).
        dataset: the training set of a run seed (Trainer, accelerate).
        batch_size: examples per training batch.
        learning_rate, weight_decay: the Trainer's optimizer settings (Trainer only).
        max_grad_norm: gradient clipping norm (None: no clipping; the non-finite guard
            still runs).
    """

    name: str
    loop: Loop
    description: str
    build_model: Callable[[], nn.Module]
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    loss: Callable[[nn.Module, Batch], Tensor]
    probe_batch: Callable[[], Batch]
    blocks: tuple[str, ...]
    stream: Callable[[int], Stream] | None = None
    dataset: Callable[[int], torch.utils.data.Dataset] | None = None
    batch_size: int = 16
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0


def _token_stream(run_seed: int) -> Stream:
    return TokenStream(LANGUAGE, run_seed, TOKEN_BATCH, TOKENS)


def _resnet_stream(run_seed: int) -> Stream:
    return ImageStream(RESNET_TASK, run_seed, RESNET_BATCH)


GPT2_BLOCKS = tuple(f"transformer.h.{i}" for i in range(4))

FAMILIES: dict[str, Family] = {
    "gpt2": Family(
        name="gpt2",
        loop="plain",
        description="transformers GPT2LMHeadModel (4 layers, width 64, 4 heads, vocab 128), "
        "32-token Markov language with copies, batch 16; plain loop, AdamW(1e-3, wd 0.01), "
        "clip 1.0",
        build_model=build_gpt2,
        make_optimizer=_adamw(1e-3, 0.01),
        loss=language_loss,
        probe_batch=_token_probe,
        blocks=GPT2_BLOCKS,
        stream=_token_stream,
        batch_size=TOKEN_BATCH,
    ),
    "gpt2_trainer": Family(
        name="gpt2_trainer",
        loop="trainer",
        description="the same GPT-2 and language through transformers.Trainer (AdamW 1e-3, "
        "wd 0.01, 50 warm-up steps, cosine, clip 1.0, batch 16, use_cpu)",
        build_model=build_gpt2,
        make_optimizer=_adamw(1e-3, 0.01),
        loss=language_loss,
        probe_batch=_token_probe,
        blocks=GPT2_BLOCKS,
        dataset=lambda seed: TokenDataset(LANGUAGE, seed, DATASET_SIZE, TOKENS),
        batch_size=TOKEN_BATCH,
        learning_rate=1e-3,
        weight_decay=0.01,
    ),
    "resnet": Family(
        name="resnet",
        loop="plain",
        description="torchvision ResNet(BasicBlock, [1,1,1,1]), 10 classes, 16x16 templates + "
        "noise, batch 16; plain loop, SGD(0.05, momentum 0.9, wd 5e-4)",
        build_model=build_resnet,
        make_optimizer=_sgd,
        loss=image_loss,
        probe_batch=_image_probe(RESNET_TASK, RESNET_BATCH),
        blocks=("layer1", "layer2", "layer3", "layer4"),
        stream=_resnet_stream,
        batch_size=RESNET_BATCH,
        max_grad_norm=None,
    ),
    "vit": Family(
        name="vit",
        loop="accelerate",
        description="timm VisionTransformer (32x32, patch 4, width 64, depth 4, 4 heads), "
        "10 classes, batch 16; accelerate (cpu), AdamW(1e-3, wd 0.05), clip 1.0",
        build_model=build_vit,
        make_optimizer=_adamw(1e-3, 0.05),
        loss=image_loss,
        probe_batch=_image_probe(VIT_TASK, VIT_BATCH),
        blocks=tuple(f"blocks.{i}" for i in range(4)),
        dataset=lambda seed: ImageDataset(VIT_TASK, seed, DATASET_SIZE),
        batch_size=VIT_BATCH,
    ),
}
