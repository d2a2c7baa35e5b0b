"""Proving a candidate for real: the process-group runner (one deadline, the whole group killed),
the prober that starts a probe's workers and parses what they did, how a worker starts, the
GPU health check after a killed GPU probe, and the worker scripts themselves (``workers/``)."""
