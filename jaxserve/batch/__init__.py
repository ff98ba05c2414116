"""``jaxserve batch``: a file of documents or requests through the queue.

:mod:`.inputs` reads JSONL, CSV and Parquet into jobs (OpenAI Batch lines,
jaxserve job bodies, or table rows through a template) with keys scoped to
the file; :mod:`.openai_format` writes OpenAI Batch output lines;
:mod:`.run` publishes, collects, resumes and deduplicates.
"""
