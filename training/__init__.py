"""Training engine: data, synchronous data-parallel SGD over MPI, epoch logs, checkpoints."""
