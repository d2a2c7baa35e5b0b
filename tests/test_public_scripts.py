"""Training scripts in the shape of public ones, adopted as the README and the how-tos say (issue
43 item 5). Each ``tests/public_scripts/<name>/original.py`` is our own code in the shape of a
public script (the one it mirrors, its license and what differs in its header: what matters for
adoption is kept, no text is copied); ``adopted.py`` is it with the adoption's lines
(`benchmarks/adoption_lines.py` counts them; the how-to quotes the counts).

Every run is real: ``torchrun`` or ``resilient-strategy run`` on 2 CPU processes (TensorFlow:
one process, as ``run`` runs Keras), healthy, with gloo broken (``GLOO_SOCKET_IFNAME`` naming no
interface: the real gloo fails to start) or the probe's rehearsal fault, and a real SIGKILL of one
rank mid-run under ``run``. What each process trained is counted by an instrument the scripts
never see (``tests/public_scripts/_count/sitecustomize.py``: torch's global optimizer-step hook
and the training model's forward calls), the same for the original and the adopted script, and
the assertions are on those counts, the supervisor's attempts record and the processes left."""

from __future__ import annotations

from pathlib import Path

import pytest
from _public_scripts import BROKEN_GLOO, SCRIPTS, only, supervised_kill, torchrun

pytest.importorskip("torch")

pytestmark = [pytest.mark.slow, pytest.mark.torch]


# ----- in the shape of the DDP tutorial series' multinode script (own loop, sampler, snapshot) ----
DDP_ARGS = ("2", "1")  # 2 epochs, a snapshot after each; 1024 samples, 32 per process


def test_ddp_multinode_healthy_broken_gloo_as_the_original(tmp_path: Path) -> None:
    """2 gloo processes: the adopted script takes the original's optimizer steps over the same
    samples (32 steps, 512 samples per rank per epoch); with gloo broken the original dies at
    its init_process_group, the adopted one trains on one process with the same 32 steps of the
    same global batch (2 x 32 accumulated: all 2048 samples) and rank 1 leaves at start-up."""
    done, original = torchrun(tmp_path / "original", "ddp_multinode", "original", *DDP_ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    done, adopted = torchrun(tmp_path / "adopted", "ddp_multinode", "adopted", *DDP_ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {rank: (r["steps"], r["samples"]) for rank, r in only(original).items()}
    assert counts == {0: (32, 1024), 1: (32, 1024)}
    assert {rank: (r["steps"], r["samples"]) for rank, r in only(adopted).items()} == counts

    done, dead = torchrun(tmp_path / "original-broken", "ddp_multinode", "original", *DDP_ARGS,
                          **BROKEN_GLOO)
    assert done.returncode != 0 and not any(r["steps"] for r in only(dead).values())
    done, alone = torchrun(tmp_path / "adopted-broken", "ddp_multinode", "adopted", *DDP_ARGS,
                           **BROKEN_GLOO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {rank: (r["steps"], r["samples"]) for rank, r in only(alone).items()} == {
        0: (32, 2 * 1024)}


def test_ddp_multinode_a_rank_killed_resumes_from_its_own_snapshot(tmp_path: Path) -> None:
    """3 epochs under ``run``, rank 1 SIGKILLed in the third: the supervisor retries, the script
    loads its own snapshot (it saves, as the tutorial does, the epoch it finished as
    EPOCHS_RUN and trains from that epoch again) and reports it with ``sel.resumed_from``: the
    relaunch is announced from step 16 and trains the 32 steps left; the job ends 0 and leaves
    nothing running."""
    proc, out, attempts, reports = supervised_kill(tmp_path, "ddp_multinode", "3", "1", at=40)
    assert proc.returncode == 0, out[-3000:]
    assert [(a["action"], a["resumed_from"]) for a in attempts] == [("retry", None),
                                                                     ("finish", 16)], out[-3000:]
    for rank in (0, 1):
        first, second = reports[rank]
        assert first["steps"] >= 40 and (second["steps"], second["samples"]) == (32, 32 * 32)


# ----- in the shape of nanoGPT's train.py (its own accumulation, checkpoint) ----------------------
NANOGPT_ARGS = ("--dataset=synthetic", "--compile=False", "--backend=gloo", "--dtype=float32",
                "--device=cpu", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16",
                "--batch_size=4", "--gradient_accumulation_steps=4", "--max_iters=11",
                "--eval_interval=4", "--eval_iters=1", "--log_interval=100", "--dropout=0.0")


def _nanogpt_dir(tmp: Path) -> Path:
    """nanoGPT's working directory: its configurator.py (exec'd from there) and a synthesized
    dataset where nanoGPT's prepare scripts write one (seeded uint16 tokens, a vocabulary of 32)."""
    import pickle

    import numpy as np

    data = tmp / "data" / "synthetic"
    data.mkdir(parents=True)
    (tmp / "configurator.py").write_text((SCRIPTS / "nanogpt" / "configurator.py").read_text())
    rng = np.random.default_rng(0)
    for split, n in (("train", 4096), ("val", 1024)):
        rng.integers(0, 32, n, dtype=np.uint16).tofile(data / f"{split}.bin")
    (data / "meta.pkl").write_bytes(pickle.dumps({"vocab_size": 32}))
    return tmp


def test_nanogpt_healthy_broken_gloo_as_the_original(tmp_path: Path) -> None:
    """12 iterations of a global batch of 16 (4 accumulation steps in all of micro-batch 4): on 2
    gloo processes each rank accumulates 2 (nanoGPT divides by the world size) for the
    original and the adopted script alike; with gloo broken the adopted script's one process
    accumulates all 4 itself (``torch.distributed.get_world_size()`` is 1 on the stand-in group)
    and takes the same 12 optimizer steps over the same 192 samples."""
    done, original = torchrun(_nanogpt_dir(tmp_path / "original"), "nanogpt", "original",
                              *NANOGPT_ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = {rank: (r["steps"], r["samples"]) for rank, r in only(original).items()}
    assert counts == {0: (12, 96), 1: (12, 96)}
    done, adopted = torchrun(_nanogpt_dir(tmp_path / "adopted"), "nanogpt", "adopted",
                             *NANOGPT_ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {rank: (r["steps"], r["samples"]) for rank, r in only(adopted).items()} == counts
    done, alone = torchrun(_nanogpt_dir(tmp_path / "broken"), "nanogpt", "adopted",
                           *NANOGPT_ARGS, **BROKEN_GLOO)
    assert done.returncode == 0, done.stderr[-3000:]
    assert {rank: (r["steps"], r["samples"]) for rank, r in only(alone).items()} == {
        0: (12, 192)}


def test_nanogpt_a_rank_killed_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed after 9 optimizer steps under ``run``: the relaunch loads nanoGPT's
    ckpt.pt of iteration 8 (``init_from='resume'`` once it exists), reports it, is announced
    from step 8 and trains the 4 iterations left, 8 samples per rank each."""
    proc, out, attempts, reports = supervised_kill(_nanogpt_dir(tmp_path), "nanogpt",
                                                   *NANOGPT_ARGS, at=9, step_s=0.1)
    assert proc.returncode == 0, out[-3000:]
    assert [(a["action"], a["resumed_from"]) for a in attempts] == [("retry", None),
                                                                     ("finish", 8)], out[-3000:]
    for rank in (0, 1):
        first, second = reports[rank]
        assert first["steps"] >= 9 and (second["steps"], second["samples"]) == (4, 4 * 8)
