"""The benchmark suite's parts, driven by ``benchmarks/suite.py``.

- ``record``: the one results schema and the one naming rule
  (``benchmarks/results/<scenario>-<UTC>.json``);
- ``machine``: what every result records about the machine (CPU, flags,
  cores, measured bandwidth and f32/int8 GEMM rates) and the commit;
- ``procs``: process trees, pausing idle systems, a peer kept loaded behind
  the ``--serve`` protocol of ``benchmarks/peers/common.py``;
- ``rounds``: systems alternated in rounds (rotating order, the others
  paused), medians and spreads of each and of the ratio;
- ``table``: the current table at the top of BENCHMARKS.md;
- ``scenarios``: one module per named scenario.
"""
