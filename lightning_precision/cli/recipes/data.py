"""Data for the recipes: real datasets from local folders (downloads only when asked), and embedded defaults that the
package generates, small but learnable, so every recipe runs offline on a CPU."""

from __future__ import annotations

import gzip
import random
import struct
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_precision import _imports

__all__ = ["GeneratedImages", "ImageClassificationData", "TextClassificationData"]

# ---- embedded text task ----------------------------------------------------------------------------------------------

_POSITIVE = "good great excellent wonderful superb lovely brilliant enjoyable delightful moving charming fine".split()
_NEGATIVE = "bad awful terrible boring dull poor weak horrible tedious messy bland clumsy".split()
_NEUTRAL = ("the a film movie story plot actor actress scene music camera it was is and but with of this that very "
            "quite rather really ending script cast director").split()


def _synthetic_reviews(n: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """Movie-review-like sentences: filler words with sentiment words; label 1 when positive words outnumber negative
    ones (never tied). Learnable, and only from the words' meaning: chance is 50%."""
    rng = random.Random(seed)
    texts, labels = [], []
    for _ in range(n):
        pos, neg = rng.randint(0, 4), rng.randint(0, 4)
        if pos == neg:
            pos += 1
        words = (rng.choices(_NEUTRAL, k=rng.randint(8, 24)) + rng.choices(_POSITIVE, k=pos)
                 + rng.choices(_NEGATIVE, k=neg))
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(int(pos > neg))
    return texts, labels


def _build_tokenizer(texts: list[str], max_vocab: int = 30522) -> Any:
    """A word-level tokenizer trained here on ``texts`` (no hub download), as a transformers tokenizer."""
    _imports.require(_imports.TRANSFORMERS_AVAILABLE, "transformers", "The text recipe's tokenizer")
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(vocab_size=max_vocab, special_tokens=special))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


def _read_aclimdb(root: str, split: str) -> tuple[list[str], list[int]]:
    """The IMDB ``aclImdb`` folder layout: ``<root>/<split>/{pos,neg}/*.txt``."""
    texts, labels = [], []
    for label, folder in ((1, "pos"), (0, "neg")):
        path = Path(root) / split / folder
        if not path.is_dir():
            raise FileNotFoundError(f"No IMDB folder {path}: expected the aclImdb layout <root>/{split}/pos, .../neg.")
        for file in sorted(path.glob("*.txt")):
            texts.append(file.read_text(encoding="utf-8"))
            labels.append(label)
    return texts, labels


class _TensorData(L.LightningDataModule):
    """Loaders over the ``_train``/``_val`` tensor datasets a subclass builds in ``setup``; shuffled with the seed."""

    _train: Dataset | None
    _val: Dataset

    def train_dataloader(self) -> DataLoader:
        if self._train is None:
            raise RuntimeError(f"{type(self).__name__}: no training data; call setup('fit') first")
        g = torch.Generator().manual_seed(self.hparams["seed"])
        return DataLoader(self._train, batch_size=self.hparams["batch_size"], shuffle=True, generator=g,
                          num_workers=self.hparams["num_workers"], collate_fn=getattr(self._train, "collate", None))

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._val, batch_size=self.hparams["batch_size"] * 2, num_workers=self.hparams["num_workers"],
                          collate_fn=getattr(self._val, "collate", None))


class TextClassificationData(_TensorData):
    """Batches ``(input_ids, attention_mask, labels)``.

    Sources, first that is set: ``data_dir`` (IMDB's aclImdb layout), ``hf_dataset`` (a Hugging Face dataset name with
    ``text`` and ``label`` columns: downloaded by the ``datasets`` package, only because you asked), else the embedded
    synthetic reviews. Tokenizer: ``tokenizer`` (a Hugging Face name or path, e.g. the pretrained model's), else one
    trained here on the training texts.
    """

    def __init__(self, data_dir: str | None = None, hf_dataset: str | None = None, tokenizer: str | None = None,
                 max_length: int = 64, batch_size: int = 32, num_samples: int = 4096, num_workers: int = 0,
                 seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.num_classes = 2
        self._train: TensorDataset | None = None

    def _texts(self) -> tuple[tuple[list[str], list[int]], tuple[list[str], list[int]]]:
        h = self.hparams
        if h["data_dir"] is not None:
            return _read_aclimdb(h["data_dir"], "train"), _read_aclimdb(h["data_dir"], "test")
        if h["hf_dataset"] is not None:
            _imports.require(_imports.DATASETS_AVAILABLE, "datasets", "`TextClassificationData(hf_dataset=...)`")
            import datasets

            ds = datasets.load_dataset(h["hf_dataset"])
            train, test = ds["train"], ds["test"]
            return (list(train["text"]), list(train["label"])), (list(test["text"]), list(test["label"]))
        n_val = max(h["num_samples"] // 4, 64)
        return _synthetic_reviews(h["num_samples"], h["seed"]), _synthetic_reviews(n_val, h["seed"] + 1)

    def setup(self, stage: str) -> None:
        if self._train is not None:
            return
        (train_x, train_y), (val_x, val_y) = self._texts()
        if self.hparams["tokenizer"] is not None:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.hparams["tokenizer"])
        else:
            self.tokenizer = _build_tokenizer(train_x)
        self._train, self._val = self._encode(train_x, train_y), self._encode(val_x, val_y)

    def _encode(self, texts: list[str], labels: list[int]) -> TensorDataset:
        enc = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.hparams["max_length"],
                             return_tensors="pt")
        return TensorDataset(enc["input_ids"], enc["attention_mask"], torch.tensor(labels))


# ---- images ----------------------------------------------------------------------------------------------------------


def _synthetic_images(n: int, size: int, channels: int, num_classes: int, seed: int = 0) -> TensorDataset:
    """Oriented gratings in noise: class k is a sinusoidal grating at angle k * pi / num_classes with a random phase,
    contrast and position of a bright blob. Learnable (orientation is visible) and not from a trivial pixel: chance is
    1 / num_classes."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, num_classes, (n,), generator=g)
    coords = torch.linspace(-1, 1, size)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    angle = labels.float() * torch.pi / num_classes
    phase = torch.rand(n, generator=g) * 2 * torch.pi
    freq = 3.0 + torch.rand(n, generator=g) * 2
    proj = xx[None] * torch.cos(angle)[:, None, None] + yy[None] * torch.sin(angle)[:, None, None]
    grating = torch.sin(freq[:, None, None] * torch.pi * proj + phase[:, None, None])
    contrast = 0.5 + torch.rand(n, 1, 1, generator=g)
    images = grating * contrast + 0.8 * torch.randn(n, size, size, generator=g)
    images = images[:, None].expand(n, channels, size, size).contiguous()
    return TensorDataset(images, labels)


# Above this many bytes the generated set is made as it is read (``GeneratedImages``): 4096 images of 224x224 RGB would
# take 2.3 GiB in every precision's process. The embedded defaults (50 MB, 13 MB) are made up front, as they always
# were.
ON_THE_FLY_BYTES = 256 * 2**20
NOISE_PLANES = 64  # the noise fields ``GeneratedImages`` draws once and shares among its images


class GeneratedImages(Dataset):
    """``_synthetic_images``'s gratings, made as they are read, a batch at a time (the DataLoader calls
    ``__getitems__``; ``collate`` passes its batch through): what a large image size needs, where the whole set would
    not fit in memory. Index ``i`` is always the same image: its label, phase, frequency and contrast are drawn once per
    index from the seed, and its noise is one of ``NOISE_PLANES`` fields drawn once (a field shared by images of every
    class carries no label: orientation stays the only signal). Not the same draws as ``_synthetic_images``: the same
    task, other samples."""

    def __init__(self, n: int, size: int, channels: int, num_classes: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (n,), generator=g)
        self.phase = torch.rand(n, generator=g) * 2 * torch.pi
        self.freq = 3.0 + torch.rand(n, generator=g) * 2
        self.contrast = 0.5 + torch.rand(n, generator=g)
        self.plane = torch.randint(0, NOISE_PLANES, (n,), generator=g)
        self.noise = 0.8 * torch.randn(NOISE_PLANES, size, size, generator=g)
        self.coords = torch.linspace(-1, 1, size)
        self.channels, self.num_classes = channels, num_classes

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        images, labels = self.__getitems__([index])
        return images[0], labels[0]

    def __getitems__(self, indices: list[int]) -> list[Tensor]:
        i = torch.as_tensor(indices, dtype=torch.long)
        angle = self.labels[i].float() * torch.pi / self.num_classes
        freq = self.freq[i] * torch.pi
        a, b = (freq * torch.cos(angle))[:, None], (freq * torch.sin(angle))[:, None]
        # sin(a x + b y + phase) = sin(a x + phase) cos(b y) + cos(a x + phase) sin(b y): one (rows x 2) @ (2 x columns)
        # product per image, added to its noise in one call, instead of a sine of every pixel
        ax, by = a * self.coords + self.phase[i][:, None], b * self.coords
        rows = torch.stack([torch.cos(by), torch.sin(by)], 2) * self.contrast[i][:, None, None]
        images = torch.baddbmm(self.noise[self.plane[i]], rows, torch.stack([torch.sin(ax), torch.cos(ax)], 1))
        return [images[:, None].expand(-1, self.channels, -1, -1).contiguous(), self.labels[i]]

    @staticmethod
    def collate(batch: list[Tensor]) -> list[Tensor]:
        return batch


def _read_fashion_mnist(root: str, train: bool) -> TensorDataset:
    """FashionMNIST from its raw idx files (``train-images-idx3-ubyte[.gz]`` ...) under ``root`` or
    ``root/FashionMNIST/raw`` (where torchvision puts them): no torchvision needed."""
    prefix = "train" if train else "t10k"
    for folder in (Path(root), Path(root) / "FashionMNIST" / "raw"):
        for suffix in ("", ".gz"):
            images = folder / f"{prefix}-images-idx3-ubyte{suffix}"
            labels = folder / f"{prefix}-labels-idx1-ubyte{suffix}"
            if images.exists() and labels.exists():
                opener = gzip.open if suffix else open
                with opener(images, "rb") as f:
                    _, n, rows, cols = struct.unpack(">IIII", f.read(16))
                    x = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).view(n, 1, rows, cols)
                with opener(labels, "rb") as f:
                    f.read(8)
                    y = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
                return TensorDataset((x.float() / 255 - 0.2860) / 0.3530, y)
    raise FileNotFoundError(
        f"No FashionMNIST idx files under {root} (or {root}/FashionMNIST/raw). Pass `download=True` to fetch them with"
        " torchvision, or put the four files there."
    )


def _read_image_folder(root: str, size: int, channels: int) -> tuple[TensorDataset, list[str]]:
    """Any ``ImageFolder`` layout (``<root>/<class>/<image>``), read with Pillow and resized to ``size``."""
    from PIL import Image

    classes = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
    if not classes:
        raise FileNotFoundError(f"No class folders under {root}: expected <root>/<class>/<image files>.")
    xs, ys = [], []
    for label, name in enumerate(classes):
        for file in sorted((Path(root) / name).iterdir()):
            if file.suffix.lower() not in (".png", ".jpg", ".jpeg", ".bmp", ".webp"):
                continue
            image = Image.open(file).convert("L" if channels == 1 else "RGB").resize((size, size))
            t = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(size, size, channels)
            xs.append(t.permute(2, 0, 1).float() / 255 * 2 - 1)
            ys.append(label)
    return TensorDataset(torch.stack(xs), torch.tensor(ys)), classes


class ImageClassificationData(_TensorData):
    """Batches ``(images, labels)``.

    Sources: ``dataset="fashion_mnist"`` with ``data_dir`` (raw idx files; ``download=True`` fetches them with
    torchvision, only when asked), ``data_dir`` alone (an ImageFolder layout, ``data_dir/train`` and ``data_dir/val``
    if present), else embedded synthetic gratings of ``image_size`` x ``image_size`` with ``channels`` channels, made
    up front, or as they are read with ``on_the_fly=True`` (``GeneratedImages``; ``None``: where the whole set would
    take more than ``ON_THE_FLY_BYTES``, 256 MiB, as 224x224 RGB images do).
    """

    def __init__(self, data_dir: str | None = None, dataset: str | None = None, download: bool = False,
                 image_size: int = 32, channels: int = 3, num_classes: int = 10, batch_size: int = 32,
                 num_samples: int = 4096, num_workers: int = 0, seed: int = 0, on_the_fly: bool | None = None) -> None:
        super().__init__()
        if dataset not in (None, "fashion_mnist"):
            raise ValueError(f"`ImageClassificationData(dataset={dataset!r})`: use 'fashion_mnist', or data_dir alone.")
        self.save_hyperparameters()
        self.num_classes = num_classes
        self._train: Dataset | None = None

    def setup(self, stage: str) -> None:
        if self._train is not None:
            return
        h = self.hparams
        if h["dataset"] == "fashion_mnist":
            if h["data_dir"] is None:
                raise ValueError("`ImageClassificationData(dataset='fashion_mnist')` needs `data_dir`.")
            if h["download"]:
                torchvision = _imports.import_torchvision(
                    "`ImageClassificationData(download=True)` downloads FashionMNIST with torchvision",
                    "put the four idx files under data_dir")
                for train in (True, False):
                    torchvision.datasets.FashionMNIST(h["data_dir"], train=train, download=True)
            self._train, self._val = _read_fashion_mnist(h["data_dir"], True), _read_fashion_mnist(h["data_dir"], False)
        elif h["data_dir"] is not None:
            root = Path(h["data_dir"])
            if (root / "train").is_dir():
                self._train, classes = _read_image_folder(str(root / "train"), h["image_size"], h["channels"])
                self._val = (_read_image_folder(str(root / "val"), h["image_size"], h["channels"])[0]
                             if (root / "val").is_dir() else self._train)
            else:
                self._train, classes = _read_image_folder(h["data_dir"], h["image_size"], h["channels"])
                self._val = self._train
            self.num_classes = len(classes)
        else:
            n_val = max(h["num_samples"] // 4, 64)
            lazy = h["on_the_fly"]
            if lazy is None:
                lazy = h["num_samples"] * h["channels"] * h["image_size"] ** 2 * 4 > ON_THE_FLY_BYTES
            make = GeneratedImages if lazy else _synthetic_images
            self._train = make(h["num_samples"], h["image_size"], h["channels"], h["num_classes"], h["seed"])
            self._val = make(n_val, h["image_size"], h["channels"], h["num_classes"], h["seed"] + 1)
