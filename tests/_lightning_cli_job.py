"""A LightningCLI script adopted through ``lightning_cli`` (tests/test_integrations_cli.py):
a model and a data module of LightningCLI's usual shape, ``fit`` from the command line, a
global batch of 32. Rank 0 writes to ``argv[1]`` (taken off before the CLI parses) the optimizer
steps, the samples each step saw across the ranks, the processes, the accumulation and the
final weights."""

import json
import sys

import resilient_strategy

OUT = sys.argv.pop(1)
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=32)

import lightning as L  # noqa: E402
import torch  # noqa: E402

from resilient_strategy.integrations.lightning import lightning_cli  # noqa: E402


class Regression(L.LightningModule):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.seen = 0
        self.per_step: list[int] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        self.seen += len(x)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.per_step.append(self.seen * self.trainer.world_size)
        self.seen = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)

    def on_train_end(self) -> None:
        if self.trainer.is_global_zero:
            with open(OUT, "w") as fh:
                json.dump({"steps": self.trainer.global_step, "per_step": self.per_step,
                           "world": self.trainer.world_size,
                           "accumulate": self.trainer.accumulate_grad_batches,
                           "batch": self.trainer.datamodule.batch_size,
                           "weight": self.net.weight.detach().flatten().tolist()}, fh)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 8, samples: int = 128) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(1)
        x = torch.randn(self.samples, 4, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size)


lightning_cli(sel, Regression, Data, batch_size_key="data.batch_size", save_config_callback=None,
              trainer_defaults={"logger": False, "enable_checkpointing": False,
                                "enable_progress_bar": False, "enable_model_summary": False})
