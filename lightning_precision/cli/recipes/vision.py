"""ViT image classification and ResNet50 (the classic AMP study), built in: torchvision is optional.

torchvision's own models (and its pretrained weights) are used when ``pretrained=True`` and torchvision imports; the
built-in networks follow the same architectures so that the recipes run where torchvision cannot (the CPU torch build
of this project's machines has no matching torchvision wheel).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from lightning_precision import _imports
from lightning_precision.cli.recipes._base import ClassificationRecipe

__all__ = ["Bottleneck", "ImageClassifier", "ResNet50Classifier", "VIT_SIZES", "ViT", "ViTClassifier", "resnet",
           "resnet50"]

VIT_SIZES = {
    # name: (image_size, patch, dim, depth, heads, mlp_dim)
    "tiny": (32, 4, 64, 2, 4, 128),
    "b16": (224, 16, 768, 12, 12, 3072),
    "l16": (224, 16, 1024, 24, 16, 4096),
}


class ViT(nn.Module):
    """Vision Transformer (Dosovitskiy et al. 2021): patch embedding, class token, pre-norm encoder, linear head."""

    def __init__(self, image_size: int, patch: int, dim: int, depth: int, heads: int, mlp_dim: int, channels: int,
                 num_classes: int) -> None:
        super().__init__()
        if image_size % patch:
            raise ValueError(f"ViT: image_size {image_size} is not a multiple of the patch size {patch}.")
        self.patch_embed = nn.Conv2d(channels, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image_size // patch) ** 2 + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, mlp_dim, dropout=0.0, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patch_embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls_token.expand(len(x), -1, -1), tokens], dim=1) + self.pos_embed
        return self.head(self.norm(self.encoder(tokens))[:, 0])


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.relu(self.body(x) + self.down(x))


def resnet(block: type[nn.Module], depths: tuple[int, ...], num_classes: int = 10, base_width: int = 64,
           channels: int = 3) -> nn.Module:
    """torchvision's ResNet layout: a 7x7 stem and max-pool, stages of ``depths`` blocks whose width doubles from
    ``base_width`` (the first block of every stage after the first halves the resolution), pooling, a linear head.
    ``block(cin, width, stride)`` outputs ``width * block.expansion`` channels."""
    layers: list[nn.Module] = [nn.Conv2d(channels, base_width, 7, 2, 3, bias=False), nn.BatchNorm2d(base_width),
                               nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)]
    cin = base_width
    expansion = int(getattr(block, "expansion", 1))
    for i, depth in enumerate(depths):
        width = base_width * 2**i
        for b in range(depth):
            layers.append(block(cin, width, 2 if b == 0 and i > 0 else 1))
            cin = width * expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes)]
    return nn.Sequential(*layers)


def resnet50(channels: int, num_classes: int, base_width: int = 64) -> nn.Module:
    """ResNet50 (He et al. 2016): bottleneck stages of 3, 4, 6, 3 blocks; ``base_width`` 64 is the standard network."""
    return resnet(Bottleneck, (3, 4, 6, 3), num_classes, base_width, channels)


def _torchvision_model(name: str, num_classes: int) -> nn.Module:
    torchvision = _imports.import_torchvision(f"`pretrained=True` needs torchvision's weights for {name}",
                                              "pass pretrained=False")
    model = getattr(torchvision.models, name)(weights="DEFAULT")
    head = "heads" if name.startswith("vit") else "fc"
    old = model.heads.head if head == "heads" else model.fc
    new = nn.Linear(old.in_features, num_classes)
    if head == "heads":
        model.heads.head = new
    else:
        model.fc = new
    return model


class ImageClassifier(ClassificationRecipe):
    """Batches are ``(images, labels)``."""

    def logits(self, batch: Any) -> Tensor:
        return self.net(batch[0])


class ViTClassifier(ImageClassifier):
    """ViT finetuning: ``size`` ``"tiny"`` (32x32 images, for CPU), ``"b16"`` or ``"l16"`` (224x224);
    ``pretrained=True`` loads torchvision's ImageNet weights (b16 and l16) and replaces the head."""

    def __init__(self, size: Literal["tiny", "b16", "l16"] = "tiny", num_classes: int = 10, channels: int = 3,
                 pretrained: bool = False, lr: float = 1e-3) -> None:
        super().__init__(num_classes, lr)
        self.save_hyperparameters()
        if size not in VIT_SIZES:
            raise ValueError(f"`ViTClassifier(size={size!r})`: use one of {list(VIT_SIZES)}.")
        if pretrained:
            if size == "tiny":
                raise ValueError("`ViTClassifier(size='tiny', pretrained=True)`: torchvision has weights for b16, l16.")
            self.net = _torchvision_model(f"vit_{size[0]}_{size[1:]}", num_classes)
        else:
            self.net = ViT(*VIT_SIZES[size], channels=channels, num_classes=num_classes)
        self.image_size = VIT_SIZES[size][0]


class ResNet50Classifier(ImageClassifier):
    """ResNet50 on FashionMNIST-shaped data (1x28x28, 10 classes) as in the classic AMP study; ``size="tiny"``
    (base width 16) for CPU, ``"full"`` (64) for the real network; ``pretrained=True`` loads torchvision's weights
    (3 channels)."""

    def __init__(self, size: Literal["tiny", "full"] = "tiny", num_classes: int = 10, channels: int = 1,
                 pretrained: bool = False, lr: float = 1e-3) -> None:
        super().__init__(num_classes, lr)
        self.save_hyperparameters()
        widths = {"tiny": 16, "full": 64}
        if size not in widths:
            raise ValueError(f"`ResNet50Classifier(size={size!r})`: use one of {list(widths)}.")
        self.net = (_torchvision_model("resnet50", num_classes) if pretrained
                    else resnet50(channels, num_classes, widths[size]))
