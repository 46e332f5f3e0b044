"""ChannelsLast and its pure functions on real models and a real fit."""

import lightning as L
import pytest
import torch
from torch import nn

from lightning_precision import NoEffectWarning
from lightning_precision.callbacks import ChannelsLast
from lightning_precision.callbacks.channels_last import is_channels_last
from lightning_precision.functional import apply_channels_last, to_channels_last
from tests.helpers import trainer


def conv2d_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))


class Mixed(nn.Module):
    """A 3-d stem over a clip, then 2-d convolutions over its pooled frames: `model.to(channels_last)` raises here."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv3d(3, 4, 3, padding=1)
        self.head = conv2d_net()
        self.head[0] = nn.Conv2d(4, 8, 3, padding=1)

    def forward(self, clip):
        return self.head(self.stem(clip).mean(dim=2))


def test_apply_channels_last_converts_2d_and_3d_weights_per_module():
    model = Mixed()
    with pytest.raises(RuntimeError):  # why it must be per module
        Mixed().to(memory_format=torch.channels_last)
    assert apply_channels_last(model) == 3
    assert model.stem.weight.is_contiguous(memory_format=torch.channels_last_3d)
    assert model.head[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert model.head[3].weight.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("make, shape", [(conv2d_net, (2, 3, 16, 16)), (Mixed, (2, 3, 4, 16, 16))])
def test_outputs_equal_the_contiguous_model(make, shape):
    x = torch.randn(shape)
    reference = make().eval()(x)
    model = make().eval()
    apply_channels_last(model)
    torch.testing.assert_close(model(to_channels_last(x)), reference, rtol=1e-5, atol=1e-5)


def test_to_channels_last_on_nested_batches():
    batch = {"image": torch.randn(2, 3, 8, 8), "clip": [torch.randn(1, 3, 2, 8, 8)], "label": torch.ones(2, 3, 4, 4, dtype=torch.long), "x": torch.randn(3)}
    out = to_channels_last(batch)
    assert is_channels_last(out["image"]) and is_channels_last(out["clip"][0])
    assert out["label"].is_contiguous() and torch.equal(out["x"], batch["x"])  # integers and other ranks untouched


def test_no_convolution_warns_no_effect():
    with pytest.warns(NoEffectWarning, match=r"^apply_channels_last: .*no 2-d or 3-d convolution.*Remove the `apply_channels_last` call") as record:
        assert apply_channels_last(nn.Linear(3, 3)) == 0
    assert record[0].filename == __file__  # points at the user's call


def test_callback_without_convolution_names_the_callback():
    # The callback's warning tells the user to remove the callback (there is no "transform" to remove).
    callback = ChannelsLast()
    with pytest.warns(NoEffectWarning, match=r"^ChannelsLast: .*no 2-d or 3-d convolution.*Remove the `ChannelsLast\(\)` callback"):
        callback.setup(trainer=L.Trainer(accelerator="cpu", logger=False), pl_module=nn.Linear(3, 3), stage="fit")
    assert callback.converted == 0


class ConvModule(L.LightningModule):
    def __init__(self, stem=None):
        super().__init__()
        self.net = conv2d_net()
        self.stem = stem or nn.Identity()
        self.seen = {}

    def forward(self, x):
        return self.net(self.stem(x))

    def _record(self, stage, batch):
        self.seen.setdefault(stage, is_channels_last(batch[0]))

    def training_step(self, batch, batch_idx):
        self._record("train", batch)
        return nn.functional.cross_entropy(self(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self._record("val", batch)

    def test_step(self, batch, batch_idx):
        self._record("test", batch)

    def predict_step(self, batch, batch_idx):
        self._record("predict", batch)
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _images():
    g = torch.Generator().manual_seed(0)
    ds = torch.utils.data.TensorDataset(torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
    return torch.utils.data.DataLoader(ds, batch_size=4)


def test_callback_converts_model_and_every_batch_in_every_stage():
    callback, model = ChannelsLast(), ConvModule()
    t = trainer(None, max_steps=2, callbacks=[callback])
    t.fit(model, _images(), _images())
    t.validate(model, _images())
    t.test(model, _images())
    t.predict(model, _images())
    assert model.seen == {"train": True, "val": True, "test": True, "predict": True}
    assert model.net[0].weight.is_contiguous(memory_format=torch.channels_last)
    assert callback.converted == 2 and callback.first_conv_input_channels_last is True
    assert "on_after_batch_transfer" not in vars(model)  # restored at teardown


def test_callback_with_a_datamodule_that_overrides_the_transfer_hook():
    class DM(L.LightningDataModule):
        def train_dataloader(self):
            return _images()

        def on_after_batch_transfer(self, batch, dataloader_idx):
            return [batch[0] * 1.0, batch[1]]  # a real transform: the result is a new contiguous tensor

    model = ConvModule()
    trainer(None, max_steps=1, callbacks=[ChannelsLast()]).fit(model, datamodule=DM())
    assert model.seen["train"] is True


def test_warns_when_something_converts_the_input_back():
    class BackToContiguous(nn.Module):
        def forward(self, x):
            return x.contiguous()

    callback = ChannelsLast()
    with pytest.warns(NoEffectWarning, match=r"first convolution \(`net.0`\) received a contiguous"):
        trainer(None, max_steps=1, callbacks=[callback]).fit(ConvModule(stem=BackToContiguous()), _images())
    assert callback.first_conv_input_channels_last is False


def test_callback_on_a_model_without_convolutions_warns():
    from tests.helpers import LitNet, loader, make_data

    with pytest.warns(NoEffectWarning):
        trainer(None, max_steps=1, callbacks=[ChannelsLast()]).fit(LitNet(), loader(make_data(1)))
