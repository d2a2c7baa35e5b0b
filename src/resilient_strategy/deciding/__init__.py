"""One decision: the executor that runs inspect -> plan -> probe -> apply in a bounded loop, the
cache of what probes proved on this machine, and what the user sees while and after deciding."""
