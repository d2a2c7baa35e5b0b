"""What a candidate costs and what a probe proved: the probe's specification, result and parser,
a rehearsed probe fault, the per-device memory of a candidate, and the time estimate."""
