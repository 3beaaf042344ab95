"""Rank 1 raises while the others wait in a barrier: mpidp must end the whole job."""

import sys
import time

import mpidp

if mpidp.rank() == 1:
    time.sleep(0.5)
    raise ValueError("boom from rank 1")
mpidp.barrier()  # never completes: rank 1 does not get here
sys.exit("rank 0 passed a barrier that rank 1 never reached")
