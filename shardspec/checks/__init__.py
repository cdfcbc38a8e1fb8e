"""Static checks: one registry of codes (``registry``) and the checks that use them."""
