"""Running the GPU stages on the GPU host: the pre-flight, the stage lock, the jobs, the remote shell."""
