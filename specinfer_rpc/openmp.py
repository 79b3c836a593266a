"""OpenMP's idle spinning, bounded in the model services, which share cores with each other.

After a parallel region, libgomp's threads spin before they sleep, so that the next region starts
at once. In one process that is what makes a forward pass fast; across processes it is theft: after
each verifier step, the verifier's idle threads kept spinning for milliseconds of CPU (default spin
count), the very time the speculators were drafting the next tree there. A spin count of 3000
keeps the forward as fast (its regions follow each other within microseconds) and burns almost
nothing after it. libgomp reads the count once, when torch loads it,
so a service's entry point calls `bound_spin` before anything imports torch (a test checks the
order); an operator's own GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
"""

from __future__ import annotations

import os

SPIN_COUNT = "3000"


def bound_spin() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
