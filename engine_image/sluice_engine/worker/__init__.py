"""One rank's model: its step inputs (persistent buffers), the forward, CUDA graphs, warm-up, and the
memory it measures and budgets."""
