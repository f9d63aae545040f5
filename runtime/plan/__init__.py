"""The plan file: schema (entries, sides, derived items), column tables, invariants, header rules, reader, writer."""
