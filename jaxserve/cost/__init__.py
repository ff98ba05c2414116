"""What serving costs, in one place.

- :mod:`~jaxserve.cost.prices`: per-model prices (per million tokens, or
  derived from hardware per hour and a plan profile's rates) and the cost
  of a number of tokens;
- :mod:`~jaxserve.cost.jobs`: what one job costs the worker (its admission
  estimate, its result's ``usage.cost``);
- :mod:`~jaxserve.cost.deployments`: what a planned deployment costs per
  day and per million tokens, and a big model compared with a small
  fallback (``jaxserve plan --compare``).

Cost reads plans and profiles (:mod:`jaxserve.planning`); planning knows
nothing of prices.
"""
