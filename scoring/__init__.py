"""Scoring workers: judges vote on a turn given its next state; votes become reward, hint and
teacher logprobs. Runs in `nextstate worker`; nothing below it (the pool, the gateway, the
trainer) imports this package: they queue work through ``datapool.queue``."""
