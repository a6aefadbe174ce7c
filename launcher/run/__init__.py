"""Carrying out a plan: bind, set the environment, exec or watch one child."""
