"""Recipes: LightningModules and DataModules for DistilBERT, ViT and ResNet50, each with an embedded default task
(small, for a CPU) and its real dimensions (for a GPU: ``Recipe.sized("real")``).

``RECIPES[name].build(**overrides)`` gives a ``(model, datamodule)`` pair; the YAML configs (``recipes/`` of a
checkout, installed as ``lightning_precision/recipe_configs/``: ``lightning_precision.cli.recipe_configs()``) select
the same classes for ``lightning-precision fit``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

import lightning as L

import lightning_precision._trainer.accelerator  # noqa: F401  (registers accelerator="xpu" with both registries)
from lightning_precision.cli.recipes._base import ClassificationRecipe, training_loss
from lightning_precision.cli.recipes.data import ImageClassificationData, TextClassificationData
from lightning_precision.cli.recipes.text import DistilBertClassifier
from lightning_precision.cli.recipes.vision import ResNet50Classifier, ViTClassifier


@dataclass(frozen=True)
class RealSize:
    """A recipe at its real dimensions (the published network, randomly initialised: nothing is downloaded), and what
    one training step of it holds, which ``lightning-precision compare`` sizes its batch by
    (``cli.compare.sizing``)."""

    name: str  # as the report names it: "ViT-B/16, 224x224"
    model_args: dict[str, Any]
    data_args: dict[str, Any]
    task: str
    parameters: int  # trained parameters (tests/cli/test_compare_sizing.py counts them)
    # Bytes autograd saves for the backward of one fp32 training step, per sample: counted on the meta device (the
    # tensors its saved-tensor hooks see, at batch 2 less batch 1; tests/cli/test_compare_sizing.py recounts them).
    # Attention is counted in its unfused form: a GPU's fused attention saves less (DistilBERT-base counts 49.9 MiB a
    # sample; an H200 measured 37.6 in 32-true, ../shared/GPU.md), so sizing by it errs on the side of room.
    activation_bytes: int


@dataclass(frozen=True)
class Recipe:
    """A model class, a data class and the arguments of their embedded CPU default; ``real``: its real dimensions."""

    name: str
    model: type
    data: type
    model_args: dict[str, Any] = field(default_factory=dict)
    data_args: dict[str, Any] = field(default_factory=dict)
    # The learning task of the embedded default, and its chance accuracy.
    task: str = ""
    chance: float = 0.0
    # What throughput counts: "tokens" (every position of the padded sequences, what the model computes, as MFU
    # counts it) or "images".
    unit: str = "samples"
    real: RealSize | None = None

    def sized(self, size: Literal["embedded", "real"]) -> Recipe:
        """This recipe at ``size``: ``"embedded"`` (itself, the CPU default) or ``"real"`` (its real dimensions' model,
        data and task, everything else the same)."""
        if size == "embedded":
            return self
        if size != "real" or self.real is None:
            sizes = "'embedded' or 'real'" if self.real is not None else "'embedded' (it has no real dimensions)"
            raise ValueError(f"`RECIPES[{self.name!r}].sized({size!r})`: use {sizes}.")
        real = self.real
        return dataclasses.replace(self, model_args=real.model_args, data_args=real.data_args, task=real.task)

    def units(self, batch: Any) -> int:
        """How many ``unit`` one batch holds: its inputs' elements up to the sequence (tokens) or its first dim."""
        inputs = batch[0]
        return int(inputs.numel()) if self.unit == "tokens" else int(inputs.shape[0])

    def build(self, model_args: dict[str, Any] | None = None,
              data_args: dict[str, Any] | None = None) -> tuple[ClassificationRecipe, L.LightningDataModule]:
        model = self.model(**{**self.model_args, **(model_args or {})})
        return model, self.data(**{**self.data_args, **(data_args or {})})

    def training_batches(self, n: int,
                         data_args: dict[str, Any] | None = None) -> tuple[ClassificationRecipe, list[Any]]:
        """The model and the first ``n`` training batches of its data: what measuring before a fit needs (``plan``,
        ``compare``'s FLOPs per step)."""
        import itertools

        model, data = self.build(data_args=data_args)
        data.prepare_data()
        data.setup("fit")
        return model, list(itertools.islice(iter(data.train_dataloader()), n))


# The real image recipes' data: 224x224 RGB gratings, made as they are read (2.3 GiB up front)
_REAL_IMAGES = {"image_size": 224, "channels": 3, "num_classes": 10, "on_the_fly": True}

RECIPES: dict[str, Recipe] = {
    "distilbert": Recipe(
        "distilbert", DistilBertClassifier, TextClassificationData,
        {"size": "tiny"}, {"max_length": 48, "batch_size": 32, "num_samples": 4096},
        "sentiment of generated movie reviews (2 classes)", 0.5, "tokens",
        real=RealSize("DistilBERT-base, 128 tokens", {"size": "base"},
                      {"max_length": 128, "batch_size": 32, "num_samples": 4096},
                      "sentiment of generated movie reviews, 128 tokens (2 classes)", 66_955_010, 52_324_368),
    ),
    "vit": Recipe(
        "vit", ViTClassifier, ImageClassificationData,
        {"size": "tiny", "num_classes": 10, "channels": 3}, {"image_size": 32, "channels": 3, "num_classes": 10},
        "orientation of generated gratings, 32x32 RGB (10 classes)", 0.1, "images",
        real=RealSize("ViT-B/16, 224x224", {"size": "b16", "num_classes": 10, "channels": 3}, _REAL_IMAGES,
                      "orientation of generated gratings, 224x224 RGB (10 classes)", 85_806_346, 162_153_112),
    ),
    "resnet50": Recipe(
        "resnet50", ResNet50Classifier, ImageClassificationData,
        {"size": "tiny", "num_classes": 10, "channels": 1}, {"image_size": 28, "channels": 1, "num_classes": 10},
        "orientation of generated gratings, FashionMNIST-shaped 1x28x28 (10 classes)", 0.1, "images",
        real=RealSize("ResNet50, 224x224", {"size": "full", "num_classes": 10, "channels": 3}, _REAL_IMAGES,
                      "orientation of generated gratings, 224x224 RGB (10 classes)", 23_528_522, 85_909_552),
    ),
}

__all__ = [
    "RECIPES",
    "DistilBertClassifier",
    "ImageClassificationData",
    "RealSize",
    "Recipe",
    "ResNet50Classifier",
    "TextClassificationData",
    "ViTClassifier",
    "training_loss",
]
