"""The embedded default: a tiny reasoning target built in code, and built-in prompt sets."""
