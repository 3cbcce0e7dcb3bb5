"""Real services for the test suite and the benchmarks, in one place both may import.

- :mod:`nextstate.testing.pg`: a PostgreSQL to test on (the local service, or a throwaway cluster
  that can be crashed and restarted), fresh databases on it;
- :mod:`nextstate.testing.redis_server`: the same for Redis;
- :mod:`nextstate.testing.processes`: `nextstate gateway` / `nextstate worker` in processes of
  their own, waiting on a state;
- :mod:`nextstate.testing.upstream`: a fast fake of vLLM's OpenAI wire format
  (`python -m nextstate.testing.upstream --port N`).

Nothing that serves or trains imports it (tests/test_architecture.py checks, deferred imports included).
"""
