"""specd's library: the models, the speculative math and the transport-free loop (the services are in services/).

The native kernels run their OpenMP regions back to back within a pass; between passes a model
service waits for the network, and libgomp's default wait (300 000 spins: ~9 ms of a core after
each pass on a 2-core EPYC) kept one of the host's cores from the other model's next pass, the
coordinator and Redis: a target pass right after a draft's ran 11 % slower (benchmarks/README.md).
So threads spin OMP_SPINCOUNT times (~2 ms there: the regions of a pass follow each other far
sooner) and then sleep. Set here, before torch loads libgomp (which the kernels share); a user's own
GOMP_SPINCOUNT or OMP_WAIT_POLICY wins.
"""

import os

OMP_SPINCOUNT = 10_000
SPIN_SET_BY_SPECD = "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ
if SPIN_SET_BY_SPECD:
    os.environ["GOMP_SPINCOUNT"] = str(OMP_SPINCOUNT)
