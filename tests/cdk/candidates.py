"""Environments whose decision endpoint shadows a candidate, synthesized as the CLI would
(cdk-nag and the image rule included) for the candidate tests; the shipped environments
name no candidate."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import aws_cdk as cdk
from cdk_nag import AwsSolutionsChecks

from cdk_constructs.container_image import PrivateEcrImageRule
from cdk_constructs.endpoint_props import GpuPlacement
from stacks.config import REPO_ROOT, CandidateSettings, EnvironmentConfig
from stacks.deployment import add_environment
from stacks.environments import CUDA13_AMI, ENVIRONMENTS, SMOLLM2_135M
from tests.support.templates import CDK_CONTEXT, VALID_CALIBRATION

# dev's model refitted: the same GGUF with a calibration, so a model object of its own.
CPU_CANDIDATE = CandidateSettings(
    model=replace(SMOLLM2_135M, calibration=VALID_CALIBRATION),
    sampling_percentage=25,
    option_order="debiased",
)
# gpu's model on two of its four pool types, two instances.
GPU_CANDIDATE = CandidateSettings(
    model=ENVIRONMENTS["gpu"].model,
    sampling_percentage=100,
    instance_count=2,
    placement=GpuPlacement(
        instance_pools=("ml.g6e.xlarge", "ml.g5.2xlarge"),
        provision_timeout_seconds=1200,
        inference_ami_version=CUDA13_AMI,
    ),
    readout="likelihood",
)


def with_candidate(env: str, name: str, candidate: CandidateSettings) -> EnvironmentConfig:
    """Shipped environment `env`, renamed `name`, recording digests and shadowing
    `candidate`, on instances of its own (a shadow and scale to zero exclude each other)."""
    base = ENVIRONMENTS[env]
    decision = replace(base.decision, audit="digest", candidate=candidate, scale_to_zero=None)
    return replace(base, name=name, decision=decision)


# dev (CPU, with its asynchronous endpoint) and gpu (pools), each with a candidate.
CPU_ENV = with_candidate("dev", "shadow", CPU_CANDIDATE)
GPU_ENV = with_candidate("gpu", "shadow-gpu", GPU_CANDIDATE)


def synthesize_checked(configs: tuple[EnvironmentConfig, ...], outdir: Path) -> dict[str, Any]:
    """The templates of `configs` by stack name; any cdk-nag finding fails the synth."""
    app = cdk.App(outdir=str(outdir), context=CDK_CONTEXT)
    for config in configs:
        add_environment(app, config, REPO_ROOT)
    cdk.Aspects.of(app).add(PrivateEcrImageRule())
    cdk.Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return {stack.stack_name: stack.template for stack in app.synth().stacks}
