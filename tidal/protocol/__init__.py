"""Everything that crosses a process boundary: msgspec Structs, enums and errors.

The bottom layer (docs/architecture.md#layers): modules here import only msgspec, the standard library
and ``tidal.sampling_params`` (the parameters' own wire form), never torch, so every layer
above can share them without a cycle.
"""
