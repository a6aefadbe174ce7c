"""Performance model, tune measurements and predictions (``tune``, ``predict``)."""
