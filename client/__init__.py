"""The application side: the endpoint client, the `semif` CLI, the demo and examples."""
