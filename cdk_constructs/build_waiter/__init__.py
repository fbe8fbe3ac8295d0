"""Lambda code for the deploy-time CodeBuild runner (see `handler.py`)."""
