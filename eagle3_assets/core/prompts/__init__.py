"""Reading a prompt dataset a shard at a time: sources, indexes, normalised records, held-out prompts."""
