"""The pure core, one folder per kind, stacked bottom first: `values` (facts, candidates, bounded
parsing), `knowledge` (rules, signatures, remedies, causes and their tables), `call` (options, the
arguments and the model read into them), `measures` (the probe's specification, result and
parser; memory and time estimates), `trace` (typed events), and `planning` (the planner). Data
in, data out: nothing here reads the hardware, the environment, files (other than the ones a
caller names), processes or the network, and nothing here imports a framework
(``tests/test_architecture.py``)."""
