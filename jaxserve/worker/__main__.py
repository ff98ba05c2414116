"""``python -m jaxserve.worker ...``: the same as ``jaxserve worker``."""

from jaxserve.cli.queue_commands import worker

if __name__ == "__main__":
    worker(prog_name="python -m jaxserve.worker")
