"""The LightningCLI-shaped script of ``original.py``, adopted as docs/how-to/lightning.md
(LightningCLI) says.

Our own code (see ``original.py``: in the shape of Lightning's
``examples/pytorch/basics/backbone_image_classifier.py``, Apache-2.0), with the adoption's
lines: the imports, the selection (a global batch of 64: 32 on each of 2 processes) and
``lightning_cli(sel, ..., batch_size_key="data.batch_size")`` instead of ``LightningCLI(...)``;
the Trainer's launch flags are the decision's, not the command line's.

    resilient-strategy run --nproc-per-node 2 adopted.py --trainer.max_epochs=2
"""
# (end of header)
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import DataLoader, TensorDataset, random_split
import resilient_strategy
from resilient_strategy.integrations.lightning import lightning_cli


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
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
    cli = lightning_cli(sel, LitClassifier, MyDataModule, batch_size_key="data.batch_size",
                        seed_everything_default=7, save_config_kwargs={"overwrite": True}, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    cli.trainer.test(ckpt_path="best", datamodule=cli.datamodule)
    predictions = cli.trainer.predict(ckpt_path="best", datamodule=cli.datamodule)
    print(f"{sum(len(p) for p in predictions)} predictions")


if __name__ == "__main__":
    cli_main()
