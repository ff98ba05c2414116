"""Helpers of the fault-injection suite (``benchmarks/faults.py``).

- ``services``: a private RabbitMQ node and a private Redis, started and
  torn down by the suite (the shared ones on 5672/6379 are never touched);
- ``tcp_proxy``: an asyncio TCP proxy that can cut every proxied connection;
- ``collector``: records every reply (or, for ``jaxserve batch`` runs, every
  reply the firehose tracer saw) and counts missing and doubled finals;
- ``procs``: ``jaxserve worker`` / ``jaxserve batch`` subprocesses, RSS;
- ``rawamqp``: a subprocess tool that publishes bytes aio-pika refuses to
  encode (invalid UTF-8 properties, out-of-range timestamps) and reads
  queues whose messages aio-pika cannot decode (dead letters);
- ``malformed``: the seeded generator of malformed jobs.
"""
