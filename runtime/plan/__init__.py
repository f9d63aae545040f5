"""The plan file: its schema (entries, sides, column tables, derived items), invariants, header rules, reader and writer."""
