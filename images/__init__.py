"""The adapter image build: Dockerfiles, buildspec, and the smoke test run on the build host."""
