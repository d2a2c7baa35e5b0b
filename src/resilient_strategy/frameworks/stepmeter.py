"""The user's own step, measured during training (issue 41): a window of optimizer steps after
the warm-up, its wall time, and the communication the step waited for.

`StepMeter` follows the optimizer steps of one runtime (`TorchRuntime._end_micro_step`, and
the Keras callback of `frameworks.tensorflow`): out of its window it costs one attribute read
a micro-step; in the window, one ``perf_counter`` a micro-step and, under DDP, a Python hook
per parameter's gradient. Its window opens after `MEASURE_FROM` optimizer steps of warm-up and
closes `MEASURE_STEPS` later; on GPUs it synchronises the device at both ends (two syncs in
all) and reads its CUDA events once at the close. Then it calls ``on_done`` with a
`StepMeasurement` and measures nothing more.

Under DDP the communication the step waited for is told by the parameters' gradients: a
post-accumulate-grad hook on each (added when the window opens, removed when it closes, so
nothing of it is left after the window) marks when backward computed its last gradient; DDP's
backward then waits for its all-reduces to complete, and the time from that last gradient to the
optimizer's update is the wait (a ``perf_counter`` on CPU, where gloo completes the collective
before backward returns; CUDA events on GPUs, in stream order, read once at the window's end).
The collectives' own time, overlapped with backward, is not timed. FSDP2's collectives run
inside its own hooks: not separated, the measurement says so (``not_separated``).

`faster_candidate` is pure: given the planner's ranking re-made with the measured compute
(the Selection asks the planner, `core.planning.plan`, with ``measured=``), the proven
candidate that beats the measured step by more than `FASTER_MARGIN`, or None.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..core.measures.probe import ProbeResult
from ..core.planning.shapes import Ranked

#: Optimizer steps of warm-up before the window opens (the first steps allocate, compile and
#: fill caches), and the optimizer steps it measures.
MEASURE_FROM = 5
MEASURE_STEPS = 20
#: How much faster (the measured step over the other candidate's estimate, less 1) another
#: proven candidate must be to be named: a clear margin, above the noise of a loaded machine.
FASTER_MARGIN = 0.10


@dataclass(frozen=True)
class StepMeasurement:
    """What one process measured over its window (totals over ``steps`` optimizer steps):
    ``wall_s`` the window's wall time, ``comm_wait_s`` the part spent waiting for gradient
    communication after backward's compute and ``comm_s`` every collective's own time (None:
    not separated, ``how`` and ``note`` say why), ``update_s`` the optimizer's updates (a cost
    per optimizer step, whatever the replicas; 0 when not timed: Keras), ``samples`` this
    process's samples (None:
    unknown), ``gradient_bytes`` what one all-reduce moves (0: unknown). ``how``: one of
    `core.trace.measuring.MEASURE_HOWS`."""

    first_step: int
    steps: int
    micro_steps: int
    samples: int | None
    wall_s: float
    comm_wait_s: float | None
    comm_s: float | None
    how: str
    note: str = ""
    gradient_bytes: int = 0
    update_s: float = 0.0

    @property
    def sample_compute_s(self) -> float | None:
        """The window's compute that scales with the samples (its wall time less the
        communication waited for and the optimizer's updates); None: not separated."""
        if self.comm_wait_s is None:
            return None
        return max(0.0, self.wall_s - self.comm_wait_s - self.update_s)

    @property
    def step_s(self) -> float:
        """Mean wall seconds an optimizer step."""
        return self.wall_s / self.steps

    @property
    def compute_s(self) -> float | None:
        """Mean seconds an optimizer step not spent waiting for communication (None: not
        separated)."""
        if self.comm_wait_s is None:
            return None
        return max(0.0, self.wall_s - self.comm_wait_s) / self.steps


@dataclass
class StepMeter:
    """Measures one window of optimizer steps (see the module). ``device``: a torch device
    (CUDA: synchronised at the window's ends, timed with CUDA events) or None (CPU, and
    TensorFlow); ``on_done``: called once with the `StepMeasurement`; ``how``: what separates
    the communication when no DDP is attached (``no_collective`` or ``not_separated`` with
    ``note``)."""

    on_done: Callable[[StepMeasurement], None] | None = None
    device: Any = None
    how: str = "no_collective"
    note: str = ""
    start: int = MEASURE_FROM
    steps: int = MEASURE_STEPS
    #: False once the window closed (or never to open): the runtime's hot path reads only this
    live: bool = True
    gradient_bytes: int = 0
    result: StepMeasurement | None = None
    _seen: int = 0  # optimizer steps ended before the window
    _in: bool = False
    _window: int = 0
    _micro: int = 0
    _samples: int | None = 0
    _t0: float = 0.0
    _timing: bool = False  # the gradient hooks time now
    _hooked: bool = False
    _ddp: Any = None
    _params: list[Any] = field(default_factory=list)
    _handles: list[Any] = field(default_factory=list)
    _last_grad: Any = None  # when this micro-step's last gradient was accumulated
    _order: int = -1  # the parameter whose gradient came last, this micro-step
    _last_index: int = -1  # ... the micro-step before (the one a CUDA event is recorded for)
    _updates: list[list[Any]] = field(default_factory=list)  # (start, end) of each update
    _pairs: list[list[Any]] = field(default_factory=list)  # (last gradient, update) a step

    # ----- the hot path -------------------------------------------------------------------
    def update_begins(self) -> None:
        """The optimizer's update of this optimizer step begins (its end is `micro_step`'s
        with ``boundary``). Call only while `live`."""
        if self._in:
            self._updates.append([self._now(), None])

    def micro_step(self, boundary: bool, samples: int | None) -> None:
        """One micro-step ended (``boundary``: its optimizer step too) with ``samples`` of this
        process (None: unknown). Call only while `live`."""
        if not self._in:
            if boundary:
                self._seen += 1
                if self._seen >= self.start:
                    self._open()
            return
        self._micro += 1
        if samples is None or self._samples is None:
            self._samples = None
        else:
            self._samples += samples
        if boundary and self._updates and self._updates[-1][1] is None:
            self._updates[-1][1] = self._now()
            if self._last_grad is not None:  # DDP synchronised in this backward
                self._pairs.append([self._last_grad, self._updates[-1][0]])
        self._last_grad, self._last_index = None, self._order
        if not boundary:
            return
        self._window += 1
        if self._window >= self.steps:
            self._close()

    # ----- the window -----------------------------------------------------------------------
    def _cuda(self) -> bool:
        return self.device is not None and getattr(self.device, "type", "") == "cuda"

    def _sync(self) -> None:
        if self._cuda():
            import torch

            torch.cuda.synchronize(self.device)

    def _now(self) -> Any:
        if self._cuda():
            import torch

            event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            event.record()
            return event
        return time.perf_counter()

    def _open(self) -> None:
        if self._ddp is not None and not self._hooked:
            self._hook_ddp()
        self._in = True
        self._sync()
        self._t0 = time.perf_counter()
        self._timing = self._hooked

    def _close(self) -> None:
        self._sync()
        wall = time.perf_counter() - self._t0
        self._timing = False
        self.live = False
        wait: float | None = None
        how, note = self.how, self.note
        if self._hooked:
            wait = sum(_seconds(a, b) for a, b in self._pairs)
            how, note = ("ddp_wait_cuda" if self._cuda() else "ddp_wait_cpu"), ""
            self._unhook()
        elif how == "no_collective":
            wait = 0.0
        update = sum(_seconds(a, b) for a, b in self._updates if b is not None)
        self._pairs, self._updates, self._ddp, self._params = [], [], None, []
        self.result = StepMeasurement(
            first_step=self.start + 1, steps=self._window, micro_steps=self._micro,
            samples=self._samples, wall_s=wall, comm_wait_s=wait, comm_s=None, how=how,
            note=note, gradient_bytes=self.gradient_bytes, update_s=update)
        if self.on_done is not None:
            self.on_done(self.result)

    # ----- DDP ------------------------------------------------------------------------------
    def attach_ddp(self, ddp: Any) -> None:
        """Tell, in the window, how long each synchronising step of ``ddp`` waited for its
        gradients' all-reduce (see the module)."""
        self._ddp = ddp
        self.how, self.note = "not_separated", "DDP's parameters could not be hooked"
        self._params = [p for p in ddp.module.parameters() if p.requires_grad]
        self.gradient_bytes = sum(int(p.numel()) * int(p.element_size()) for p in self._params)

    def _hook_ddp(self) -> None:
        try:
            for i, param in enumerate(self._params):
                self._handles.append(param.register_post_accumulate_grad_hook(
                    functools.partial(self._grad_ready, i)))
        except (AttributeError, RuntimeError) as e:  # torch < 2.1, or a parameter refused it
            self.note = f"{self.note} ({e})"
            self._unhook()
            return
        self._hooked = bool(self._handles)

    def _grad_ready(self, i: int, param: Any) -> None:
        """A parameter's gradient is accumulated: the last of a backward marks the end of its
        compute (on a GPU a CUDA event, recorded for the parameter that came last the
        micro-step before)."""
        if not self._timing:
            return
        self._order = i
        if not self._cuda():
            self._last_grad = time.perf_counter()
        elif i == self._last_index or self._last_index < 0:
            self._last_grad = self._now()

    def _unhook(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _seconds(a: Any, b: Any) -> float:
    """Seconds from ``a`` to ``b``: ``perf_counter`` floats or CUDA events (synchronised)."""
    if isinstance(a, float):
        return max(0.0, float(b) - a)
    return max(0.0, float(a.elapsed_time(b)) / 1e3)


# --------------------------------------------------------------------------------------------
# Another candidate, clearly faster (pure)
# --------------------------------------------------------------------------------------------
def proven(r: Ranked, results: Mapping[str, ProbeResult]) -> bool:
    """Whether ``r``'s candidate was proven here (its probe passed), or needs no proof (one
    replica, no collective)."""
    result = results.get(r.candidate.key)
    return (result is not None and result.ok) or r.candidate.num_replicas == 1


def faster_candidate(ranked: Sequence[Ranked], chosen_key: str, measured_step_s: float,
                     results: Mapping[str, ProbeResult], margin: float = FASTER_MARGIN,
                     update_s: float = 0.0) -> tuple[Ranked, Ranked | None] | None:
    """(the fastest proven candidate other than the chosen one, the chosen one's ranking) when
    that candidate's step beats ``measured_step_s`` by more than ``margin`` (``measured /
    (estimate + update_s) > 1 + margin``); else None. ``ranked``: the planner's ranking made
    with the measured compute; ``update_s``: the optimizer's update measured per optimizer
    step, which every candidate pays once a step (the planner's estimate leaves it out)."""
    others = [r for r in ranked if r.candidate.key != chosen_key and proven(r, results)
              and r.estimate.step_seconds > 0]
    if not others or not measured_step_s > 0:
        return None
    best = min(others, key=lambda r: r.estimate.step_seconds)
    if measured_step_s / (best.estimate.step_seconds + update_s) <= 1 + margin:
        return None
    mine = next((r for r in ranked if r.candidate.key == chosen_key), None)
    return best, mine
