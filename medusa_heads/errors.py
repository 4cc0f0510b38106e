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


def read_jsonl(path: str | Path, what: str, field: str, kind: type,
               partial_last_line: bool = False) -> list[tuple[int, dict]]:
    """(line number, row) for the rows of a user's jsonl file, each an object whose `field` is a `kind`; blank
    lines are skipped and every problem is a one-line MedusaError naming the file (and line).
    `partial_last_line`: a last line without its newline is skipped (a file a distill run is still appending to)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise MedusaError(f"{what} `{path}` does not exist.") from None
    except (OSError, UnicodeDecodeError) as err:
        raise MedusaError(f"Cannot read {what.lower()} `{path}`: {err}.") from None
    lines = text.split("\n")
    if partial_last_line:
        lines = lines[:-1]  # the piece after the last newline is empty or being written
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise MedusaError(f"{path}:{n} is not valid JSON.") from None
        if not isinstance(row, dict) or not isinstance(row.get(field), kind):
            raise MedusaError(f"{path}:{n} is not a JSON object with a {kind.__name__} field `{field}`.")
        rows.append((n, row))
    return rows
