"""The KV cache: where K/V blocks live and how they move.

The block pool of one device and its allocator, the radix prefix cache with its eviction policies, the
slower tiers behind it (host RAM, disk) with prefetch, spilling of idle live handles, persistence, and
the KV manager that decides which blocks hold a state's K/V. Nothing here runs the model: the
runtime hands these modules token ids and blocks, never a forward pass.
"""
