"""Real services for the test suite and the benchmarks, in one place both may import.

- :mod:`tests.support.pg`: a PostgreSQL to test on (the local service, or a throwaway cluster
  that can be crashed and restarted), fresh databases on it;
- :mod:`tests.support.redis_server`: the same for Redis;
- :mod:`tests.support.processes`: `nextstate gateway` / `nextstate worker` in processes of
  their own, waiting on a state;
- :mod:`tests.support.upstream`: a fast fake of vLLM's OpenAI wire format
  (`python -m tests.support.upstream --port N`).

and what the tests share, since no test module imports another (tests/test_architecture.py):
captured turns built in one call (:mod:`tests.support.records`), the admin UI through a
TestClient (:mod:`tests.support.admin_ui`), generated conversations and their trajectories,
planted secrets, the deterministic judges.

Nothing that serves or trains imports it (tests/test_architecture.py checks, deferred imports included).
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
"""The repository's root: the working directory of the commands the tests run."""
