"""The core's values: the machine's facts, a candidate, a worker's outcome, the TF_CONFIG cluster,
size-bounded parsing and human units. Imports nothing of the core above it."""
