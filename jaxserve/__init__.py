"""jaxserve: a queue-fed LLM serving backend on JAX/Flax.

Jobs arrive on RabbitMQ, a continuous-batching engine runs them over a paged
KV cache, and results go back under each job's idempotency key.
"""

__version__ = "0.1.0"
