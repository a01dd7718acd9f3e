"""Everything that crosses a process boundary: msgspec Structs, enums and errors.

The bottom layer (DESIGN.md 1): modules here import only msgspec and the standard
library, so every layer above can share them without a cycle.
"""
