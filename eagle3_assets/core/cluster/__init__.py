"""Where a stage's work goes on a Ray cluster GPU host: the placement its pre-flight found, and Ray's means to follow it."""
