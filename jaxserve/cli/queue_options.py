"""Options shared by the queue-side commands: ``--amqp-url`` and ``--prefix``
(``worker``, ``submit``, ``chat``, ``status``, ``loadtest``, ``dead``,
``gateway``), ``--state-dir`` and ``--redis-url`` (``worker`` and
``gateway``) and the sampling options of ``submit`` and ``chat``. One
definition each, so the flags, their environment variables and defaults stay
the same on every command."""

from __future__ import annotations

from typing import Any

import click

from jaxserve.wire.topology import DEFAULT_AMQP_URL, DEFAULT_PREFIX

#: ``--amqp-url`` of every command that talks to the broker
amqp_option = click.option(
    "--amqp-url",
    envvar="JAXSERVE_AMQP_URL",
    default=DEFAULT_AMQP_URL,
    show_default=True,
    help="RabbitMQ URL (env JAXSERVE_AMQP_URL).",
)
#: ``--prefix`` of every command that talks to the broker
prefix_option = click.option(
    "--prefix",
    envvar="JAXSERVE_PREFIX",
    default=DEFAULT_PREFIX,
    show_default=True,
    help="Name prefix of queues and exchanges (env JAXSERVE_PREFIX).",
)


def state_dir_option(help: str) -> Any:
    """``--state-dir`` (env ``JAXSERVE_STATE_DIR``, default
    ``jaxserve.worker.store.sqlite.default_state_dir``) of ``worker`` and
    ``gateway``: one folder that both default to and one variable that sets
    it for both, so the two declarations must not drift. ``help`` says what
    the command keeps there."""
    return click.option(
        "--state-dir", type=click.Path(file_okay=False), default=None, envvar="JAXSERVE_STATE_DIR", help=help
    )


def redis_url_option(help: str | None = None) -> Any:
    """``--redis-url`` (env ``JAXSERVE_REDIS_URL``) of ``worker`` and
    ``gateway``: replicas of both meet on one Redis, so the variable and the
    default must be the same on each. ``help`` says what the command keeps
    there."""
    return click.option(
        "--redis-url", envvar="JAXSERVE_REDIS_URL", default="redis://127.0.0.1:6379/0", show_default=True, help=help
    )


def sampling_options(fn: Any) -> Any:
    """The job parameters ``submit`` and ``chat`` (and nothing else) take;
    :func:`sampling_params` turns their values into job fields."""
    for opt in reversed(
        [
            click.option(
                "--max-tokens", type=int, default=None, help="Completion length limit (default: the worker's, 16)."
            ),
            click.option("--temperature", type=float, default=None),
            click.option("--top-p", type=float, default=None),
            click.option("--top-k", type=int, default=None),
            click.option("--seed", type=int, default=None),
            click.option("--stop", multiple=True, help="Stop string (repeatable)."),
            click.option(
                "--model",
                default=None,
                help="Model to run the job: routes it to the workers serving that name (default: the deployment's "
                "default model); a model nobody serves is unknown_model at once.",
            ),
        ]
    ):
        fn = opt(fn)
    return fn


def sampling_params(
    max_tokens: Any, temperature: Any, top_p: Any, top_k: Any, seed: Any, stop: tuple, model: Any
) -> dict[str, Any]:
    """The job fields of :func:`sampling_options`' values (``None``: left out
    of the job by ``jaxserve.client.build_job``, so the worker's default holds)."""
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop": list(stop) or None,
        "model": model,
    }
