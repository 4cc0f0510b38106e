class MedusaError(ValueError):
    """Bad input from a user: the CLI prints the message on one line and exits non-zero."""
