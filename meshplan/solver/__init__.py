"""The layout solver and cost model behind ``meshplan estimate`` and ``meshplan solve`` (torch-free; see docs/solver.md)."""
