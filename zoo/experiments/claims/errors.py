"""The one error of the claims ledger: a problem in ``claims.yaml`` or in the results it reads."""


class ClaimsError(Exception):
    """A problem in claims.yaml or in the results it reads, reported as one line naming the place."""
