"""The version of the package (read by the report and the command line)."""

__version__ = "0.1.0"
