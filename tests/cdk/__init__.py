"""Tests of the CDK app: environment config, construct props, templates, the build waiter."""
