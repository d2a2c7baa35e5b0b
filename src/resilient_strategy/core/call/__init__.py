"""The call: every option validated once (`options`), read from ``resilient_strategy()``'s
arguments, ``resilient-strategy run``'s and the environment (`arguments`)."""
