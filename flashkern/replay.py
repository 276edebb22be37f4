"""Bounded replay after a prefix-cache hit (docs/operators.md section 8.4).

Window caches are not part of the prefix cache: after a hit of `hit` tokens the last `window` positions' window
records do not exist. Without replay the hit cannot be used and the whole prompt is recomputed. With bounded replay
(vLLM's default; `--no-swa-bounded-replay` turns it off) a hit longer than the window is adopted: the tokens
[hit - window, hit) are recomputed to rebuild their window records (their compressed records stay cached), and
their window attention reads nothing below hit - window (sparse_decode_attention's swa_lower), so the result
differs from a cold run by design. Hits of window tokens or fewer are not adopted.

    plan = plan_replay(hit=4096, new_tokens=37)
    plan.recompute      # range(3968, 4133): the chunk to run (replayed rows, then the new tokens)
    plan.lower          # 3968: swa_lower of this sequence for the chunk's attention
"""

from __future__ import annotations

from typing import NamedTuple

from flashkern import checks
from flashkern.reference.kv_cache import WINDOW


class ReplayPlan(NamedTuple):
    adopted: bool  # whether the prefix hit is used
    replay_start: int  # the first recomputed position: hit - window when adopted, else 0
    recompute: range  # the positions to run: [replay_start, hit + new_tokens)
    replayed: range  # those of them inside the hit: [replay_start, hit)
    lower: int  # the lowest position the chunk's window attention may read (= replay_start)


def plan_replay(hit: int, new_tokens: int, window: int = WINDOW, enabled: bool = True) -> ReplayPlan:
    """What a request with a prefix-cache hit of `hit` tokens and `new_tokens` tokens after it must run.

    Adopted (enabled and hit > window): recompute [hit - window, hit + new_tokens) with the window bounded below at
    hit - window. Otherwise (disabled, or hit <= window: vLLM does not adopt such hits) the full recompute
    [0, hit + new_tokens) with no bound (lower 0)."""
    checks.integer("hit", hit, low=0)
    checks.integer("new_tokens", new_tokens, low=0)
    checks.integer("window", window, low=1)
    adopted = enabled and hit > window
    start = hit - window if adopted else 0
    return ReplayPlan(adopted, start, range(start, hit + new_tokens), range(start, hit), start)
