"""The CPU compute path: the fused prefill on oneDNN-packed weights, the fused decode step on kvbaton's
C++ kernels (``csrc/``, built once per machine), and the row buckets that bound oneDNN's shapes."""
