"""An image classifier run by a LightningCLI, in the shape of Lightning's CLI example.

Our own code, in the shape of Lightning-AI/pytorch-lightning
``examples/pytorch/basics/backbone_image_classifier.py`` (Apache-2.0,
https://github.com/Lightning-AI/pytorch-lightning/blob/master/examples/pytorch/basics/backbone_image_classifier.py),
written here, not copied: a backbone module, a ``LightningModule`` taking it (training,
validation, test and predict steps, its optimizer), a ``LightningDataModule`` with its
``batch_size`` and a train/validation split, and ``LightningCLI(..., run=False)`` followed by
``fit``, ``test`` and ``predict`` from the best checkpoint; the Trainer's flags come from the
command line (``--trainer.devices=2 --trainer.strategy=ddp``). What differs: no MNIST download:
seeded data of MNIST's shape (1x28x28, 10 classes), 500 training, 100 validation and 100 test
images.

    python original.py --trainer.max_epochs=2
"""
# (end of header)
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset, random_split


class Backbone(torch.nn.Module):
    def __init__(self, hidden_dim=64):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(28 * 28, hidden_dim),
                                          torch.nn.ReLU(), torch.nn.Linear(hidden_dim, 10))

    def forward(self, x):
        return self.layers(x)


class LitClassifier(LightningModule):
    def __init__(self, backbone: Backbone | None = None, learning_rate: float = 1e-3):
        super().__init__()
        self.learning_rate = learning_rate
        self.backbone = backbone if backbone is not None else Backbone()

    def forward(self, x):
        return self.backbone(x)

    def _loss(self, batch):
        x, y = batch
        return F.cross_entropy(self.backbone(x), y)

    def training_step(self, batch, batch_idx):
        return self._loss(batch)

    def validation_step(self, batch, batch_idx):
        self.log("valid_loss", self._loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        return self.backbone(batch[0]).argmax(dim=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.learning_rate)


def _images(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.rand(n, 1, 28, 28, generator=gen), torch.arange(n) % 10)


class MyDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 32):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage):
        self.train_set, self.val_set = random_split(_images(600, 0), [500, 100],
                                                    generator=torch.Generator().manual_seed(42))
        self.test_set = _images(100, 1)

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)

    def test_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)

    def predict_dataloader(self):
        return DataLoader(self.test_set, batch_size=self.batch_size)


def cli_main():
    cli = LightningCLI(LitClassifier, MyDataModule, seed_everything_default=7,
                       save_config_kwargs={"overwrite": True}, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    print(f"{sum(len(p) for p in predictions)} predictions")


if __name__ == "__main__":
    cli_main()
