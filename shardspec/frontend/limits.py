"""What the front end accepts at most, beyond which input is refused with a finding rather
than processed at any cost: one place for the bounds that the parser, the command line
and the manifests share.

* :data:`MAX_TOKEN`: characters in one name, pattern, quoted path or number of a spec
  (``SS007``). Real names are tens of characters; a token of megabytes is a mistake (or an
  attack) whose cost would grow with its length in every check that reads it.
* :data:`MAX_NUMBER`: a whole number in a spec or a ``-D`` (``SS006``): sizes, counts and
  head sizes are at most what a tensor's int64 sizes hold. Python also refuses to read
  integers of over 4,300 digits, which used to surface as a traceback.
"""

from __future__ import annotations

MAX_TOKEN = 4096
MAX_NUMBER = 2**63 - 1
_MAX_DIGITS = len(str(MAX_NUMBER))

NUMBER_HINT = (
    f"sizes, counts and head sizes are at most {MAX_NUMBER} (2**63 - 1), "
    "the largest size a tensor dimension can have"
)


def number_too_large(digits: str) -> bool:
    """Whether the whole number written ``digits`` (ASCII digits, leading zeros allowed) is
    more than :data:`MAX_NUMBER`, told without converting a number of any length."""
    significant = digits.lstrip("0")
    return len(significant) > _MAX_DIGITS or (
        len(significant) == _MAX_DIGITS and int(significant) > MAX_NUMBER
    )
