"""The shared core: user errors and the one command-line entry point."""
