"""Speculative decoding's drafts: which tokens a step guesses for a row,
and how many of those guesses the step carries.

A decoding row normally computes one token per step. With drafts, the row
is scheduled as its last sampled token followed by ``k`` guessed tokens;
the target model's outputs at those ``k + 1`` positions are sampled as if
each guess had been accepted, and the guesses are kept while they equal
what was sampled (:func:`accepted_run`). So a step yields between 1 and
``k + 1`` tokens for the row, every one of them the token decoding without
drafts would have produced at that position: a guess is never emitted, a
sample is. Where the drafts come from never matters to exactness, only to
speed.

Sampled rows: the sample at a position is the seeded draw decoding without
drafts makes there (``fold_in(seed, output_index)`` from the position's own
distribution ``q``: penalties, grammar mask, temperature and filters as if
the guesses before it were output). A guess ``d`` is a point mass, for
which the standard rejection rule keeps ``d`` with probability
``min(1, q(d) / 1) = q(d)`` and otherwise draws from ``max(0, q - 1_d)``
renormalized, that is ``q`` without ``d``. Keeping ``d`` exactly when the
draw ``x`` equals it does both: ``d`` is kept with probability ``q(d)``, and
otherwise ``x`` is emitted, distributed as ``q`` given ``x != d``. The rule
is realised with the draw the position makes anyway, so a seeded job's
text is the one it has without speculation, not only a text from the same
distribution.

Where the guesses come from (vLLM's ``ngram`` method, prompt lookup):

- :class:`NgramIndex`: the last ``n`` tokens of the sequence (prompt and
  output, ``prompt_lookup_max`` down to ``prompt_lookup_min``) matched at
  their latest earlier occurrence; the tokens that followed it are the
  guess. Copying work (extraction, quoting, summaries that reuse the
  source's words, code edits) repeats long runs of the prompt; a model
  that loops repeats its own output. The index is kept per request and
  extended as tokens arrive, so a lookup costs a few dict reads whatever
  the context length.
- for a row under a grammar (structured output), the tokens the grammar
  forces next (llguidance's fast-forward tokens: a JSON object's keys and
  punctuation), then the n-gram guess, cut where the grammar refuses it.

How many guesses a step carries (:meth:`Drafter.choose`): each row's
guesses are worth their chance of being accepted (grammar-forced ones
count as certain; an n-gram guess at depth ``i`` counts ``alpha ** i``,
``alpha`` the row's own acceptance rate for guesses from a match of that
length, a decayed count of its verified guesses). A step's cost grows with
its token bucket (every step is padded to one,
``jaxserve.engine.buckets``), not with its token count, so the drafter
weighs the step's expected tokens against the cost of each bucket the
guesses could fill and keeps the guesses of the best bucket, the most
valuable first. A row whose guesses keep failing loses them (its ``alpha``
falls), and after ``MISSES_BEFORE_PAUSE`` verifications in a row that kept
none it stops guessing for a while (``PAUSE_STEPS`` of its steps, doubling
up to ``MAX_PAUSE_STEPS``), then tries again: not switched off for good,
since a copying stretch may start later. Rows with no match are ordinary
decode rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jaxserve.engine.request import Request
    from jaxserve.engine.structured import Constraint

#: the methods ``EngineArgs.speculative_method`` takes (vLLM's name for prompt lookup)
SPECULATIVE_METHODS = ("ngram",)
#: a row whose n-gram guesses were all rejected in this many verifications
#: in a row makes none for ``PAUSE_STEPS`` of its steps, then tries again;
#: each further pause is twice as long, up to ``MAX_PAUSE_STEPS``
MISSES_BEFORE_PAUSE = 3
PAUSE_STEPS = 4
MAX_PAUSE_STEPS = 64
#: guesses are told apart by the length of the match they come from: 1, 2, 3+
NUM_CLASSES = 3


def match_class(n: int) -> int:
    """The acceptance class of a guess from an ``n``-token match."""
    return min(max(n, 1), NUM_CLASSES) - 1


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """The drafter's settings (``EngineArgs``' ``num_speculative_tokens``,
    ``speculative_method``, ``prompt_lookup_max``, ``prompt_lookup_min``).

    ``cost_doubling_tokens``: the step size (in tokens) that costs twice a
    one-token step; a step of ``B`` tokens is taken to cost ``1 + B /
    cost_doubling_tokens`` one-token steps. 32 fits SmolLM2-135M on a
    2-core CPU (one token 1.0, 8 tokens 1.28, 16 about 1.9, 32 about 2.1,
    64 about 2.8, from ``benchmarks/single_token_ab.py`` and
    ``benchmarks/step_bucket_probe.py``); an accelerator, where a step of a
    few hundred tokens costs what one does, would take a much larger value.
    """

    num_speculative_tokens: int = 4
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    cost_doubling_tokens: float = 32.0
    #: the acceptance rate a row starts from, by the length of the match its
    #: guess comes from (1, 2, 3 or more tokens): a one-token match is weak
    #: evidence. Measured on SmolLM2-135M's greedy outputs (the ``speculative``
    #: benchmark's summaries, invoices and random prompts): a guessed token
    #: was kept 10-33 % of the time after a one-token match, 25-90 % after
    #: two, 50-97 % after three or four
    prior_alpha: tuple[float, float, float] = (0.15, 0.35, 0.6)
    #: the prior's weight in verified guesses, and the decay of a row's
    #: counts per verification
    prior_weight: float = 2.0
    decay: float = 0.85

    def validate(self) -> None:
        def positive_int(name: str, minimum: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

        positive_int("num_speculative_tokens", 0)
        positive_int("prompt_lookup_min", 1)
        positive_int("prompt_lookup_max", 1)
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        if not self.cost_doubling_tokens > 0:
            raise ValueError(f"cost_doubling_tokens must be > 0, got {self.cost_doubling_tokens!r}")


class NgramIndex:
    """Where each n-gram of a token list last occurred with a token after it.

    For every ``n`` in ``min_n .. max_n`` it maps an n-gram to the position
    right after its latest occurrence that is not the list's own tail (so a
    continuation exists). :meth:`extend` indexes tokens appended since the
    last call; a list that got shorter (a request recomputed after a failed
    step) is indexed again from scratch. Entries are checked against the
    list when read, so a stale one can cost a guess, never a wrong token:
    every guess is verified by the model anyway.
    """

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n
        # keyed by the n-gram's hash (a collision costs a guess: lookups check the tokens)
        self._last: list[dict[int, int]] = [{} for _ in range(max_n + 1)]
        self._indexed = 0  # tokens whose n-grams ending before them are in the index

    def extend(self, tokens: Sequence[int], known: int) -> None:
        """Index ``tokens[:known]`` (``known``: the tokens whose values are
        known, a pending one left out)."""
        if known < self._indexed:
            self._last = [{} for _ in range(self.max_n + 1)]
            self._indexed = 0
        # an n-gram ending at j (exclusive) is indexed once tokens[j] is known
        for j in range(max(self._indexed, 1), known):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                self._last[n][hash(tuple(tokens[j - n : j]))] = j
        self._indexed = max(self._indexed, known)

    def propose(self, tokens: Sequence[int], known: int, k: int) -> list[int]:
        """Up to ``k`` tokens guessed to follow ``tokens[:known]``: what
        followed the latest earlier occurrence of its longest indexed tail.
        A continuation that runs into the tail repeats with its period
        (``a b a b`` goes on ``a b``)."""
        return self.lookup(tokens, known, k)[1]

    def lookup(self, tokens: Sequence[int], known: int, k: int) -> tuple[int, list[int]]:
        """:meth:`propose`'s guess with the length of the match it comes
        from (0 and no guess: no match)."""
        if k <= 0:
            return 0, []
        self.extend(tokens, known)
        for n in range(min(self.max_n, known - 1), self.min_n - 1, -1):
            tail = tuple(tokens[known - n : known])
            j = self._last[n].get(hash(tail))
            if j is None or j >= known or tuple(tokens[j - n : j]) != tail:
                continue
            guess: list[int] = []
            period = known - j
            for i in range(k):
                guess.append(tokens[j + i] if j + i < known else guess[i - period])
            return n, guess
        return 0, []


@dataclasses.dataclass
class _RowStats:
    """A request's drafting state: its index and its acceptance counts."""

    index: NgramIndex
    #: per match class (see ``match_class``): decayed counts of accepted
    #: n-gram guesses and of those the model judged
    accepted: list[float] = dataclasses.field(default_factory=lambda: [0.0] * NUM_CLASSES)
    tried: list[float] = dataclasses.field(default_factory=lambda: [0.0] * NUM_CLASSES)
    #: the step's proposal until it is verified: (grammar-forced, guessed) counts
    proposed: tuple[int, int] = (0, 0)
    proposed_class: int = 0
    misses: int = 0  # verifications in a row that kept none of its n-gram guesses
    skip: int = 0  # steps left in which it makes no n-gram guess
    backoff: int = PAUSE_STEPS  # the next pause's length


@dataclasses.dataclass
class Proposal:
    """One row's guesses for the step being planned: the grammar-forced
    ones first, then the n-gram ones; ``values`` are their chances of being
    accepted (non-increasing)."""

    request_id: str
    tokens: list[int]
    values: list[float]
    num_forced: int
    #: the length of the match the n-gram guesses come from (0: none)
    match: int = 0


class Drafter:
    """Proposes and sizes each step's drafts (see the module docstring).

    ``constraints``: the engine's structured-output matchers by request id
    (read, never changed: a matcher is copied before it is advanced);
    ``stop_ids``: a request's stop tokens (a guess is cut after the first,
    since nothing follows it); ``token_buckets``: the runner's compiled step
    sizes.
    """

    def __init__(
        self,
        config: SpeculativeConfig,
        token_buckets: Sequence[int],
        constraints: Mapping[str, Constraint] | None = None,
        stop_ids: Callable[[str], set[int] | frozenset[int]] | None = None,
    ) -> None:
        config.validate()
        self.config = config
        self.token_buckets = tuple(sorted(token_buckets))
        self.constraints: Mapping[str, Constraint] = constraints if constraints is not None else {}
        self.stop_ids = stop_ids or (lambda _rid: frozenset())
        self._rows: dict[str, _RowStats] = {}
        #: counters since start (as vLLM's spec_decode metrics): verified rows,
        #: guessed tokens, accepted guessed tokens
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ------------------------------------------------------------ per row

    def _row(self, request_id: str) -> _RowStats:
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = _RowStats(
                NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            )
        return row

    def limit(self, req: Request) -> int:
        """Most guesses ``req`` may carry: the engine's
        ``num_speculative_tokens``, the job's own (``SamplingParams``) when
        lower, and never a guess past ``max_tokens`` (the step's last token
        is sampled, not guessed)."""
        k = self.config.num_speculative_tokens
        own = req.sampling_params.num_speculative_tokens
        if own is not None:
            k = min(k, own)
        return max(0, min(k, req.max_tokens - req.num_output_tokens - 1))

    def alpha(self, request_id: str, n: int = 1) -> float:
        """The row's chance that a guess from an ``n``-token match is
        accepted, given the guesses before it were."""
        row = self._rows.get(request_id)
        cfg = self.config
        c = match_class(n)
        accepted, tried = (0.0, 0.0) if row is None else (row.accepted[c], row.tried[c])
        return (accepted + cfg.prior_alpha[c] * cfg.prior_weight) / (tried + cfg.prior_weight)

    def propose(self, req: Request, k: int) -> Proposal | None:
        """Up to ``k`` guesses to follow ``req``'s tokens, or None."""
        if k <= 0 or req.pending_index is not None:
            return None
        rid = req.request_id
        tokens = req.all_token_ids
        row = self._row(rid)
        forced: list[int] = []
        constraint = self.constraints.get(rid)
        matcher = None
        if constraint is not None:
            if constraint.error is not None:
                return None
            constraint.catch_up(req.output_token_ids)
            if constraint.error is not None:
                return None
            matcher = constraint.matcher
            forced = [int(t) for t in matcher.compute_ff_tokens()][:k]
        n = 0
        guessed: list[int] = []
        if row.skip > 0:  # paused after its guesses kept failing: only a grammar's forced tokens
            row.skip -= 1
        elif forced:
            context = list(tokens) + forced
            if len(forced) < k:
                n, guessed = row.index.lookup(context, len(context), k - len(forced))
        else:
            n, guessed = row.index.lookup(tokens, len(tokens), k)
        guess = forced + guessed
        if matcher is not None and guessed:
            guess = guess[: matcher.validate_tokens(guess)]
        stops = self.stop_ids(rid)
        for i, token in enumerate(guess):
            if token in stops:
                guess = guess[: i + 1]
                break
        if not guess:
            return None
        num_forced = min(len(forced), len(guess))
        a = self.alpha(rid, n)
        values = [1.0] * num_forced + [a ** (i + 1) for i in range(len(guess) - num_forced)]
        return Proposal(rid, guess, values, num_forced, n)

    def may_propose(self, req: Request) -> bool:
        """Whether ``req`` is likely to carry guesses in its next step: the
        tail of its known tokens has an earlier match. Asked before its
        in-flight token is known (``step_modes.choose``: a step that could
        guess is planned after its tokens are fetched, not overlapped)."""
        if req.request_id in self.constraints or self.limit(req) <= 0:
            return False
        known = req.num_tokens if req.pending_index is None else req.pending_index
        row = self._row(req.request_id)
        if row.skip > 0:
            return False
        n, guess = row.index.lookup(req.all_token_ids, known, 1)
        # worth a step's overlap only when such guesses get accepted
        return bool(guess) and self.alpha(req.request_id, n) >= 0.3

    # ------------------------------------------------------------ sizing

    def cost(self, num_tokens: int) -> float:
        """A step's cost in one-token steps, by its bucket (see ``SpeculativeConfig``)."""
        return 1.0 + self.bucket(num_tokens) / self.config.cost_doubling_tokens

    def bucket(self, num_tokens: int) -> int:
        for b in self.token_buckets:
            if b >= num_tokens:
                return b
        return num_tokens

    def choose(
        self, proposals: Sequence[Proposal], *, base_tokens: int, base_rows: int, max_tokens: int
    ) -> dict[str, list[int]]:
        """The guesses a step carries, by request: the most valuable
        ``D`` of all proposed, ``D`` (at most ``max_tokens``) picked so that
        the step's expected tokens per unit of cost are highest, with
        ``base_tokens`` planned without guesses, ``base_rows`` of which
        sample a token. Rows keep a prefix of their proposal."""
        if not proposals or max_tokens <= 0 or base_rows <= 0:
            return {}
        # the guesses in order of value; within a row they stay in order
        order = sorted(
            ((p.values[i], r, i) for r, p in enumerate(proposals) for i in range(len(p.tokens))),
            key=lambda item: (-item[0], item[1], item[2]),
        )
        order = order[:max_tokens]
        gains = [0.0]
        for value, _, _ in order:
            gains.append(gains[-1] + value)
        best_d, best = 0, base_rows / self.cost(base_tokens)
        cuts = {len(order)}
        cuts.update(b - base_tokens for b in self.token_buckets if 0 < b - base_tokens < len(order))
        for d in sorted(cuts):
            score = (base_rows + gains[d]) / self.cost(base_tokens + d)
            if score > best * (1 + 1e-9):
                best_d, best = d, score
        taken = [0] * len(proposals)
        for _, r, _ in order[:best_d]:
            taken[r] += 1
        return {p.request_id: p.tokens[:n] for p, n in zip(proposals, taken) if n}

    # ------------------------------------------------------------ verdicts

    def drafted(self, request_id: str, tokens: Sequence[int], num_forced: int, match: int = 1) -> None:
        """``tokens`` of ``request_id``'s proposal (guessed from a
        ``match``-token match after ``num_forced`` forced ones) were planned
        into a step."""
        row = self._row(request_id)
        forced = min(num_forced, len(tokens))
        row.proposed, row.proposed_class = (forced, len(tokens) - forced), match_class(match)

    def verified(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The step verified ``num_drafts`` guesses of the request and kept
        ``num_accepted``: update its acceptance counts (the n-gram guesses
        only; grammar-forced ones say nothing about them)."""
        row = self._rows.get(request_id)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if row is None:
            return
        forced, guessed = row.proposed
        row.proposed = (0, 0)
        if guessed <= 0 or num_accepted < forced:
            return
        accepted = num_accepted - forced
        tried = accepted + 1 if accepted < guessed else guessed
        decay, c = self.config.decay, row.proposed_class
        row.accepted[c] = decay * row.accepted[c] + accepted
        row.tried[c] = decay * row.tried[c] + tried
        if accepted:
            row.misses, row.backoff = 0, PAUSE_STEPS
            return
        row.misses += 1
        if row.misses >= MISSES_BEFORE_PAUSE:  # stop guessing for a while
            row.misses, row.skip = 0, row.backoff
            row.backoff = min(2 * row.backoff, MAX_PAUSE_STEPS)

    def forget(self, request_id: str) -> None:
        self._rows.pop(request_id, None)


def accepted_run(candidates: Sequence[int], drafts: Sequence[int], stop_ids: set[int] | frozenset[int]) -> list[int]:
    """A row's new tokens from a step that verified ``drafts``:
    ``candidates[i]`` is the token sampled at the position after the row's
    last token and ``drafts[:i]``, as if those guesses were right. The
    guesses are right while they equal the samples, so the run is the
    samples up to and including the first that differs from its guess (or
    the one after the last guess); it ends early at a stop token, after
    which decoding would have stopped."""
    run = [int(candidates[0])]
    for guess, sampled in zip(drafts, candidates[1:]):
        if run[-1] != guess or run[-1] in stop_ids:
            break
        run.append(int(sampled))
    for i, token in enumerate(run):
        if token in stop_ids:
            return run[: i + 1]
    return run
