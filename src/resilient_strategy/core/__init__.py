"""The pure core, one folder per kind, stacked bottom first: `values` (facts, candidates, bounded
parsing), `knowledge` (rules, signatures, remedies, causes and their tables), `measures` (the
probe's specification, result and parser; memory and time estimates), `trace` (typed events)
beside `call` (options and the arguments read into them), and `planning` (the planner). Data in,
data out: nothing here reads the hardware, the environment, files (other than the ones a caller
names), processes or the network, and nothing here imports a framework
(``tests/test_architecture.py``)."""
