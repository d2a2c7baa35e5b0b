"""The exit codes of ``resilient-strategy run``, for schedulers (one enum, documented in
``docs/how-to/run.md``).

A requeue script reads them as: 0 done; 1 the user's code failed (requeueing would fail the
same way); 75 this machine could not keep the job running (requeue it elsewhere: sysexits'
``EX_TEMPFAIL``, "a temporary failure, the user is invited to retry"); 128 + N interrupted by
signal N (130 for Ctrl-C, 143 for SIGTERM: a scheduler's preemption); 2 the configuration
is wrong: the command line, an environment variable, or the launch (a port held, a store
unreachable, a name that does not resolve, a library that breaks ``import torch``): do not
retry, fix it.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    SUCCESS = 0
    #: The script failed in its own code (an exception, out of memory, ranks that diverged):
    #: do not requeue.
    USER_ERROR = 1
    #: The configuration is wrong: the command line or a ``RESILIENT_STRATEGY_*`` variable is
    #: invalid (nothing ran), or the launch itself is (a ``launch`` verdict: a rendezvous port
    #: already held, a store unreachable, a name that does not resolve, a library that breaks
    #: ``import torch``, CUDA initialised too early; or one fault that recurs identically on two
    #: strategies). Do not retry: fix the configuration.
    USAGE = 2
    #: The infrastructure of this machine is exhausted: no strategy works here, a node was lost,
    #: no candidate left, only candidates below the throughput floor, the relaunch limit,
    #: attempts without progress, or a full or read-only disk for the run's files. Requeue
    #: elsewhere.
    INFRASTRUCTURE = 75
    #: Interrupted by SIGINT (Ctrl-C); another signal N gives 128 + N (`interrupted`).
    INTERRUPTED = 130


def interrupted(signum: int) -> int:
    """The exit status for a run stopped by signal ``signum`` (the shell's 128 + N)."""
    return 128 + signum
