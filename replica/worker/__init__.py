"""One rank's worker: the device, the model runner (persistent batch, paged attention, sampling)."""
