"""``jaxserve gateway``: OpenAI's HTTP API in front of the queues.

One more producer on the workers' broker and prefix: chat and completions
(whole or streamed), models, files and batches, a status page, metrics.
:mod:`.app` assembles the routes; :mod:`.completions` the synchronous
requests; :mod:`.batches` and :mod:`.batch_runner` the Batch API over
``jaxserve batch``'s machinery; :mod:`.store` (SQLite or Redis) and
:mod:`.files` where batches and files live; :mod:`.broker_view` what the
broker says about models and queues; :mod:`.translate` and :mod:`.errors`
OpenAI's shapes. docs/gateway.md describes it for users.
"""
