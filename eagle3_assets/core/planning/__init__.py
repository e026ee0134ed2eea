"""Planning a run before and while it runs: which shards train, what the whole run needs of disk and GPU time."""
