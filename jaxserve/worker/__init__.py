"""jaxserve.worker: the RabbitMQ queue worker (see docs/protocol.md).

Heavy imports live in submodules: ``jaxserve.worker.worker.Worker``
(its module docstring lists the others, in the order a job meets them),
``jaxserve.worker.job_run`` (one job, delivery to ack),
``jaxserve.worker.lifecycle`` (a job key's states and deliveries),
``jaxserve.worker.replies`` (publishing with deadlines),
``jaxserve.worker.engine_host`` (the contract between the worker and its
engine's host: ``EngineHost``, ``EngineInfo``), its two hosts
``jaxserve.worker.engine_thread.EngineThread`` (the engine on a thread) and
``jaxserve.worker.engine_process.EngineProcess`` (the same, in a process of
its own: ``jaxserve worker``'s default), both driving one
``jaxserve.worker.engine_loop.EngineLoop`` (commands and steps on the
engine's one thread),
``jaxserve.worker.store`` (sqlite, memory and Redis idempotency stores).
Names, messages and validation shared with producers are in ``jaxserve.wire``.
"""
