"""Lambda handler of the post-deploy endpoint check (runs in AWS, not at synth)."""
