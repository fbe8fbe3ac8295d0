"""One CloudFormation stack per deployable unit; the environment types (`config.py`) and data
(`environments.py`) they are built from. Stacks import constructs, never the other way round.
"""
