"""The pure core: facts, options, known-issue rules, candidates, the planner, the cost model, the
probe's specification, result and parser, and the trace. Data in, data out: nothing here reads
the hardware, the environment, files (other than the rules a caller names), processes or the
network, and nothing here imports a framework (``tests/test_architecture.py``)."""
