"""The request runtime: one request from admission to its result.

The lifecycle (reservation, chunked prefill, the decode loop; it runs a request's cross-prefix reuse
step), the batching scheduler that runs every forward on one thread, the request counters (a leaf the
stats read), sampling, incremental detokenization and constrained decoding.
"""
