"""The fixed set of step shapes the runner compiles ahead of time.

A step's flat token count is padded up to a *token bucket*; the number of
sequences that sample a token is padded up to a *sequence bucket*. Both are
powers of two (plus the configured maxima), so the whole serving life of a
worker touches a handful of compiled programs, all built before the first
job is consumed.
"""

from __future__ import annotations

import bisect
import dataclasses


def _powers_of_two(lo: int, hi: int) -> list[int]:
    out = []
    value = lo
    while value < hi:
        out.append(value)
        value *= 2
    out.append(hi)
    return sorted(set(out))


@dataclasses.dataclass(frozen=True)
class Buckets:
    """Token buckets (forward pass) and sequence buckets (logits + sampling)."""

    tokens: tuple[int, ...]
    seqs: tuple[int, ...]

    @classmethod
    def build(
        cls,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        min_tokens: int = 8,
        single_token: bool = False,
        max_logits_rows: int | None = None,
    ) -> Buckets:
        """Powers of two from ``min_tokens`` up to the maxima. ``single_token``
        adds a 1-token bucket below them: one sequence decoding then runs a
        program of one token instead of ``min_tokens``, which pays where the
        dense layers' cost grows with the padded token count (the CPU's
        matrix-vector kernel, ``jaxserve.kernels.cpu.matvec_cpu``).

        ``max_logits_rows`` (speculative decoding: more sampled rows than
        sequences, ``SchedulerConfig.max_num_logits_rows``): the sequence
        buckets go on in powers of two up to it, and with ``single_token``
        the 2- and 4-token buckets are added, so one sequence verifying one
        or three guesses runs the matrix-vector kernel's own sizes instead
        of the 8-token program."""
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError(
                f"need max_num_batched_tokens >= 1 and max_num_seqs >= 1, got "
                f"{max_num_batched_tokens} and {max_num_seqs}"
            )
        lo = min(min_tokens, max_num_batched_tokens)
        small: set[int] = {1} if single_token else set()
        seqs = set(_powers_of_two(1, max_num_seqs))
        if max_logits_rows is not None and max_logits_rows > max_num_seqs:
            seqs.update(_powers_of_two(1, max_logits_rows))
            if single_token:
                small.update(t for t in (2, 4) if t < lo)
        tokens = tuple(sorted({*_powers_of_two(lo, max_num_batched_tokens), *small}))
        return cls(tokens=tokens, seqs=tuple(sorted(seqs)))

    def token_bucket(self, num_tokens: int) -> int:
        return self._pick(self.tokens, num_tokens, "tokens")

    def seq_bucket(self, num_seqs: int) -> int:
        return self._pick(self.seqs, num_seqs, "sequences")

    @staticmethod
    def _pick(options: tuple[int, ...], value: int, what: str) -> int:
        i = bisect.bisect_left(options, value)
        if i == len(options):
            raise ValueError(f"a step of {value} {what} exceeds the largest bucket {options[-1]}")
        return options[i]
