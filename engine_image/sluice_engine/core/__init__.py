"""Request and KV-cache bookkeeping on the host: the scheduler, the KV cache manager, requests and the
SchedulerOutput a step is built from. No torch: it runs the same beside any device."""
