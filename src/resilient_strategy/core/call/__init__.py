"""The call: every option validated once (`options`), read from ``resilient_strategy()``'s
arguments, ``resilient-strategy run``'s and the environment (`arguments`), with the model the
user passed (`model`) and a rehearsed probe fault (`probe_fault`)."""
