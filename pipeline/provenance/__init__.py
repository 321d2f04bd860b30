"""Provenance: in-toto statements, DSSE signing, and the audit that re-checks a whole input chain."""
