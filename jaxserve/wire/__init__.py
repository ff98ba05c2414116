"""jaxserve.wire: the queue contract shared by the worker and the client.

One definition of everything that crosses the broker: queue and exchange
names (:mod:`~jaxserve.wire.topology`), error codes and their retryability
(:mod:`~jaxserve.wire.errors`), the job body and its translation into
sampling parameters (``jaxserve.sampling_params``) with every range check
(:mod:`~jaxserve.wire.job`), and the typed replies
(:mod:`~jaxserve.wire.messages`). The JSON Schemas under ``queues/schemas/``
are generated from these models (:mod:`~jaxserve.wire.schemas`). Nothing
here imports JAX, the engine or the worker (``tests/test_import_rules.py``).
"""

from jaxserve.wire.errors import ERROR_CODES, RETRYABLE_CODES, is_retryable
from jaxserve.wire.job import (
    DEFAULT_MAX_BODY_BYTES,
    Job,
    JobBody,
    JobLimits,
    JobProperties,
    check_reply_to,
    derive_seed,
    parse_expiration,
    parse_job,
)
from jaxserve.wire.messages import Cancel, Chunk, ErrorInfo, Result, Usage, WireDecodeError, decode_cancel, decode_reply
from jaxserve.wire.topology import (
    BATCH,
    DEFAULT_AMQP_URL,
    DEFAULT_PREFIX,
    INTERACTIVE,
    QUEUE_CLASSES,
    Topology,
    TopologyMismatch,
)

__all__ = [
    "BATCH",
    "DEFAULT_AMQP_URL",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_PREFIX",
    "ERROR_CODES",
    "INTERACTIVE",
    "QUEUE_CLASSES",
    "RETRYABLE_CODES",
    "Cancel",
    "Chunk",
    "ErrorInfo",
    "Job",
    "JobBody",
    "JobLimits",
    "JobProperties",
    "Result",
    "Topology",
    "TopologyMismatch",
    "Usage",
    "WireDecodeError",
    "check_reply_to",
    "decode_cancel",
    "decode_reply",
    "derive_seed",
    "is_retryable",
    "parse_expiration",
    "parse_job",
]
