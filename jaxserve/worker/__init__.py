"""jaxserve.worker: the RabbitMQ queue worker (see docs/protocol.md).

Heavy imports live in submodules: ``jaxserve.worker.worker.Worker``,
``jaxserve.worker.engine_thread.EngineThread``,
``jaxserve.worker.idempotency`` (MemoryStore, RedisStore),
``jaxserve.worker.topology`` (names and arguments, pure data).
"""
