"""The docs stay true to the code: architecture.md's module table is what the modules' docstrings say."""

from __future__ import annotations

from ..support.module_table import DOC, module_table, with_table


def test_the_module_table_lists_every_module_with_its_docstring():
    text = DOC.read_text()
    assert with_table(text) == text, "docs/architecture.md's module table is stale: run python -m tests.support.module_table"
    assert "`compiler/passes/descriptor_counts.py` | Descriptor counts" in module_table()
