"""The Ray and Serve session fixtures (`ray_session`, `serve_session`) are in tests/conftest.py, shared with
tests/reliability."""
