"""The PyTorch DDP tutorial's torchrun script (``ddp_tutorial_original.py``, our copy of
pytorch/examples ``distributed/ddp-tutorial-series/multigpu_torchrun.py``, BSD-3-Clause,
https://github.com/pytorch/examples/blob/main/distributed/ddp-tutorial-series/multigpu_torchrun.py),
adopted: four lines differ from it (``tests/test_adopt.py`` counts them). Its own loop, its own
``DistributedSampler``, its ``model.module`` and ``destroy_process_group()`` are left as written;
on a machine where the backend fails, the decision trains on one process with the same
global batch (two accumulated micro-batches per optimizer step) and the other rank exits at
start-up.

    torchrun --standalone --nproc_per_node 2 examples/adopted/ddp_tutorial.py 2 1
    resilient-strategy run --nproc-per-node 2 examples/adopted/ddp_tutorial.py 2 1
"""
# ruff: noqa: I001, F401, RUF100 (the tutorial's imports, left as its users wrote them)

import json
import os

import resilient_strategy
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.distributed import init_process_group, destroy_process_group


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g))
                     for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


def ddp_setup():
    global sel
    sel = resilient_strategy.resilient_strategy(framework="torch").init_process_group()


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.gpu_id = int(os.environ["LOCAL_RANK"])
        cuda = torch.cuda.is_available()
        self.device = torch.device("cuda", self.gpu_id) if cuda else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        self.steps, self.samples = 0, 0
        optimizer.register_step_post_hook(self._count_step)
        if os.path.exists(snapshot_path):
            print("Loading snapshot")
            self._load_snapshot(snapshot_path)
        self.model, self.optimizer = sel.adopt(self.model, self.optimizer, self.train_data)

    def _count_step(self, optimizer, args, kwargs):
        self.steps += 1

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at Epoch {self.epochs_run}")

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        output = self.model(source)
        loss = F.mse_loss(output, targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        b_sz = len(next(iter(self.train_data))[0])
        print(f"[GPU{self.gpu_id}] Epoch {epoch} | Batchsize: {b_sz} | "
              f"Steps: {len(self.train_data)}")
        for source, targets in self.train_data:
            source = source.to(self.device)
            targets = targets.to(self.device)
            self.samples += len(source)
            self._run_batch(source, targets)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch + 1}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epoch} | Training snapshot saved at {self.snapshot_path}")

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.gpu_id == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)

    def report(self, directory):
        rank = torch.distributed.get_rank()
        weights = {k: v.tolist() for k, v in self.model.module.state_dict().items()}
        with open(os.path.join(directory, f"rank{rank}.json"), "w") as fh:
            json.dump({"world": torch.distributed.get_world_size(), "steps": self.steps,
                       "samples": self.samples, "weights": weights}, fh)


def load_train_objs(samples):
    torch.manual_seed(0)
    train_set = MyTrainDataset(samples)  # load your dataset
    model = torch.nn.Linear(20, 1)  # load your model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, pin_memory=torch.cuda.is_available(),
                      shuffle=False, sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, samples, report, snapshot_path="snapshot.pt"):
    ddp_setup()
    dataset, model, optimizer = load_train_objs(samples)
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    if report:
        trainer.report(report)
    destroy_process_group()


if __name__ == "__main__":
    import argparse
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    parser.add_argument("--samples", default=2048, type=int, help="Samples in the dataset")
    parser.add_argument("--report", default=None, help="Write each rank's result there")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.samples, args.report)
