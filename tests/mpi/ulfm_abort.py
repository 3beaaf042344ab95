"""An error on one rank under Open MPI's ULFM ends the whole launch (tests/test_healing.py).

Rank 1 of 4 raises; the others wait outside MPI, where no lost-rank error can reach them:
only the launch's end stops them.
"""

import time

import mpidp

if mpidp.rank() == 1:
    raise ValueError("rank 1 fails")
time.sleep(120)
print(f"rank {mpidp.rank()} ran to its end", flush=True)
