"""What a candidate costs and what a probe proved: the probe's specification, result and parser,
the per-device memory of a candidate, and the time estimate."""
