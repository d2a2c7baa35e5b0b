"""Probe workers: run as ``python -m resilient_strategy.probing.workers.<framework>_worker``.

Each worker proves one candidate (checked all-reduce, bandwidth, one training step) and writes
one JSON report; `resilient_strategy.probing.prober` starts them, `resilient_strategy.core.measures.probe.
parse_probe` reads what they left behind. Nothing here is imported by the library itself.
"""
