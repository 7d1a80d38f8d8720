"""The one error of the claims ledger: a problem in ``claims.yaml`` or in the results it reads; and the reading of
the ledger's JSON record files (``untrained.json``, ``code_changes.json``) that raises it."""
import json
from pathlib import Path


class ClaimsError(Exception):
    """A problem in claims.yaml or in the results it reads, reported as one line naming the place."""


def read_record(path: Path, fix: str):
    """The JSON content of the record file at ``path`` (None when there is none); a file that is not JSON (a merge
    left conflict markers in it, a hand edit) is refused naming it and ``fix``, never read as no record."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ClaimsError(f"{path}: not JSON ({err}); {fix}") from None
