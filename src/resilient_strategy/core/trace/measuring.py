"""What training measured of the user's own step (issue 41): the step as it ran on the chosen
candidate (`StepMeasured`), and, when another proven candidate would be faster by a clear margin
with those numbers, which one and by how much (`MeasuredFaster`).

Emitted by the Selection during training (not by the planner): ``sel.to_dict()["events"]``
carries them after the measured window, ``sel.to_dict()["measured_step"]`` the measurement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..values.candidate import Candidate
from ..values.human import human_duration
from .event import Event

#: How the communication a step waited for was told from its compute (`StepMeasured.how`):
#: under DDP, the time from the last gradient backward computed to the optimizer's update (DDP
#: waits there for its all-reduces), with ``perf_counter`` on CPU or CUDA events on GPUs;
#: ``no_collective``: one replica, nothing to wait for; ``not_separated``: the step's time
#: only (`StepMeasured.note` says why: FSDP2's collectives, Keras ``fit`` under a
#: MirroredStrategy).
MEASURE_HOWS = ("ddp_wait_cpu", "ddp_wait_cuda", "no_collective", "not_separated")


@dataclass(frozen=True)
class StepMeasured(Event):
    """The user's own step, measured on this process over a window of optimizer steps after
    the warm-up (``first_step``: the first optimizer step of the window, counted from 1 in
    this process; ``steps`` of them; ``micro_steps``, ``samples``: this process's). Seconds
    are means per optimizer step: ``step_s`` the wall time (forward, backward, optimizer,
    loading the next batch), ``comm_wait_s`` the part of it spent waiting for gradient
    communication after backward's compute (None: not separated, `MEASURE_HOWS`),
    ``comm_s`` every collective's own time, overlapped with backward or not (None: not
    timed, as under DDP now), ``compute_s`` the rest. ``sample_seconds``: compute seconds of one sample on one
    replica, the optimizer's updates left out (what the planner's ``measured`` input takes),
    None when compute was not separated or the samples are unknown; ``update_s``: the
    optimizer's update, once an optimizer step (0: not timed). ``gradient_bytes``: what one
    all-reduce moves per replica (0: unknown)."""

    kind: ClassVar[str] = "step_measured"
    candidate: Candidate
    first_step: int
    steps: int
    micro_steps: int
    samples: int | None
    step_s: float
    compute_s: float | None
    comm_wait_s: float | None
    comm_s: float | None
    sample_seconds: float | None
    how: str
    gradient_bytes: int = 0
    note: str = ""
    update_s: float = 0.0

    def text(self) -> str:
        head = (f"Measured the step of {self.candidate.label} over optimizer steps "
                f"{self.first_step}-{self.first_step + self.steps - 1}: "
                f"{human_duration(self.step_s)} a step")
        if self.comm_wait_s is not None and self.compute_s is not None:
            head += (f" ({human_duration(self.compute_s)} compute, "
                     f"{human_duration(self.comm_wait_s)} waiting for communication")
            head += (f" of {human_duration(self.comm_s)} in all)" if self.comm_s is not None
                     else ")")
        else:
            head += f" (communication not told apart: {self.note or self.how})"
        return head + "."


@dataclass(frozen=True)
class MeasuredFaster(Event):
    """Another candidate, proven here, would train faster by more than ``margin`` with the
    measured compute: ``chosen_step_s`` the chosen one's measured step, ``faster_step_s`` the
    planner's estimate of ``faster``'s step (per global batch) with that compute and the probed
    or typical bandwidth (``basis``), plus the optimizer's update measured once a step
    (``update_s``, which every candidate pays), ``chosen_estimate_s`` the planner's estimate of
    the chosen one on the same numbers (None: not ranked). ``speedup``:
    ``chosen_step_s / faster_step_s``."""

    kind: ClassVar[str] = "measured_faster"
    chosen: Candidate
    chosen_step_s: float
    faster: Candidate
    faster_step_s: float
    chosen_estimate_s: float | None
    speedup: float
    margin: float
    basis: str
    sample_seconds: float
    update_s: float = 0.0

    def text(self) -> str:
        return (f"Measured: {self.chosen.label} takes {human_duration(self.chosen_step_s)} a "
                f"step; {self.faster.label}, proven here, would take "
                f"~{human_duration(self.faster_step_s)} with that compute "
                f"({human_duration(self.sample_seconds)} a sample; {self.basis}): "
                f"{self.speedup:.2f}x faster.")
