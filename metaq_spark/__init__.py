"""Spark 4 Python Data Source for metaq (filled in by the source and sink issues)."""
