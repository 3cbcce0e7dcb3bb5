"""The trainer: samples from the pool, objectives, the local (torch + peft) and veRL backends,
publishing to vLLM (docs/trainer.md).

Importing this package sets ``OMP_WAIT_POLICY=PASSIVE`` unless it is set already, so that it is
in place before torch loads OpenMP. With OpenMP's default, a thread that reaches a barrier spins
for its peers; beside a vLLM-CPU server that is serving (the embedded ``up --train``, online
training on one machine), a peer waits for a core, the spinning thread holds the other, and a
forward and backward pass of SmolLM2 over 240 tokens took 40.7 s instead of 3.1 s on 2 cores
(``benchmarks/trainer/contention.py``). Passive waiting costs about a tenth alone. Set
``OMP_WAIT_POLICY=ACTIVE`` to keep OpenMP's default; it has no effect once torch is imported.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
