"""Entry points and assembly: OpenAI HTTP ingress, typed config, Serve app builder, CLI."""
