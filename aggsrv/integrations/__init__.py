"""Adapters that embed aggsrv in other federated-learning stacks (optional extras)."""
