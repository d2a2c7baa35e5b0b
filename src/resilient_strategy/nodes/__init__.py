"""Agreement between processes that decide together: the ranks of one node (``onenode``), the
nodes of a torch job through the launcher's store (``store``, ``routes``, ``crossprobe``,
``manynodes``), and TensorFlow workers under ``TF_CONFIG`` (``tfworkers``)."""
