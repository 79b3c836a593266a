"""Whether speculation pays at the current batch size, decided from measurements.

The tree budget bounds how many tree nodes a batch may verify, but not whether a tree is worth
its cost: that depends on the hardware (on a GPU verifying 64 extra rows is almost free; on a CPU
it is not) and on how well the SSMs predict. So the manager measures. Per batch-size bucket
(1, 2-3, 4-7, 8-15, ...) it keeps the output rate (tokens per second over whole iterations,
drafting, RPCs and verification included) with speculation and without, as moving averages, and
speculates only where that is faster by `margin` (measurements are noisy, and the promise is never
to be slower than no speculation); every `explore`-th iteration of a bucket it runs the other
choice to keep its estimate current.

Only steady iterations (no prompt being prefilled) are recorded: a prefill would be charged to
whichever choice happened to run it.
"""

from __future__ import annotations


class SpeculationController:
    def __init__(self, explore: int = 48, smoothing: float = 0.1, margin: float = 0.1):
        self.explore = explore
        self.smoothing = smoothing
        self.margin = margin
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, speculating) -> tokens/s
        self.iterations: dict[int, int] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return batch_size.bit_length()

    def speculate(self, batch_size: int) -> bool:
        b = self.bucket(batch_size)
        n = self.iterations[b] = self.iterations.get(b, 0) + 1
        on, off = self.rate.get((b, True)), self.rate.get((b, False))
        if on is None or off is None:  # measure both first
            return on is None
        better = on > (1 + self.margin) * off
        return (not better) if n % self.explore == 0 else better

    def record(self, batch_size: int, speculated: bool, tokens: int, seconds: float) -> None:
        key = (self.bucket(batch_size), speculated)
        rate = tokens / max(seconds, 1e-9)
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else (1 - self.smoothing) * old + self.smoothing * rate
