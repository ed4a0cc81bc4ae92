"""Whether the quantized generators still follow the learner: sync.follow_floor over sync.follow_window syncs of the
update visibility that each sync measures (rollout/quantization/requantize.py)."""
from __future__ import annotations

import math
from collections import deque

from qgrpo.core.records import WeightSync


class FollowWatch:
    def __init__(self, floor: float, window: int):
        self.floor, self.window = floor, window
        self.shares: deque[float] = deque(maxlen=window)

    def after(self, sync: WeightSync) -> str | None:
        """A warning when the shares of codes changed over the last `window` syncs add up to less than `floor`
        (then the window starts again, so a run that stays stuck is told once per window); None otherwise, and
        always where nothing was measured (bf16 generators, sync.visibility = false) or floor is 0."""
        share = sync.code_change_frac_min
        if self.floor <= 0 or math.isnan(share):
            return None
        self.shares.append(share)
        total = sum(self.shares)
        if len(self.shares) < self.window or total >= self.floor:
            return None
        self.shares.clear()
        return (f"the quantized generators are not following the learner: over the last {self.window} syncs "
                f"{total:.2g} of their weights' codes changed (sync.follow_floor = {self.floor:g}), so the samples "
                "come from a policy that barely moves. Try sync.requantize = \"error_feedback\" or \"stochastic\", "
                "or a higher rollout.precision; sync.follow_floor = 0 turns this warning off")
