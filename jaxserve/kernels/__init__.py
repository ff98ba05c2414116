"""jaxserve.kernels: the paged KV cache and attention over it.

- ``kv_cache``: the cache arrays and their layouts (``blocks``, the CPU's;
  ``heads``, the shipped Pallas kernels');
- ``attention_metadata``: what one step tells the kernels;
- ``paged_attention``: the pure-JAX kernels (the CPU's path and the oracle);
- ``cpu``: the C++ paged-attention kernel for the CPU (XLA FFI), built on
  first use with the host's compiler;
- ``pallas_attention``: adapters onto the paged-attention kernels JAX ships in Pallas;
- ``backends``: which of them a layer runs (``EngineArgs.attention_backend``),
  and the per-layer ``shard_map`` of tensor parallelism.
"""
