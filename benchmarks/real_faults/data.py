"""Synthetic, learnable data made locally with seeded torch generators (nothing downloaded).

Two tasks, each fixed by a *task seed* (the same for every run, so that two runs with
different run seeds learn the same task) and sampled with a *run seed* (which sets the
examples and their order):

- :class:`MarkovLanguage`: token sequences from a sparse order-1 Markov chain over a small
  vocabulary; in half of the sequences the second half repeats the first half, so that
  attention (copying from far back) pays off as well as the bigram statistics.
- :class:`TemplateImages`: small RGB images, one smooth random template per class, shifted
  by a few pixels, scaled and drowned in Gaussian noise.

Streams (``next()``) feed the plain loops; map-style datasets (``__getitem__``) feed
``transformers.Trainer`` and ``torch.utils.data.DataLoader`` (accelerate). A batch is a
dict of tensors: ``{"input_ids", "labels"}`` (int64, ``(batch, length)``) for tokens,
``{"pixels", "labels"}`` (float32 ``(batch, 3, size, size)``, int64 ``(batch,)``) for
images.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.utils.data import Dataset

__all__ = [
    "Batch",
    "ImageDataset",
    "ImageStream",
    "MarkovLanguage",
    "TemplateImages",
    "TokenDataset",
    "TokenStream",
]

#: A batch of named tensors, as the loss functions of :mod:`.models` take it.
Batch = dict[str, Tensor]


class MarkovLanguage:
    """A token language: sparse order-1 Markov chain, half the sequences copied.

    Every token has ``successors`` possible next tokens, with probabilities
    ``0.55, 0.25, 0.12, 0.08`` (for 4), drawn once from the task seed. A sequence starts
    from a uniform token. With probability ``copy_probability`` its second half repeats
    its first half token for token (a copy a model can only predict through attention).

    Args:
        vocab: vocabulary size (token ids ``0 .. vocab - 1``).
        successors: next tokens possible after each token (at most 4).
        copy_probability: fraction of sequences whose second half copies the first.
        task_seed: seed of the transition table.
    """

    def __init__(
        self,
        vocab: int = 128,
        successors: int = 4,
        copy_probability: float = 0.5,
        task_seed: int = 7_001,
    ) -> None:
        if not 1 <= successors <= 4:
            raise ValueError(f"successors must be 1 to 4, got {successors}")
        generator = torch.Generator().manual_seed(task_seed)
        weights = torch.tensor([0.55, 0.25, 0.12, 0.08])[:successors]
        weights = weights / weights.sum()
        #: (vocab, successors) next-token ids of each token.
        self.next_tokens = torch.stack(
            [torch.randperm(vocab, generator=generator)[:successors] for _ in range(vocab)]
        )
        #: (successors,) cumulative probabilities, shared by all tokens.
        self.cumulative = weights.cumsum(0)
        self.vocab = vocab
        self.copy_probability = copy_probability

    def sample(self, batch: int, length: int, generator: torch.Generator) -> Tensor:
        """``(batch, length)`` int64 token ids drawn with ``generator``."""
        tokens = torch.empty(batch, length, dtype=torch.int64)
        tokens[:, 0] = torch.randint(0, self.vocab, (batch,), generator=generator)
        uniforms = torch.rand(batch, length, generator=generator)
        choices = torch.searchsorted(self.cumulative, uniforms).clamp_(max=len(self.cumulative) - 1)
        for position in range(1, length):
            tokens[:, position] = self.next_tokens[tokens[:, position - 1], choices[:, position]]
        half = length // 2
        copied = torch.rand(batch, generator=generator) < self.copy_probability
        tokens[copied, length - half :] = tokens[copied, :half]
        return tokens


class TokenStream:
    """An endless stream of token batches of one run (``next()``), for a plain loop.

    Args:
        language: the task.
        run_seed: seed of the examples and their order.
        batch: sequences per batch.
        length: tokens per sequence.
    """

    def __init__(self, language: MarkovLanguage, run_seed: int, batch: int, length: int) -> None:
        self.language = language
        self.generator = torch.Generator().manual_seed(10_000 + run_seed)
        self.batch, self.length = batch, length

    def next(self) -> Batch:
        """The next batch: ``input_ids`` and ``labels`` (the same ids: the model shifts)."""
        tokens = self.language.sample(self.batch, self.length, self.generator)
        return {"input_ids": tokens, "labels": tokens}


class TokenDataset(Dataset[Batch]):
    """A fixed set of ``size`` sequences of one run, for ``transformers.Trainer``.

    Items are ``{"input_ids": (length,), "labels": (length,)}``; the Trainer's sampler
    (seeded by ``TrainingArguments.seed``) sets the order.
    """

    def __init__(self, language: MarkovLanguage, run_seed: int, size: int, length: int) -> None:
        generator = torch.Generator().manual_seed(20_000 + run_seed)
        self.tokens = language.sample(size, length, generator)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> Batch:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class TemplateImages:
    """Image classification: a smooth random RGB template per class, shifted, plus noise.

    An image of class ``c`` is ``contrast * roll(template[c], (dy, dx)) + noise`` with
    shifts ``dy, dx`` uniform in ``[-max_shift, max_shift]``, ``contrast`` uniform in
    ``[min_contrast, max_contrast]`` and unit Gaussian noise; templates are 4x4 Gaussian
    patterns upsampled bilinearly to ``size`` x ``size`` and normalised to unit RMS. With
    the default contrast (0.2 to 0.5 of the noise) a small ResNet or ViT is still
    learning after 1,000 steps (loss about 0.15 to 0.2 nats).

    Args:
        classes: number of classes.
        size: image height and width, pixels.
        max_shift: largest shift, pixels.
        min_contrast, max_contrast: range of the template's amplitude (noise RMS is 1).
        task_seed: seed of the templates.
    """

    def __init__(
        self,
        classes: int = 10,
        size: int = 16,
        max_shift: int = 2,
        min_contrast: float = 0.2,
        max_contrast: float = 0.5,
        task_seed: int = 7_002,
    ) -> None:
        generator = torch.Generator().manual_seed(task_seed)
        coarse = torch.randn(classes, 3, 4, 4, generator=generator)
        templates = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
        rms = templates.pow(2).mean(dim=(1, 2, 3), keepdim=True).sqrt()
        #: (classes, 3, size, size) class templates, unit RMS each.
        self.templates = templates / rms
        self.classes, self.size, self.max_shift = classes, size, max_shift
        self.min_contrast, self.max_contrast = min_contrast, max_contrast

    def sample(self, batch: int, generator: torch.Generator) -> Batch:
        """A batch of ``batch`` images and labels drawn with ``generator``."""
        labels = torch.randint(0, self.classes, (batch,), generator=generator)
        shifts = torch.randint(-self.max_shift, self.max_shift + 1, (batch, 2), generator=generator)
        spread = self.max_contrast - self.min_contrast
        contrast = self.min_contrast + spread * torch.rand(batch, 1, 1, 1, generator=generator)
        images = torch.stack(
            [
                torch.roll(self.templates[label], shifts=(int(dy), int(dx)), dims=(1, 2))
                for label, (dy, dx) in zip(labels.tolist(), shifts.tolist(), strict=True)
            ]
        )
        noise = torch.randn(batch, 3, self.size, self.size, generator=generator)
        return {"pixels": contrast * images + noise, "labels": labels}


class ImageStream:
    """An endless stream of image batches of one run (``next()``), for a plain loop."""

    def __init__(self, task: TemplateImages, run_seed: int, batch: int) -> None:
        self.task = task
        self.generator = torch.Generator().manual_seed(30_000 + run_seed)
        self.batch = batch

    def next(self) -> Batch:
        """The next batch: ``pixels`` and ``labels``."""
        return self.task.sample(self.batch, self.generator)


class ImageDataset(Dataset[Batch]):
    """``size`` images of one run, drawn once; items are ``{"pixels": (3, s, s), "labels": ()}``.

    For ``torch.utils.data.DataLoader`` (shuffled by a seeded generator) under accelerate.
    """

    def __init__(self, task: TemplateImages, run_seed: int, size: int) -> None:
        drawn = task.sample(size, torch.Generator().manual_seed(40_000 + run_seed))
        self.pixels, self.labels = drawn["pixels"], drawn["labels"]

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, index: int) -> Batch:
        return {"pixels": self.pixels[index], "labels": self.labels[index]}
