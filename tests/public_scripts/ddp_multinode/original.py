"""A DDP training script in the shape of the PyTorch DDP tutorial series' multinode script.

Our own code, in the shape of pytorch/examples ``distributed/ddp-tutorial-series/multinode.py``
(and its ``datautils.py``; BSD-3-Clause,
https://github.com/pytorch/examples/blob/main/distributed/ddp-tutorial-series/multinode.py),
written here, not copied: what matters for adoption is kept as a user's script has it: an
``init_process_group(backend=...)`` in each branch of its set-up (NCCL with a GPU, gloo
without), a ``Trainer`` that reads ``LOCAL_RANK``/``RANK``, wraps the model in ``DDP`` itself,
runs its own loop over a loader with its own ``DistributedSampler`` (``set_epoch``, a peek at the
batch size), and saves/loads its own snapshot (``model.module``'s state and ``EPOCHS_RUN``, the
epoch it finished, trained again on resume, as the tutorial does). What differs: a linear model
with a mean-squared-error loss on 1024 seeded samples of 20 features, the CPU without a GPU.

    torchrun --standalone --nproc_per_node 2 original.py 2 1
"""
# (end of header)
import argparse
import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from datautils import MyTrainDataset


def ddp_setup():
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group(backend="nccl")
    else:
        torch.distributed.init_process_group(backend="gloo")


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        gpu = torch.cuda.is_available()
        self.device = torch.device("cuda", self.local_rank) if gpu else torch.device("cpu")
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot()
        self.model = DDP(self.model, device_ids=[self.local_rank] if gpu else None)

    def _load_snapshot(self):
        snapshot = torch.load(self.snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[rank {self.global_rank}] resuming from the snapshot of epoch {self.epochs_run}")

    def _save_snapshot(self, epoch):
        state = {"MODEL_STATE": self.model.module.state_dict(), "EPOCHS_RUN": epoch}
        torch.save(state, self.snapshot_path)
        print(f"epoch {epoch}: snapshot written to {self.snapshot_path}")

    def _run_batch(self, inputs, targets):
        self.optimizer.zero_grad()
        loss = F.mse_loss(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()

    def _run_epoch(self, epoch):
        per_step = len(next(iter(self.train_data))[0])
        print(f"[rank {self.global_rank}] epoch {epoch}: batch {per_step}, "
              f"{len(self.train_data)} steps")
        self.train_data.sampler.set_epoch(epoch)
        for inputs, targets in self.train_data:
            self._run_batch(inputs.to(self.device), targets.to(self.device))

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.local_rank == 0 and epoch % self.save_every == 0:
                self._save_snapshot(epoch)


def load_train_objs():
    dataset = MyTrainDataset(1024)
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    return dataset, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      pin_memory=torch.cuda.is_available(), sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path="snapshot.pt"):
    ddp_setup()
    dataset, model, optimizer = load_train_objs()
    train_data = prepare_dataloader(dataset, batch_size)
    trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path)
    trainer.train(total_epochs)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a DDP training job over several nodes")
    parser.add_argument("total_epochs", type=int, help="epochs to train")
    parser.add_argument("save_every", type=int, help="write a snapshot every this many epochs")
    parser.add_argument("--batch_size", default=32, type=int, help="samples per process a step")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size)
