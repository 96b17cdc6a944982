"""DuckDB views and canned queries over a trace."""
