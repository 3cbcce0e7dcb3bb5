"""nextstate test suite (a regular package, so it wins over the `tests` package veRL installs)."""
