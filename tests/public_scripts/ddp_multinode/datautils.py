"""Our own stand-in for the tutorial series' ``datautils.py`` (its ``MyTrainDataset``): a fixed
list of (input, target) pairs, seeded so that every rank holds the same data."""

import torch
from torch.utils.data import Dataset


class MyTrainDataset(Dataset):
    def __init__(self, size, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.pairs = [(torch.rand(20, generator=gen), torch.rand(1, generator=gen))
                      for _ in range(size)]

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        return self.pairs[index]
