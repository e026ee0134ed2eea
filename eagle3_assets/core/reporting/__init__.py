"""What the assets show: a gate's outcome, plots as markdown."""
