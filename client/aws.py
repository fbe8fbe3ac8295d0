"""The AWS plumbing the offline paths share: boto3 clients for control-plane and S3 calls,
and s3:// URIs.

A transform job (client.batch_aws) and the asynchronous endpoint (client.async_endpoint)
both need them, and the asynchronous endpoint sits below the client (for
`DecisionClient.batch_async`), so they live below both. The invocation clients, with
botocore's retries off, are the transports' own (client.transports).
"""

from __future__ import annotations

from typing import Any

from client.errors import BatchInputError

# A mini-batch may take long on CPU: SageMaker's longest invocation timeout (a transform
# job's InvocationsTimeoutInSeconds, an asynchronous invocation's InvocationTimeoutSeconds).
INVOCATIONS_TIMEOUT_S = 3600


def aws_client(service: str, region: str | None) -> Any:
    """A boto3 client with botocore's own retries (control-plane and S3 calls here are
    cheap to repeat, unlike an invocation under the client's retry policy)."""
    import boto3

    return boto3.client(service, region_name=region)


def split_s3_uri(uri: str) -> tuple[str, str]:
    """(bucket, key or prefix) of an s3:// URI, else a BatchInputError naming it."""
    scheme, _, rest = uri.partition("://")
    bucket, _, key = rest.partition("/")
    if scheme != "s3" or not bucket:
        raise BatchInputError(f"{uri!r} is not an s3://bucket/prefix URI")
    return bucket, key
