"""Where one `model.tar.gz` lives: the value the model build hands to every endpoint."""

from __future__ import annotations

from dataclasses import dataclass

from aws_cdk import Token
from aws_cdk import aws_kms as kms
from aws_cdk import aws_s3 as s3

from cdk_constructs.validation import require


@dataclass(frozen=True, kw_only=True)
class ModelArtifact:
    """`s3://<bucket>/<object_key>`, encrypted with `key`.

    Bucket and key are long-lived (referencing them from another stack makes it wait for the
    artifact stack); the object key is content-addressed, so a new model is a new object.
    """

    bucket: s3.IBucket
    key: kms.IKey
    object_key: str

    def __post_init__(self) -> None:
        require(
            not Token.is_unresolved(self.object_key),
            "model.object_key: must be known at synth time (it names the exact object)",
        )
        require(
            self.object_key.endswith(".tar.gz") and not self.object_key.startswith("/"),
            f"model.object_key: {self.object_key!r} must be a relative key ending in .tar.gz",
        )

    @property
    def model_data_url(self) -> str:
        """SageMaker's `ModelDataUrl`; the build writes exactly this object."""
        return f"s3://{self.bucket.bucket_name}/{self.object_key}"

    @property
    def object_arn(self) -> str:
        return self.bucket.arn_for_objects(self.object_key)

    def s3_uri(self, prefix: str) -> str:
        """`s3://<bucket>/<prefix>`: where offline requests and answers live beside the model."""
        return f"s3://{self.bucket.bucket_name}/{prefix}"
