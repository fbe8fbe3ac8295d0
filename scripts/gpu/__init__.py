"""The one-shot GPU check (`scripts/gpu-check.sh`): prepare here, build and measure there.

A GPU machine lent to this project has no network and no package index, so everything it
needs is prepared here (`prepare`): a trimmed llama-cpp-python source tarball and the pure
Python wheels the adapter needs. There, `run_checks` starts the adapter on a generated
random-weight model of realistic shape, checks offload, shared state and prefix reuse, and
measures the performance report's figures at GPU sizes.
"""
