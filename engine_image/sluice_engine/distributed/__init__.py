"""Tensor and pipeline parallelism: how a model is split over ranks (layout), the process group each
rank joins (parallel_state), the ranks' processes (launcher, worker) and how rank 0 drives them
(executor). docs/architecture.md, "Ranks", has the picture."""
