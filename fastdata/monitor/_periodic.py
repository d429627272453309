"""Periodic stalls: the saw-tooth of a loader whose workers refill in bursts.

With ``num_workers=k`` and each worker building whole batches, a loader that cannot keep up
delivers k batches almost at once and then nothing while all k workers build the next ones: every
k-th step waits long, the others not at all. GPU utilisation then shows a saw-tooth. The share
of time spent waiting says *that* the job is starved; the period says *why* (a burst of k = the
worker count) and what absorbs it (prefetch depth covers a burst only if it holds a whole
period's batches; more workers shorten the refill).

Detection on the per-step waits: the first wait (start-up) is left out; a step "stalls" when its
wait exceeds ``min_stall_s``, 4x the 25th percentile (for a period k >= 2 at least half the steps
are fast, so the 25th percentile is a fast step's wait) and a quarter of the median wait of the
steps above those two (so a 1-2 ms scheduler hiccup is not taken for a 30 ms tooth); the period is the most common
distance between consecutive stalls. It counts as periodic when there are at least
``min_stalls`` stalls, at least half of the distances equal the period and at least 3/4 are a
multiple of it (a burst that happened to arrive in time skips one tooth). Random spikes (the
scheduler on a busy machine) have irregular distances and are not reported as periodic.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from fastdata._util import quantile

# Waits below this never count as stalls: sub-0.5 ms jitter is launch and hand-off noise.
MIN_STALL_S = 0.5e-3


@dataclass(frozen=True)
class PeriodicStalls:
    """Every ``period``-th step waited ``mean_s`` on average for its input."""

    period: int
    stalls: int  # stalled steps seen
    mean_s: float  # mean wait of a stalled step
    fast_s: float  # median wait of the other steps
    total_s: float  # time spent in the stalls
    regularity: float  # share of distances between stalls equal to the period

    def describe(self) -> str:
        """One line: period, stall length, count and regularity."""
        return (f"every {_ordinal(self.period)} step stalls for {self.mean_s * 1e3:.1f} ms "
                f"({self.stalls} stalls, {self.regularity:.0%} exactly {self.period} steps apart; other steps wait "
                f"{self.fast_s * 1e3:.2f} ms)")


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def find_periodic_stalls(
    waits: Sequence[float], *, min_stall_s: float = MIN_STALL_S, min_stalls: int = 4
) -> PeriodicStalls | None:
    """The periodic stall pattern in per-step input ``waits`` (seconds), or None if there is none."""
    if isinstance(min_stalls, bool) or not isinstance(min_stalls, int) or min_stalls < 1:
        raise ValueError(f"min_stalls must be an int >= 1, got {min_stalls!r}")
    if isinstance(min_stall_s, bool) or not isinstance(min_stall_s, (int, float)) or not 0 <= min_stall_s < math.inf:
        raise ValueError(f"min_stall_s must be a finite number >= 0 (seconds), got {min_stall_s!r}")
    w = [float(x) for x in waits[1:]]  # waits[0] is worker start-up, not a cycle
    if len(w) < 2 * min_stalls:
        return None
    ordered = sorted(w)
    threshold = max(min_stall_s, 4.0 * quantile(ordered, 0.25))
    above = [x for x in ordered if x > threshold]
    if above:  # a stall is within 4x of the typical stall: a 1 ms scheduler hiccup is no 30 ms tooth
        threshold = max(threshold, quantile(above, 0.5) / 4.0)
    stalled = [i for i, x in enumerate(w) if x > threshold]
    if len(stalled) < min_stalls or len(stalled) > len(w) // 2 + 1:
        return None  # too few to call a pattern, or most steps stall: steadily starved, not a saw-tooth
    gaps = [b - a for a, b in pairwise(stalled)]
    period, exact = Counter(gaps).most_common(1)[0]
    if period < 2:
        return None
    multiples = sum(1 for g in gaps if g % period == 0)
    if exact < 0.5 * len(gaps) or multiples < 0.75 * len(gaps):
        return None
    slow = [w[i] for i in stalled]
    fast = sorted(x for i, x in enumerate(w) if x <= threshold)
    return PeriodicStalls(period=period, stalls=len(slow), mean_s=sum(slow) / len(slow),
                          fast_s=quantile(fast, 0.5), total_s=sum(slow), regularity=exact / len(gaps))
