"""The shared core: user errors, the one command-line entry point, and the cache's place."""
