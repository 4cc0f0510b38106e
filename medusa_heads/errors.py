import json
from pathlib import Path


class MedusaError(ValueError):
    """Bad input from a user: the CLI prints the message on one line and exits non-zero."""


def read_json(path: str | Path, what: str, shown: str | None = None):
    """The JSON in a user's file, or a one-line MedusaError naming it as `what` (e.g. "Tree file") and `shown`."""
    shown = shown or str(path)
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise MedusaError(f"{what} `{shown}` does not exist.") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise MedusaError(f"{what} `{shown}` is not valid JSON: {err}.") from None
