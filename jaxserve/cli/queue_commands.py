"""Queue-side CLI commands: ``worker``, ``submit``, ``chat``, ``batch``,
``status``. Each lives in a module of its own (``worker_command``,
``submit_command``, ``batch_command``, ``status_command``; shared options in
``queue_options``, and ``jaxserve.cli.main`` finds each at its home); this
module re-exports them because ``jaxserve.worker.__main__``,
``jaxserve.cli.loadtest_command`` and the tests import them by this path."""

from __future__ import annotations

from jaxserve.cli.batch_command import batch
from jaxserve.cli.queue_options import amqp_option, prefix_option, sampling_options, sampling_params
from jaxserve.cli.status_command import status
from jaxserve.cli.submit_command import chat, submit
from jaxserve.cli.worker_command import worker

# the names loadtest_command (and anything older) imports
_amqp_option = amqp_option
_prefix_option = prefix_option
_sampling_options = sampling_options
_params = sampling_params

__all__ = ["worker", "submit", "chat", "batch", "status"]
