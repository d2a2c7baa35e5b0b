"""This machine as the job sees it: GPUs and links (NVML), host facts, installed frameworks read
from package metadata, ``CUDA_VISIBLE_DEVICES``, the import watch, the environment
(``env.snapshot``, the one reader of ``os.environ``) and the files this package keeps on it."""
