"""vLLM servers: starting them, reading their metrics, the deployed draft and watching it in production."""
