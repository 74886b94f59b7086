"""The pipe transports (multiprocess, shared, in-process): a control
channel per worker over a ``multiprocessing`` pipe, and the stagings its
workers read: one segment they copy out of, versioned slots they run on,
and, for a trainer on a GPU, device memory for workers on GPUs."""
