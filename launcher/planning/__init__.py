"""Planning: the user's options, the facts read once, and the pure plan built from both."""
