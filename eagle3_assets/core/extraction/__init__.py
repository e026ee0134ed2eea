"""The target's hidden states for EAGLE-3: extracted exactly, streamed to disk, resumable, checked."""
