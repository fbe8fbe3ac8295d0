"""The one failure type of the model build.

Every refusal and failure a user can act on (bad URI, checksum mismatch, no chat template,
no permission, ...) is a `BuildError` whose message is the whole story in one line, so the
command line can print `model-build: <message>` and exit non-zero without a traceback.
"""


class BuildError(Exception):
    """A build step refused or failed; the message names the problem in one line."""
