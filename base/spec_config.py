"""The pydantic settings every section of a spec file shares: an unknown key is refused (a typo is an error, not a
silent default), values are frozen, and each field's docstring is its description in the JSON schema (`sluice
schema`: what an editor shows beside the field).
"""

from __future__ import annotations

from pydantic import ConfigDict

SPEC_SECTION_CONFIG = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
