"""Recipes: LightningModules and DataModules for DistilBERT, ViT and ResNet50, each with an embedded default task.

``RECIPES[name].build(**overrides)`` gives a ``(model, datamodule)`` pair; the YAML configs (``recipes/`` of a
checkout, installed as ``lightning_precision/recipe_configs/``: ``lightning_precision.cli.recipe_configs()``) select
the same classes for ``lightning-precision fit``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import lightning as L

import lightning_precision._trainer.accelerator  # noqa: F401  (registers accelerator="xpu" with both registries)
from lightning_precision.cli.recipes._base import ClassificationRecipe, training_loss
from lightning_precision.cli.recipes.data import ImageClassificationData, TextClassificationData
from lightning_precision.cli.recipes.text import DistilBertClassifier
from lightning_precision.cli.recipes.vision import ResNet50Classifier, ViTClassifier


@dataclass(frozen=True)
class Recipe:
    """A model class, a data class and the arguments of their embedded CPU default."""

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


RECIPES: dict[str, Recipe] = {
    "distilbert": Recipe(
        "distilbert", DistilBertClassifier, TextClassificationData,
        {"size": "tiny"}, {"max_length": 48, "batch_size": 32, "num_samples": 4096},
        "sentiment of generated movie reviews (2 classes)", 0.5, "tokens",
    ),
    "vit": Recipe(
        "vit", ViTClassifier, ImageClassificationData,
        {"size": "tiny", "num_classes": 10, "channels": 3}, {"image_size": 32, "channels": 3, "num_classes": 10},
        "orientation of generated gratings, 32x32 RGB (10 classes)", 0.1, "images",
    ),
    "resnet50": Recipe(
        "resnet50", ResNet50Classifier, ImageClassificationData,
        {"size": "tiny", "num_classes": 10, "channels": 1}, {"image_size": 28, "channels": 1, "num_classes": 10},
        "orientation of generated gratings, FashionMNIST-shaped 1x28x28 (10 classes)", 0.1, "images",
    ),
}

__all__ = [
    "RECIPES",
    "DistilBertClassifier",
    "ImageClassificationData",
    "Recipe",
    "ResNet50Classifier",
    "TextClassificationData",
    "ViTClassifier",
    "training_loss",
]
