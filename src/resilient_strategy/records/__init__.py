"""What crosses a process boundary as a file: progress records of probe workers and training
ranks, the handoff from ``resilient-strategy run`` to its workers (the decision, error records,
the checkpoint note), and the rehearsed training fault a handoff carries."""
