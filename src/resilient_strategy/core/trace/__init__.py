"""The typed trace: one frozen event per thing the planner or the executor did or saw."""
