"""One CloudFormation stack per deployable unit, plus the typed per-environment config."""
