"""Running the GPU stages on the GPU host: the pre-flight, the stage lock, the remote shell.

A stage's job is its domain's (``core/extraction/job.py``, ``core/training/job.py``,
``core/evaluation/job.py``): this package carries it to the stage as JSON and never reads it.
"""
