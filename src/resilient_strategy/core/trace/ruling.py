"""What the rules and the user's settings did to the chain: a rule that fired, a setting of the
user kept, a candidate ruled out, a remedy queued; the nodes' differences; what NCCL's own
diagnostics said in a probe."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from ..knowledge.nccldiag import Completed, Finding
from ..knowledge.nodefacts import NodeFinding
from ..measures.probe import ProbeResult
from ..values.candidate import Candidate
from .event import Event


def _env_text(env: Sequence[tuple[str, str]]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env))


# ----- rules ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RuleFired(Event):
    """A known-issue rule matched these facts, and what it did.

    ``action``: ``warn``, ``no_gpu`` (the chain planned without the GPUs), ``veto`` (``candidates`` ruled out), ``prefer`` (``targets`` first),
    ``set_env`` (``env`` set for NCCL), ``remedy_added`` (NCCL with ``env`` added, tried before
    plain NCCL when ``first``), ``remedy_exists`` (that remedy was a candidate already),
    ``nothing_to_act_on`` (no NCCL candidate left), ``already_ruled_out`` (an earlier rule
    removed its ``targets``; its advice still stands).
    """

    kind: ClassVar[str] = "rule_fired"
    rule: str
    effect: str
    action: str
    message: str
    source: str
    candidates: tuple[Candidate, ...] = ()
    targets: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    first: bool = False

    @property
    def cite(self) -> str:
        return f"[{self.rule}] {self.message} (source: {self.source})"

    def text(self) -> str:
        a = self.action
        if a == "warn":
            return f"Warning {self.cite}"
        if a == "no_gpu":
            return f"No GPU can run this build; planned without them: {self.cite}"
        if a == "veto":
            return f"Ruled out {'; '.join(c.label for c in self.candidates)}: {self.cite}"
        if a == "prefer":
            return f"Preferred {', '.join(self.targets)}: {self.cite}"
        if a == "set_env":
            return f"Set {_env_text(self.env)} for NCCL: {self.cite}"
        if a == "remedy_exists":
            return (f"Rule {self.rule} also suggests NCCL with {_env_text(self.env)}, already a "
                    f"candidate: {self.cite}")
        if a == "nothing_to_act_on":
            return f"Rule {self.rule} has nothing to act on: no NCCL candidate is left."
        if a == "already_ruled_out":
            return (f"Rule {self.rule} also applies to {', '.join(self.targets)}, already ruled "
                    f"out: {self.cite}")
        when = "before" if self.first else "after"
        return f"Added NCCL with {_env_text(self.env)}, tried {when} plain NCCL: {self.cite}"


@dataclass(frozen=True)
class UserSettingKept(Event):
    """A rule or remedy would set variables the user set: the user's values stand."""

    kind: ClassVar[str] = "user_setting_kept"
    rule: str
    variables: tuple[str, ...]

    def text(self) -> str:
        them = "it" if len(self.variables) == 1 else "them"
        return (f"Rule {self.rule} would set {', '.join(self.variables)}, but you set {them}; "
                "your value stands.")


# ----- candidates -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CandidateRuledOut(Event):
    """A candidate left out, ``by`` a rule (``rule`` names it), a probe (``result``), or the
    batch arithmetic (``batch``). ``said`` when another line of the trace already says it."""

    kind: ClassVar[str] = "ruled_out"
    candidate: Candidate
    by: str
    reason: str
    rule: str = ""
    source: str = ""
    result: ProbeResult | None = None
    simulated: bool = False
    said: bool = False

    def text(self) -> str:
        if self.said:
            return ""
        if self.by == "probe" and self.result is not None:
            sim = " (simulated)" if self.simulated else ""
            return (f"Probe of {self.candidate.label} failed after {self.result.elapsed_s:.1f} s"
                    f"{sim}: {self.reason}.")
        return f"Ruled out {self.candidate.label}: {self.reason}."


@dataclass(frozen=True)
class RemedyQueued(Event):
    """After plain NCCL failed with ``cause``, this remedy is tried next; ``on_top_of`` names
    the remedy that failed with that (new) cause, whose variables this one keeps."""

    kind: ClassVar[str] = "remedy_queued"
    candidate: Candidate
    cause: str
    on_top_of: Candidate | None = None
    #: the remedy's id in the remedies table, and the facts of this machine that made it
    #: apply (its ``when`` clauses, all of which held): why it was tried
    remedy: str = ""
    because: tuple[str, ...] = ()

    def text(self) -> str:
        why = f" (this machine: {', '.join(self.because)})" if self.because else ""
        if self.on_top_of is not None:
            return (f"Will try {self.candidate.label}: the remedy {self.on_top_of.label} failed "
                    f"on {self.cause}, so that cause's remedy is added on top{why}.")
        return f"Will try {self.candidate.label}, the usual remedy for {self.cause}{why}."


@dataclass(frozen=True)
class NodesDiffer(Event):
    """The nodes of a multi-node job differ in a way that matters (``finding``: which fact,
    which nodes, every node's value, the fix and its source), found by comparing the facts
    every node sent through the job's store before any probe. ``ruled_out``: the candidates
    between the nodes it ruled out (its ``effect`` is ``rule_out``)."""

    kind: ClassVar[str] = "nodes_differ"
    finding: NodeFinding
    ruled_out: tuple[Candidate, ...] = ()

    def text(self) -> str:
        f = self.finding
        values = "; ".join(f"node {k}: {v or 'unknown'}" for k, v in f.values)
        what = {"shared": "share", "any": "report"}.get(f.kind, "differ from node 0 in")
        out = (f"Node(s) {', '.join(map(str, f.nodes))} {what} {f.fact} ({values}) "
               f"[{f.id}]: {f.message} (source: {f.source})")
        if self.ruled_out:
            out += " Ruled out: " + "; ".join(c.label for c in self.ruled_out) + "."
        return out


@dataclass(frozen=True)
class NcclDiagnostics(Event):
    """How NCCL ran in ``candidate``'s probe and what its own diagnostics found (see
    `resilient_strategy.core.knowledge.nccldiag`): the variables the worker set (``set``: connections at
    init, the diagnostics on) or kept as the environment had them (``kept``), NCCL's findings
    (``findings``; ``ok`` False: tagged ``[INFO]``, a condition to review) and the reports that
    completed. Informational: the probe's verdict (``probe_ok``) is its value-checked
    collectives', whatever NCCL found."""

    kind: ClassVar[str] = "nccl_diagnostics"
    candidate: Candidate
    probe_ok: bool
    set: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    findings: tuple[Finding, ...] = ()
    completed: tuple[Completed, ...] = ()

    @property
    def issues(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if not f.ok)

    def text(self) -> str:
        ran = f" with {', '.join(self.set)}" if self.set else ""
        if self.kept:
            ran += f" ({', '.join(self.kept)} as the environment set it)"
        if not self.findings:
            return (f"NCCL probe of {self.candidate.label} ran{ran}; NCCL printed no diagnostics "
                    "report." if ran else "")
        verdict = "passed" if self.probe_ok else "failed"
        if not self.issues:
            checks = ", ".join(dict.fromkeys(f.check for f in self.findings))
            return (f"NCCL's own diagnostics in the probe of {self.candidate.label}{ran}: no issue "
                    f"({checks}); its value-checked collectives {verdict}.")
        said = "; ".join(f"{f.report} {f.check}: {f.text}" for f in self.issues[:6])
        more = f" (+{len(self.issues) - 6} more)" if len(self.issues) > 6 else ""
        return (f"NCCL's own diagnostics in the probe of {self.candidate.label}{ran} report: "
                f"{said}{more}. Informational (NCCL's words): the value-checked collectives "
                f"{verdict}, and they decide.")
