"""Recipes on CPU: real fast_dev_run fits with every plugin, the embedded tasks learn, the real-data loaders read
their formats (from small files the tests write), and a pretrained model is honoured from a local path."""

import gzip
import struct
import warnings

import lightning as L
import pytest
import torch

from lightning_precision import (
    BF16MixedPrecision,
    BF16TruePrecision,
    FP8Precision,
    FP16MixedPrecision,
    FP16TruePrecision,
)
from lightning_precision.cli.recipes import (
    RECIPES,
    DistilBertClassifier,
    ImageClassificationData,
    TextClassificationData,
)
from lightning_precision.cli.recipes.data import _build_tokenizer, _synthetic_reviews

SMALL = {"distilbert": {"num_samples": 256}, "vit": {"num_samples": 256}, "resnet50": {"num_samples": 256}}


def plugins():
    return [None, BF16MixedPrecision(), FP16MixedPrecision(), FP8Precision(emulate=True, skip_small_layers=False)]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("plugin_index", range(4), ids=["32-true", "bf16", "fp16", "fp8-emulated"])
def test_fast_dev_run_with_each_plugin(name, plugin_index):
    plugin = plugins()[plugin_index]
    model, data = RECIPES[name].build(data_args=SMALL[name])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", fast_dev_run=True, plugins=[plugin] if plugin else None, logger=False,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(model, data)
    assert trainer.state.finished
    assert torch.isfinite(trainer.callback_metrics["train_loss"])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["distilbert", "vit"])
@pytest.mark.parametrize(("plugin_class", "dtype"), [(BF16TruePrecision, torch.bfloat16),
                                                     (FP16TruePrecision, torch.float16)], ids=["bf16-true", "16-true"])
def test_the_true_precisions_train_the_transformer_recipes(name, plugin_class, dtype):
    """What `compare`'s bf16-true and 16-true rows and the precision-bf16-true config run: every weight in the 16-bit
    dtype (DistilBERT's attention mask and embeddings, ViT's class token included), a finite loss, and steps that move
    the weights."""
    model, data = RECIPES[name].build(data_args=SMALL[name])
    before = {n: p.detach().to(dtype) for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = L.Trainer(accelerator="cpu", max_steps=3, limit_val_batches=0, plugins=[plugin_class()],
                            logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(model, data)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    assert trainer.precision_plugin.skipped_steps < 3  # fp16's scaler may skip its first step, not every one
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) > len(before) // 2


@pytest.mark.parametrize("name", list(RECIPES))
def test_embedded_task_is_learned(name):
    """A short fit beats chance clearly: the generated tasks carry real signal (no random labels)."""
    L.seed_everything(0)
    spec = RECIPES[name]
    model, data = spec.build()
    trainer = L.Trainer(accelerator="cpu", max_steps=120, limit_val_batches=8, val_check_interval=120, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0)
    trainer.fit(model, data)
    assert float(trainer.callback_metrics["val_acc"]) > spec.chance + 0.25


def test_synthetic_reviews_labels_follow_the_words():
    texts, labels = _synthetic_reviews(200, seed=3)
    for text, label in zip(texts, labels, strict=True):
        pos = sum(w in "good great excellent wonderful superb lovely brilliant enjoyable delightful moving charming fine".split() for w in text.split())
        neg = len([w for w in text.split() if w in "bad awful terrible boring dull poor weak horrible tedious messy bland clumsy".split()])
        assert label == int(pos > neg) and pos != neg
    assert 0.3 < sum(labels) / len(labels) < 0.7


def test_aclimdb_folder_and_a_local_tokenizer_path(tmp_path):
    for split in ("train", "test"):
        for folder, text in (("pos", "a wonderful film"), ("neg", "a dull boring film")):
            (tmp_path / "imdb" / split / folder).mkdir(parents=True)
            for i in range(3):
                (tmp_path / "imdb" / split / folder / f"{i}_7.txt").write_text(f"{text} {i}")
    _build_tokenizer(["a wonderful dull boring film"]).save_pretrained(tmp_path / "tok")
    data = TextClassificationData(data_dir=str(tmp_path / "imdb"), tokenizer=str(tmp_path / "tok"), max_length=8,
                                  batch_size=4)
    data.setup("fit")
    ids, mask, labels = next(iter(data.train_dataloader()))
    assert ids.shape == (4, 8) and len(data._train) == 6 and set(data._train.tensors[2].tolist()) == {0, 1}
    assert data.tokenizer.convert_ids_to_tokens(int(data._train.tensors[0][0, 1])) == "wonderful"
    with pytest.raises(FileNotFoundError, match="aclImdb layout"):
        TextClassificationData(data_dir=str(tmp_path / "missing")).setup("fit")


def test_pretrained_is_honoured_from_a_local_path(tmp_path):
    original = DistilBertClassifier(size="tiny")
    original.net.save_pretrained(tmp_path / "model")
    loaded = DistilBertClassifier(pretrained=str(tmp_path / "model"))
    for a, b in zip(original.net.state_dict().values(), loaded.net.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)


def _write_idx(path, data: torch.Tensor, labels: bool):
    header = struct.pack(">II", 2049, len(data)) if labels else struct.pack(">IIII", 2051, *data.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + bytes(data.to(torch.uint8).flatten().tolist()))


def test_fashion_mnist_from_raw_idx_files(tmp_path):
    raw = tmp_path / "FashionMNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", 6), ("t10k", 4)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte.gz", torch.randint(0, 255, (n, 28, 28)), labels=False)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte.gz", torch.arange(n) % 10, labels=True)
    data = ImageClassificationData(dataset="fashion_mnist", data_dir=str(tmp_path), channels=1, batch_size=2)
    data.setup("fit")
    x, y = next(iter(data.val_dataloader()))
    assert x.shape == (4, 1, 28, 28) and y.tolist() == [0, 1, 2, 3] and len(data._train) == 6
    with pytest.raises(FileNotFoundError, match="download=True"):
        ImageClassificationData(dataset="fashion_mnist", data_dir=str(tmp_path / "none")).setup("fit")


def test_image_folder(tmp_path):
    from PIL import Image

    for cls, color in (("cats", 200), ("dogs", 30)):
        (tmp_path / cls).mkdir()
        for i in range(2):
            Image.new("RGB", (40, 30), (color, color, color)).save(tmp_path / cls / f"{i}.png")
    data = ImageClassificationData(data_dir=str(tmp_path), image_size=16, channels=3, batch_size=4)
    data.setup("fit")
    x, y = next(iter(data.val_dataloader()))
    assert x.shape == (4, 3, 16, 16) and data.num_classes == 2 and sorted(y.tolist()) == [0, 0, 1, 1]


def test_large_generated_images_are_made_as_they_are_read():
    """The real image recipes' 224x224 RGB gratings: made a batch at a time from per-index draws (2.3 GiB up front for
    4096 of them), each index always the same image, the grating the one ``_synthetic_images`` draws for the same
    draws; the embedded sizes are made up front as before."""
    from lightning_precision.cli.recipes.data import GeneratedImages, _synthetic_images

    data = ImageClassificationData(image_size=224, channels=3, batch_size=8)
    data.setup("fit")
    train = data._train
    assert isinstance(train, GeneratedImages) and len(train) == 4096
    held = sum(t.numel() * t.element_size() for t in vars(train).values() if isinstance(t, torch.Tensor))
    assert held < 20 * 2**20  # 64 noise fields and a few numbers an image, not 4096 images
    x, y = next(iter(data.train_dataloader()))
    assert x.shape == (8, 3, 224, 224) and x.dtype == torch.float32 and y.shape == (8,)
    assert torch.equal(train[5][0], train.__getitems__([3, 5])[0][1])  # an index is its image, in any batch
    assert torch.equal(x[:, 0], x[:, 2])  # the same grating in every channel, as the embedded images
    coords = torch.linspace(-1, 1, 224)
    yy, xx = torch.meshgrid(coords, coords, indexing="ij")
    angle = train.labels[5].float() * torch.pi / 10
    grating = torch.sin(train.freq[5] * torch.pi * (xx * torch.cos(angle) + yy * torch.sin(angle)) + train.phase[5])
    expected = grating * train.contrast[5] + train.noise[train.plane[5]]
    torch.testing.assert_close(train[5][0][0], expected, atol=1e-5, rtol=0)
    small = ImageClassificationData(num_samples=256)
    small.setup("fit")
    assert torch.equal(small._train.tensors[0], _synthetic_images(256, 32, 3, 10, 0).tensors[0])
