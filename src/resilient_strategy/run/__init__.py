"""``resilient-strategy run``: the command line, the supervisor that decides once and relaunches,
one attempt through torch's elastic agent, the watch on training progress, the verdict on an
attempt, the peers of a multi-node run, and the worker that runs the user's script."""
