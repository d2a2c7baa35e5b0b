"""The planner: the chain of candidates, sharding and memory steps, the ranking, and the one shape
every decider returns (`decision`)."""
