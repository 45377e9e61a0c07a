"""Compute: loading a model and running its forward passes over the paged pool.

``runner`` is the seam between the runtime and the hardware: prefill chunks and decode steps behind one
interface (:class:`~.runner.ModelRunner`), with the eager runner (``eager``: the Hugging Face model with
``attention``'s paged attention; on CPU with ``cpu/``'s oneDNN-packed weights and C++ kernels) and the CUDA
one (``cuda/``: graphs, paged attention kernels) behind it. ``selector`` is the one place that chooses the
runner and the attention backend for a model's device and dtype; ``loader`` only loads models.
"""
