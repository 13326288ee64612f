"""The fault suite of issue 13 (docs/reliability.md)."""
