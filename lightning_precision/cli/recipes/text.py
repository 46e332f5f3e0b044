"""DistilBERT sequence classification (Hugging Face transformers), built from a config; pretrained weights only
when a name or local path is given."""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from lightning_precision import _imports
from lightning_precision.cli.recipes._base import ClassificationRecipe

__all__ = ["DistilBertClassifier", "SIZES"]

# "tiny" trains on a 2-core CPU in seconds; "base" is distilbert-base's shape (66M parameters).
SIZES = {
    "tiny": dict(dim=64, n_layers=2, n_heads=2, hidden_dim=256, max_position_embeddings=128),
    "base": dict(dim=768, n_layers=6, n_heads=12, hidden_dim=3072, max_position_embeddings=512),
}


class DistilBertClassifier(ClassificationRecipe):
    """DistilBERT for sequence classification; batches are ``(input_ids, attention_mask, labels)``.

    Args:
        size: ``"tiny"`` or ``"base"`` (ignored with ``pretrained``).
        pretrained: a Hugging Face model name or local path (``from_pretrained``: downloads only if it is a name and
            not cached). ``None`` builds the model from a config, randomly initialised.
        num_labels: classes.
        vocab_size: embedding rows; 30522 (distilbert-base-uncased's) fits the tokenizers of ``TextClassificationData``.
        lr: AdamW learning rate.
    """

    def __init__(
        self,
        size: Literal["tiny", "base"] = "tiny",
        pretrained: str | None = None,
        num_labels: int = 2,
        vocab_size: int = 30522,
        lr: float = 5e-4,
    ) -> None:
        super().__init__(num_labels, lr)
        self.save_hyperparameters()
        _imports.require(_imports.TRANSFORMERS_AVAILABLE, "transformers", "The DistilBERT recipe")
        with _imports.quiet_known_noise():  # transformers imports torchao (its quantizer) whenever it is installed
            from transformers import DistilBertConfig, DistilBertForSequenceClassification

        if size not in SIZES:
            raise ValueError(f"`DistilBertClassifier(size={size!r})`: use one of {list(SIZES)}.")
        if pretrained is not None:
            self.net = DistilBertForSequenceClassification.from_pretrained(pretrained, num_labels=num_labels)
        else:
            config_args: dict[str, Any] = {"vocab_size": vocab_size, "num_labels": num_labels, "dropout": 0.0,
                                           "attention_dropout": 0.0, **SIZES[size]}
            config = DistilBertConfig(**config_args)
            self.net = DistilBertForSequenceClassification(config)

    def logits(self, batch: Any) -> Tensor:
        input_ids, attention_mask = batch[0], batch[1]
        return self.net(input_ids=input_ids, attention_mask=attention_mask).logits
