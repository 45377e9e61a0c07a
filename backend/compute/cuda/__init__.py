"""The CUDA compute path: ``step`` (the forward as one pure tensor function over static buffers), ``ops`` (its
non-matrix stages: Triton kernels on CUDA, plain torch elsewhere), ``kernels`` (the Triton kernels: fused
norm and rotary, paged decode and varlen prefill attention), ``runner`` (decode replayed from CUDA graphs per
batch bucket, prefill as one varlen forward).

Importable on every machine: nothing here touches CUDA or imports Triton at import time, and the runner
built from it says why it is unavailable where there is no GPU or no Triton.
"""
